"""The wire format's parts without a server: incremental text (SmolLM2's byte-level BPE against
its own whole decode, for random token sequences and random chunkings; stop strings; a decode
window that stays small however long the stream) and the fields that are refused."""

from __future__ import annotations

import random

import pytest

from trtspec.serve.openai_api import (
    UNSUPPORTED,
    ApiError,
    IdTexts,
    TextStream,
    refuse_unsupported,
)

PARAGRAPH = ("Speculative decoding drafts a few tokens — «cheaply» — and the target verifies "
             "them in one pass: naïve café, 日本語のテキスト, emoji 😀👍🏽🇫🇷 and math ∑ x² ≤ 1. ")


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from trtspec.runtime.models import resolve

    return AutoTokenizer.from_pretrained(resolve("smollm2-135m-instruct"))


def whole(tokenizer, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=True)


def chunks(ids: list[int], rng: random.Random, most: int = 6) -> list[list[int]]:
    out, i = [], 0
    while i < len(ids):
        n = rng.randint(1, most)
        out.append(ids[i: i + n])
        i += n
    return out


def sequences(tokenizer, rng: random.Random, count: int) -> list[list[int]]:
    """Random token sequences: real text (multi-byte characters, emoji split over byte
    tokens), tokens that are parts of characters, special tokens, and any token at all."""
    text = tokenizer(PARAGRAPH * 2)["input_ids"]
    vocab = len(tokenizer)
    partial = [i for i in range(vocab) if "\ufffd" in tokenizer.decode([i])]
    special = list(tokenizer.all_special_ids)
    assert len(partial) > 100 and special
    out = []
    for n in range(count):
        size = rng.randint(1, 60)
        pool = [text, partial, partial + text + special, range(vocab)][n % 4]
        if n % 4 == 0:
            start = rng.randrange(len(text))
            out.append(text[start: start + size])
        else:
            out.append([rng.choice(pool) for _ in range(size)])
    return out


def test_pushed_text_is_the_whole_decode_for_any_chunking(tokenizer) -> None:
    rng = random.Random(0)
    decode = lambda ids: whole(tokenizer, ids)  # noqa: E731
    for ids in sequences(tokenizer, rng, 160):
        want = whole(tokenizer, ids)
        for _ in range(6):
            stream = TextStream(decode)
            got = "".join(stream.push(c) for c in chunks(ids, rng)) + stream.flush()
            assert got == want, ids
            assert not stream.stopped


def test_a_stop_string_ends_the_text_where_a_whole_decode_finds_it(tokenizer) -> None:
    """Reference: the first k with a stop string in decode(ids[:k]) (tokens_used = k); the
    text ends at the earliest such stop string there."""
    rng = random.Random(1)
    decode = lambda ids: whole(tokenizer, ids)  # noqa: E731
    tried = 0
    for ids in sequences(tokenizer, rng, 240):
        full = whole(tokenizer, ids)
        if len(full) < 4:
            continue
        stops = []
        for _ in range(rng.randint(1, 3)):
            at = rng.randrange(len(full) - 1)
            stops.append(full[at: at + rng.randint(1, 6)])
        stops = [s for s in stops if "\ufffd" not in s]  # not a character: not a stop string
        if not stops:
            continue
        k = next(k for k in range(1, len(ids) + 1)
                 if any(s in whole(tokenizer, ids[:k]) for s in stops))
        text = whole(tokenizer, ids[:k])
        want = text[: min(text.find(s) for s in stops if s in text)]
        for _ in range(4):
            stream = TextStream(decode, stops)
            got = []
            for piece in chunks(ids, rng):
                got.append(stream.push(piece))
                if stream.stopped:
                    break
            got.append(stream.flush())
            assert stream.stopped and "".join(got) == want, (ids, stops)
            assert stream.tokens_used == k, (ids, stops)
            tried += 1
    assert tried > 300


