"""Streamed text per token: `trtspec serve`'s incremental detokenizer against decoding the whole
output again at every push (what serve did before), at stream positions 100 and 4,000.

SmolLM2's tokenizer (byte-level BPE), one long stream of real text (a paragraph with accents,
CJK and emoji, repeated and encoded once), pushed 4 tokens at a time (a round that accepted 3
drafts). At each position the stream is brought there untimed, then the next WINDOW tokens
are pushed and timed; median over repeats of the time per token. With and without two stop
strings that never occur (the scan over the text is part of the cost). Writes
reports/bench-detok.md.

    python benchmarks/bench_detok.py            # full run (~10 s on 2 cores)
    python benchmarks/bench_detok.py --quick    # fewer repeats, a smoke test
"""

from __future__ import annotations

import argparse
import copy
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from trtspec.serve.openai_api import TextStream

PARAGRAPH = ("Speculative decoding drafts a few tokens cheaply and the target model verifies "
             "them in one forward pass; the output distribution is exactly the target's. "
             "Naïve café crème, 日本語のテキスト, emoji 😀👍🏽 and ∑ x² ≤ 1 "
             "keep the bytes honest. ")
POSITIONS = (100, 4000)
PUSH = 4  # tokens per push
WINDOW = 200  # tokens timed per position
STOPS = ("<|never|>", "END OF ANSWER")


class FullDecode:
    """The previous approach: decode every id at each push, find stop strings in the whole
    text, and (on a stop) decode each prefix to count the tokens used."""

    def __init__(self, decode: Callable[[list[int]], str], stops: Sequence[str] = ()) -> None:
        self.decode, self.stops = decode, list(stops)
        self.ids: list[int] = []
        self.sent = 0
        self.stopped = False

    def push(self, token_ids: Sequence[int]) -> str:
        self.ids += token_ids
        text = self.decode(self.ids)
        hits = [i for s in self.stops if (i := text.find(s, max(0, self.sent - len(s)))) >= 0]
        if hits:
            self.stopped = True
            return self._take(text, min(hits))
        safe = len(text) - (1 if text.endswith("\ufffd") else 0)
        for s in self.stops:
            for k in range(min(len(s) - 1, len(text)), 0, -1):
                if text.endswith(s[:k]):
                    safe = min(safe, len(text) - k)
                    break
        return self._take(text, safe)

    def _take(self, text: str, end: int) -> str:
        end = max(end, self.sent)
        out, self.sent = text[self.sent: end], end
        return out


def per_token(make: Callable[[], object], ids: list[int], position: int, repeats: int) -> float:
    """Median seconds per token of pushing ids[position : position + WINDOW]."""
    base = make()
    for i in range(0, position, PUSH):
        base.push(ids[i: min(i + PUSH, position)])
    times = []
    for _ in range(repeats + 1):  # the first is a warm-up
        stream = copy.copy(base)
        stream.ids = list(base.ids)
        t0 = time.perf_counter()
        for i in range(position, position + WINDOW, PUSH):
            stream.push(ids[i: i + PUSH])
        times.append((time.perf_counter() - t0) / WINDOW)
    return statistics.median(times[1:])


def run(repeats: int) -> tuple[list[dict], int]:
    from transformers import AutoTokenizer

    from trtspec.runtime.models import resolve

    tokenizer = AutoTokenizer.from_pretrained(resolve("smollm2-135m-instruct"))
    ids = tokenizer(PARAGRAPH * 80)["input_ids"]
    assert len(ids) >= max(POSITIONS) + WINDOW, len(ids)

    def decode(part: list[int]) -> str:
        return tokenizer.decode(part, skip_special_tokens=True)

    rows = []
    for stops in ((), STOPS):
        for name, cls in (("incremental (TextStream)", TextStream),
                          ("whole re-decode (before)", FullDecode)):
            row = {"approach": name, "stops": len(stops)}
            for position in POSITIONS:
                row[position] = per_token(lambda c=cls, s=stops: c(decode, s), ids, position,
                                          repeats)
            rows.append(row)
    return rows, len(ids)


def to_markdown(rows: list[dict], repeats: int, tokens: int, command: str) -> str:
    first, last = POSITIONS
    lines = [
        "# bench-detok: streamed text per token, incremental vs whole re-decode",
        "",
        f"Machine: {platform.machine()}, Python {platform.python_version()}. SmolLM2-135M's "
        f"tokenizer (byte-level BPE); one stream of {tokens} tokens of real text (accents, CJK, "
        f"emoji), pushed {PUSH} tokens at a time; at each position the next {WINDOW} tokens are "
        f"timed, median of {repeats} repeats.",
        "",
        f"| approach | stop strings | µs / token at {first} | µs / token at {last} | "
        f"{last} / {first} |",
        "|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(f"| {r['approach']} | {r['stops']} | {r[first] * 1e6:.1f} | "
                     f"{r[last] * 1e6:.1f} | {r[last] / r[first]:.2f}× |")
    lines += ["", "Whole re-decode / incremental, same position and stop strings:", "",
              f"| stop strings | at {first} | at {last} |", "|---:|---:|---:|"]
    for new, old in zip(rows[::2], rows[1::2], strict=True):
        lines.append(f"| {new['stops']} | {old[first] / new[first]:.1f}× | "
                     f"{old[last] / new[last]:.1f}× |")
    lines += ["", "The incremental cost per token does not grow with the position (it decodes "
              "a window of the last pushes); the whole re-decode grows with it.", "",
              f"Command: `{command}`", ""]
    return "\n".join(lines)


def main() -> None:
    import sys

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats (smoke test)")
    parser.add_argument("--out", type=Path, default=Path("reports/bench-detok.md"))
    args = parser.parse_args()
    repeats = 3 if args.quick else 15
    rows, tokens = run(repeats)
    command = "python benchmarks/bench_detok.py" + " ".join(["", *sys.argv[1:]]).rstrip()
    text = to_markdown(rows, repeats, tokens, command)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(text)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