def test_a_stop_string_split_over_pushes_is_held_back_not_sent() -> None:
    chars = lambda ids: "".join(chr(i) for i in ids)  # noqa: E731
    stream = TextStream(chars, ["STOP", "xyz"])
    sent = [stream.push([ord(c) for c in part]) for part in ("ab S", "T", "O", "P!")]
    assert sent == ["ab ", "", "", ""] and stream.stopped and stream.flush() == ""
    assert stream.tokens_used == 4 + 1 + 1 + 1  # "P" completed "STOP"; "!" does not count
    loose = TextStream(chars, ["STOP", "xyz"])
    sent = [loose.push([ord(c) for c in part]) for part in ("ab x", "y", "Q")]
    assert sent == ["ab ", "", "xyQ"] and not loose.stopped


def test_decoding_looks_at_a_small_window_however_long_the_stream(tokenizer) -> None:
    """The cost per push is O(new tokens): no decode call sees more than a few pushes' worth
    of ids, at position 100 or 4,000, with stop strings, and when every push ends
    mid-character (an emoji split over byte tokens at each push): at most two pushes and
    the REBASE_AFTER tokens a window may run past its last whole character."""
    rng = random.Random(2)
    seen: list[int] = []

    def decode(ids: list[int]) -> str:
        seen.append(len(ids))
        return whole(tokenizer, ids)

    long = tokenizer(PARAGRAPH * 60)["input_ids"]
    assert len(long) > 4000
    for stops in ((), ("never there", "nor this")):
        seen.clear()
        stream = TextStream(decode, stops)
        got = "".join(stream.push(c) for c in chunks(long, rng, most=5)) + stream.flush()
        assert got == whole(tokenizer, long)
        assert max(seen) <= 32 and len(seen) < 3 * len(long)
    emoji = tokenizer("a😀" * 1000)["input_ids"]  # "a" and the emoji's 3 byte tokens
    seen.clear()
    stream = TextStream(decode)
    pushes = [emoji[:2]] + [emoji[i: i + 4] for i in range(2, len(emoji), 4)]
    got = "".join(stream.push(p) for p in pushes) + stream.flush()
    assert got == whole(tokenizer, emoji) and max(seen) <= 32


def test_the_toy_backend_s_ids_stream_as_text() -> None:
    texts, rng = IdTexts(), random.Random(3)
    ids = [rng.randrange(32) for _ in range(200)]
    stream = TextStream(texts.decode, [" 7 3"])
    got = "".join(stream.push(c) for c in chunks(ids, rng) if not stream.stopped)
    full = texts.decode(ids)
    if " 7 3" in full:
        assert stream.stopped and got == full[: full.index(" 7 3")]
    else:
        assert got + stream.flush() == full


@pytest.mark.parametrize("field,value", [
    ("n", 2), ("best_of", 3), ("echo", True), ("suffix", "}"), ("presence_penalty", 0.5),
    ("frequency_penalty", -1), ("logit_bias", {"50256": -100}), ("logprobs", 2),
    ("logprobs", True), ("top_logprobs", 3), ("response_format", {"type": "json_object"}),
    ("tools", [{"type": "function", "function": {"name": "f"}}]), ("tool_choice", "required"),
    ("functions", [{"name": "f"}]), ("function_call", {"name": "f"}),
])
def test_a_field_that_would_change_the_answer_is_refused_by_name(field, value) -> None:
    with pytest.raises(ApiError) as info:
        refuse_unsupported({"model": "m", field: value})
    assert info.value.status == 400 and info.value.param == field
    assert str(info.value).startswith(f"{field} = ")


def test_a_field_at_its_default_is_accepted() -> None:
    refuse_unsupported({"n": 1, "best_of": 1, "echo": False, "suffix": None,
                        "presence_penalty": 0, "frequency_penalty": 0.0, "logit_bias": {},
                        "logprobs": None, "top_logprobs": 0, "response_format": {"type": "text"},
                        "tools": [], "tool_choice": "none", "functions": None,
                        "function_call": "auto"})
    refuse_unsupported({"logprobs": False})
    with pytest.raises(ApiError):  # false is not 0 where 0 is not the default
        refuse_unsupported({"presence_penalty": False})
    assert set(UNSUPPORTED) >= {"n", "best_of", "echo", "suffix", "presence_penalty",
                                "frequency_penalty", "logit_bias", "logprobs", "top_logprobs",
                                "response_format", "tools", "tool_choice"}
