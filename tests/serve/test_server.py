"""`trtspec serve` over HTTP on 127.0.0.1 with the real `openai` client: completions and chat,
stream and non-stream, stop strings, 64 streaming clients on 8 slots reconciled with
/metrics, cancellation, a bad-request corpus, and `trtspec eval --endpoint` against it."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import threading
import time
import urllib.request
import weakref
from collections.abc import Iterator

import openai
import pytest
import requests
from conftest import free_port, launch

from trtspec.cli import main
from trtspec.cli.serve import toy_engine
from trtspec.runtime.toy import ToyRunner
from trtspec.serve.openai_api import TextStream
from trtspec.serve.server import IdTexts, freeze_heap, make_app
from trtspec.spec.executor import SpecExecutor


@contextlib.contextmanager
def serving(engine, api_key: str | None = None) -> Iterator[str]:
    """The app under uvicorn in a thread; yields its …/v1 base URL."""
    import uvicorn

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(make_app(engine, api_key), host="127.0.0.1",
                                           port=port, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.time() + 30
    while not server.started and time.time() < deadline:
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def metric(url: str, name: str) -> float:
    with urllib.request.urlopen(url.removesuffix("/v1") + "/metrics") as r:
        text = r.read().decode()
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith(name) and (line[len(name)] in " {"))


def settled(url: str, finish_reason: str, ended: int) -> None:
    """Nothing runs within 20 s, and ``ended`` requests ended with ``finish_reason``."""
    deadline = time.time() + 20
    while metric(url, "trtspec:num_requests_running") and time.time() < deadline:
        time.sleep(0.05)
    assert metric(url, "trtspec:num_requests_running") == 0
    assert metric(url, f'trtspec:request_success_total{{finish_reason="{finish_reason}"}}') \
        == ended


def toy(method: str = "draft_model", slots: int = 8, draft_len: int = 4, **kw):
    return toy_engine(method, draft_len, slots, kw.get("max_waiting", 256), "toy")


def slow_down(engine) -> None:
    """Make every target forward take 10 ms, so a long request outlives the test's next steps."""
    target = engine.scheduler.executor.target
    score = target.score

    def slowly(tokens, last_only=False):
        time.sleep(0.01)
        return score(tokens, last_only)

    target.score = slowly


def alone(engine, prompt: list[int], **sampling) -> list[int]:
    """What the engine's executor gives this request alone (the reference)."""
    from trtspec.spec.sample.probs import SamplingParams

    ex = engine.scheduler.executor
    fresh = SpecExecutor(ToyRunner(ex.target.model), None if ex.proposer is None else
                         type(ex.proposer)(ToyRunner(ex.proposer.runner.model)), ex.draft_len)
    return fresh.generate([prompt], SamplingParams(**sampling))[0].token_ids


def test_greedy_text_equals_trtspec_generate_s_stream_or_not(capsys) -> None:
    main(["generate", "--backend", "toy", "--method", "draft_model", "--prompt", "1 2 3",
          "--max-tokens", "12", "--temperature", "0", "--json"])
    want = IdTexts().decode(json.loads(capsys.readouterr().out)["completions"][0]["token_ids"])
    with serving(toy()) as url:
        client = openai.OpenAI(base_url=url, api_key="x")
        done = client.completions.create(model="toy", prompt="1 2 3", max_tokens=12,
                                         temperature=0)
        assert done.choices[0].text == want and done.choices[0].finish_reason == "length"
        assert done.usage.completion_tokens == 12 and done.usage.prompt_tokens == 3
        spec = done.model_extra["spec"]
        assert spec["emitted_tokens"] == 11 and spec["al"] > 1  # the first token is in none
        chat = client.chat.completions.create(
            model="toy", messages=[{"role": "user", "content": "1 2 3"}], max_tokens=12,
            temperature=0)
        assert chat.choices[0].message.content == want
        streamed = "".join(c.choices[0].text for c in client.completions.create(
            model="toy", prompt="1 2 3", max_tokens=12, temperature=0, stream=True))
        assert streamed == want
        chunks = list(client.chat.completions.create(
            model="toy", messages=[{"role": "user", "content": "1 2 3"}], max_tokens=12,
            temperature=0, stream=True, stream_options={"include_usage": True}))
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
        finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
        assert finishes[-1] == "length" and not any(finishes[:-1])
        assert chunks[-1].usage.completion_tokens == 12 and not chunks[-1].choices


def test_with_a_seed_streamed_text_equals_non_streamed() -> None:
    with serving(toy()) as url:
        client = openai.OpenAI(base_url=url, api_key="x")
        for seed in range(5):
            kw = {"model": "toy", "prompt": "4 5 6", "max_tokens": 20, "temperature": 0.9,
                  "top_p": 0.95, "seed": seed}
            whole = client.completions.create(**kw).choices[0].text
            parts = "".join(c.choices[0].text for c in
                            client.completions.create(**kw, stream=True))
            assert parts == whole


def test_stop_strings_end_the_text_even_split_across_rounds() -> None:
    engine = toy(draft_len=3)
    ex = engine.scheduler.executor
    from trtspec.spec.sample.probs import SamplingParams

    rounds = [d[0].token_ids for d in SpecExecutor(
        ToyRunner(ex.target.model), type(ex.proposer)(ToyRunner(ex.proposer.runner.model)),
        3).stream([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=24))]
    texts = IdTexts()
    edge = len(rounds[0]) + len(rounds[1])  # the last token of round 1, the first of round 2
    tokens = [t for r in rounds for t in r]
    stop = texts.decode(tokens[edge - 1: edge + 1])
    expected = texts.decode(tokens)[: texts.decode(tokens).find(stop)]
    with serving(engine) as url:
        client = openai.OpenAI(base_url=url, api_key="x")
        for stream in (False, True):
            out = client.completions.create(model="toy", prompt="1 2 3", max_tokens=24,
                                            temperature=0, stop=[stop], stream=stream)
            if stream:
                chunks = list(out)
                text = "".join(c.choices[0].text for c in chunks)
                reason = chunks[-1].choices[0].finish_reason
            else:
                text, reason = out.choices[0].text, out.choices[0].finish_reason
            assert text == expected and reason == "stop"
        assert metric(url, "trtspec:num_requests_running") == 0


def test_text_stream_holds_back_what_may_start_a_stop_string() -> None:
    stream = TextStream(lambda ids: "".join(chr(i) for i in ids), ["cde"])
    assert stream.push([ord("a"), ord("b"), ord("c")]) == "ab"  # "c" may start "cde"
    assert stream.push([ord("d")]) == ""
    assert stream.push([ord("e"), ord("f")]) == "" and stream.stopped
    assert stream.tokens_used == 5  # "e" completed the stop string; "f" does not count
    loose = TextStream(lambda ids: "".join(chr(i) for i in ids), ["cde"])
    assert loose.push([ord("c")]) == "" and loose.push([ord("x")]) == "cx"
    assert loose.flush() == "" and not loose.stopped


def test_64_streaming_clients_on_8_slots_lose_nothing_and_metrics_add_up() -> None:
    engine = toy(slots=8)
    prompts = [f"{1 + i % 9} {2 + i % 7} {3 + i % 5}" for i in range(64)]
    want = [IdTexts().decode(alone(engine, IdTexts().encode(p), temperature=0.8, seed=i,
                                   max_tokens=16 + i % 9)) for i, p in enumerate(prompts)]

    async def one(client, i: int) -> tuple[str, dict]:
        text, spec = [], {}
        async for chunk in await client.completions.create(
                model="toy", prompt=prompts[i], max_tokens=16 + i % 9, temperature=0.8,
                seed=i, stream=True, stream_options={"include_usage": True}):
            if chunk.choices:
                text.append(chunk.choices[0].text)
            else:
                spec = chunk.model_extra["spec"]
        return "".join(text), spec

    async def everyone(url: str):
        client = openai.AsyncOpenAI(base_url=url, api_key="x", max_retries=0)
        try:
            return await asyncio.gather(*(one(client, i) for i in range(64)))
        finally:
            await client.close()

    with serving(engine) as url:
        got = asyncio.run(everyone(url))
        assert [text for text, _ in got] == want  # no token lost, repeated or reordered
        for name, field in (("trtspec:spec_decode_num_draft_tokens_total", "proposed_tokens"),
                            ("trtspec:spec_decode_num_accepted_tokens_total",
                             "accepted_draft_tokens"),
                            ("trtspec:spec_decode_num_drafts_total", "drafts")):
            assert metric(url, name) == sum(spec[field] for _, spec in got) > 0
        accepted = sum(spec["accepted_draft_tokens"] for _, spec in got)
        assert metric(url, "trtspec:spec_decode_num_accepted_tokens_per_pos_total") == accepted
        assert metric(url, 'trtspec:spec_decode_num_accepted_tokens_per_pos_total'
                           '{position="0"}') > 0
        assert metric(url, "trtspec:request_success_total") == 64
        # rounds are shared by the running requests: fewer than the requests' rounds, more
        # than the longest request's
        rounds = metric(url, "trtspec:spec_decode_draft_len_count")
        assert max(spec["verification_rounds"] for _, spec in got) <= rounds \
            < sum(spec["verification_rounds"] for _, spec in got)
        assert metric(url, 'trtspec:spec_decode_draft_len_bucket{le="16.0"}') == rounds
        assert metric(url, "trtspec:spec_decode_draft_len_sum") > 0
        assert metric(url, "trtspec:spec_decode_request_draft_len_mean_count") == 64
        for name in ("time_to_first_token_seconds", "time_per_output_token_seconds",
                     "e2e_request_latency_seconds"):
            assert metric(url, f"trtspec:{name}_count") == 64
            assert metric(url, f"trtspec:{name}_sum") > 0
        assert metric(url, "trtspec:num_requests_running") == 0
        assert metric(url, "trtspec:num_requests_waiting") == 0


def test_clients_that_drop_mid_stream_free_their_slots() -> None:
    engine = toy(slots=4)
    slow_down(engine)
    with serving(engine) as url:
        body = {"model": "toy", "prompt": "1 2 3", "max_tokens": 4000, "ignore_eos": True,
                "stream": True}
        for _ in range(6):
            with requests.post(f"{url}/completions", json=body, stream=True, timeout=30) as r:
                for _line in zip(range(3), r.iter_lines(), strict=False):
                    pass  # read a little, then hang up
        settled(url, "abort", 6)
        done = openai.OpenAI(base_url=url, api_key="x").completions.create(
            model="toy", prompt="1 2 3", max_tokens=5)
        assert done.choices[0].finish_reason in ("length", "stop")
        # a non-streaming client that gives up waiting is cancelled too
        for _ in range(2):
            with pytest.raises(requests.Timeout):
                requests.post(f"{url}/completions", json={**body, "stream": False}, timeout=0.5)
        deadline = time.time() + 20
        while metric(url, "trtspec:num_requests_running") and time.time() < deadline:
            time.sleep(0.05)
        assert metric(url, "trtspec:num_requests_running") == 0
        assert metric(url, 'trtspec:request_success_total{finish_reason="abort"}') == 8


BAD = [  # (what, request kwargs, status)
    ("not JSON", {"content": b"{nope"}, 400),
    ("not UTF-8", {"content": b'{"model": "toy", "prompt": "\xff\xfe"}'}, 400),
    ("a JSON list", {"json": [1, 2]}, 400),
    ("no model", {"json": {"prompt": "1"}}, 400),
    ("unknown model", {"json": {"model": "gpt-9", "prompt": "1"}}, 404),
    ("no prompt", {"json": {"model": "toy"}}, 400),
    ("empty prompt", {"json": {"model": "toy", "prompt": ""}}, 400),
    ("prompt of the wrong type", {"json": {"model": "toy", "prompt": {"a": 1}}}, 400),
    ("max_tokens negative", {"json": {"model": "toy", "prompt": "1", "max_tokens": -1}}, 400),
    ("max_tokens zero", {"json": {"model": "toy", "prompt": "1", "max_tokens": 0}}, 400),
    ("max_tokens huge", {"json": {"model": "toy", "prompt": "1", "max_tokens": 10**9}}, 400),
    ("max_tokens a string", {"json": {"model": "toy", "prompt": "1", "max_tokens": "x"}}, 400),
    ("temperature < 0", {"json": {"model": "toy", "prompt": "1", "temperature": -0.5}}, 400),
    ("top_p > 1", {"json": {"model": "toy", "prompt": "1", "top_p": 1.5}}, 400),
    ("top_p 0", {"json": {"model": "toy", "prompt": "1", "top_p": 0}}, 400),
    ("n = 2", {"json": {"model": "toy", "prompt": "1", "n": 2}}, 400),
    ("5 stop strings", {"json": {"model": "toy", "prompt": "1", "stop": list("abcde")}}, 400),
    ("logprobs", {"json": {"model": "toy", "prompt": "1", "logprobs": 2}}, 400),
    ("toy text that is not ids", {"json": {"model": "toy", "prompt": "hello"}}, 400),
    ("token id out of range", {"json": {"model": "toy", "prompt": [1, 999]}}, 400),
    ("seed of 2^64", {"json": {"model": "toy", "prompt": "1", "seed": 2**64}}, 400),
    ("seed below -2^63", {"json": {"model": "toy", "prompt": "1", "seed": -(2**63) - 1}}, 400),
    ("prompt over the limit", {"json": {"model": "toy", "prompt": [1] * 3000}}, 400),
    ("a huge body", {"content": b'{"model": "toy", "prompt": "' + b"1 " * 600_000 + b'"}'},
     413),
    ("empty messages", {"json": {"model": "toy", "messages": []}, "chat": True}, 400),
    ("an unknown role", {"json": {"model": "toy", "messages": [{"role": "robot",
                                                              "content": "1"}]},
                         "chat": True}, 400),
    ("messages not a list", {"json": {"model": "toy", "messages": "1 2"}, "chat": True}, 400),
    ("image content", {"json": {"model": "toy", "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "x"}}]}]}, "chat": True}, 400),
    ("no API key", {"json": {"model": "toy", "prompt": "1"}, "key": None}, 401),
    ("a wrong API key", {"json": {"model": "toy", "prompt": "1"}, "key": "nope"}, 401),
    ("an unknown route", {"json": {}, "path": "/nothing"}, 404),
    ("GET on completions", {"method": "GET"}, 405),
]


@pytest.mark.parametrize("what,request_kw,status", BAD, ids=[b[0] for b in BAD])
def test_bad_requests_get_their_status_and_an_error_body(what, request_kw, status,
                                                         bad_server) -> None:
    url = bad_server
    kw = dict(request_kw)
    path = kw.pop("path", "/chat/completions" if kw.pop("chat", False) else "/completions")
    key = kw.pop("key", "secret")
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    if "content" in kw:
        kw["data"] = kw.pop("content")
    r = requests.request(kw.pop("method", "POST"), url + path, headers=headers, timeout=30,
                         **kw)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["message"] and error["type"]
    ok = requests.post(url + "/completions", headers={"Authorization": "Bearer secret"},
                    json={"model": "toy", "prompt": "1 2", "max_tokens": 3}, timeout=30)
    assert ok.status_code == 200  # and it still serves


@pytest.fixture(scope="module")
def bad_server():
    with serving(toy(slots=2), api_key="secret") as url:
        yield url


def test_a_full_queue_is_429_and_health_and_models_answer() -> None:
    engine = toy(method="none", slots=1, max_waiting=0)  # one token per 10 ms step: the first
    slow_down(engine)  # request holds its slot for 40 s, however loaded the machine is
    with serving(engine) as url:
        assert requests.get(url.removesuffix("/v1") + "/health").status_code == 200
        assert requests.get(url + "/models").json()["data"][0]["owned_by"] == "trtspec"
        body = {"model": "toy", "prompt": "1 2 3", "max_tokens": 4000, "ignore_eos": True,
                "stream": True}
        with requests.post(f"{url}/completions", json=body, stream=True, timeout=30) as r:
            assert r.status_code == 200  # the free slot takes it, whatever max_waiting
            lines = r.iter_lines()  # kept: urllib3 closes a chunked response's connection
            next(lines)  # when its reading generator is dropped mid-read (the client left)
            refused = requests.post(f"{url}/completions", json=body | {"stream": False})
            assert refused.status_code == 429 and "waiting" in refused.json()["error"][
                "message"]


def test_trtspec_eval_against_trtspec_serve_reconciles_with_its_metrics(tmp_path,
                                                                        capsys) -> None:
    from pathlib import Path

    from trtspec.eval.run import read_records

    recipe = Path(__file__).resolve().parents[2] / "recipes" / "cpu-smollm2.yaml"
    workload = tmp_path / "w.jsonl"
    workload.write_text("".join(json.dumps({"id": f"q{i}", "category": "c",
                                            "prompt": f"{1 + i} {2 + i} 3"}) + "\n"
                                for i in range(6)))
    with serving(toy()) as spec_url, serving(toy(method="none")) as base_url:
        main(["eval", str(recipe), "--endpoint", spec_url, "--model", "toy",
              "--baseline-endpoint", base_url, "-w", str(workload), "--max-tokens", "12",
              "--concurrency", "1,3", "--reports", str(tmp_path), "--eval-id", "served",
              "--no-mlflow"])
        drafts = metric(spec_url, "trtspec:spec_decode_num_drafts_total")
        accepted = metric(spec_url, "trtspec:spec_decode_num_accepted_tokens_total")
        proposed = metric(spec_url, "trtspec:spec_decode_num_draft_tokens_total")
    out = tmp_path / "served"
    records = read_records(out)
    assert len(records) == 2 * 2 * 6 and not any(r.get("error") for r in records)
    assert json.loads((out / "eval.json").read_text())["server"] == "trtspec"
    counters = json.loads((out / "server_counters.json").read_text())
    spec = [v for k, v in counters.items() if k.endswith("/spec")]
    assert sum(c["raw"]["drafts"] for c in spec) == drafts > 0
    assert sum(c["raw"]["accepted_draft_tokens"] for c in spec) == accepted
    assert all(r["output_tokens"] == 12 or r["finish_reason"] == "stop" for r in records)
    # each record carries its request's counters from the response's spec field
    spec_records = [r for r in records if r["arm"] == "spec"]
    assert sum(r["accepted_draft_tokens"] for r in spec_records) == accepted > 0
    assert sum(r["proposed_tokens"] for r in spec_records) == proposed
    assert all(r["emitted_tokens"] == r["output_tokens"] - 1 for r in records
               if r["finish_reason"] == "length")  # the first token is in no counter
    assert all(r["proposed_tokens"] == 0 for r in records if r["arm"] == "baseline")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """A random-weight Llama with SmolLM2's tokenizer (and chat template), saved as a model
    directory: what `trtspec generate --model DIR` and a recipe can load."""
    from conftest import tiny_llama
    from transformers import AutoTokenizer

    from trtspec.runtime.models import resolve

    tokenizer = AutoTokenizer.from_pretrained(resolve("smollm2-135m-instruct"))
    model = tiny_llama(vocab=len(tokenizer), layers=2, seed=7, logit_scale=30.0)
    model.config.eos_token_id = tokenizer.eos_token_id
    path = tmp_path_factory.mktemp("tiny") / "model"
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def tiny_engine(path, max_input_len: int = 192, max_seq_len: int = 256):
    """The tiny Llama with SmolLM2's tokenizer on the compiled runner's decoder (eager in
    tests), n-gram drafts, 2 slots, 4 waiting, prompts prefilled 16 tokens a step while
    others decode: text prompts and chat templates as a user's, short sequences."""
    from trtspec.runtime.kinds import make_runner
    from trtspec.runtime.models import load
    from trtspec.serve.scheduler import Scheduler
    from trtspec.serve.server import Engine, Limits, TokenizerTexts
    from trtspec.spec.propose.ngram import NgramProposer

    lm = load(str(path), device="cpu")
    runner = make_runner(lm.model, "compiled", eos_token_id=lm.tokenizer.eos_token_id)
    scheduler = Scheduler(SpecExecutor(runner, NgramProposer(1, 3), 3), 2, max_waiting=4,
                          prefill_chunk=16)
    return Engine(scheduler, TokenizerTexts(lm.tokenizer), "tiny",
                  Limits(max_input_len=max_input_len, max_seq_len=max_seq_len,
                         default_max_tokens=32), method="ngram")


def test_a_request_the_kv_cache_cannot_hold_fails_alone(tiny_dir, monkeypatch) -> None:
    """Memory is checked before the KV cache grows: with (pretend) little memory free, a
    request that needs a bigger cache gets a 500 saying why, a stream beside it finishes, the
    server stays healthy and serves the next request; a prompt admitted in chunks beside a
    running stream gets the text it gets alone."""
    import trtspec.runtime.compiled as compiled_module

    engine = tiny_engine(tiny_dir, max_input_len=1000, max_seq_len=2000)
    long_prompt = " ".join(["colour"] * 700)
    with serving(engine) as url:
        client = openai.OpenAI(base_url=url, api_key="x", max_retries=0)
        alone = client.completions.create(model="tiny", prompt=long_prompt, max_tokens=8,
                                          temperature=0).choices[0].text
        monkeypatch.setattr(compiled_module, "free_bytes", lambda device: 1000)
        got: dict[str, object] = {}

        def streamed() -> None:
            out = client.completions.create(model="tiny", prompt="Name three colours.",
                                            max_tokens=600, temperature=0, stream=True,
                                            extra_body={"ignore_eos": True})
            got["stream"] = [c.choices[0].finish_reason for c in out if c.choices][-1]

        def started() -> threading.Thread:
            beside = threading.Thread(target=streamed)
            beside.start()
            deadline = time.time() + 30
            while not engine.scheduler._decoding() and time.time() < deadline:
                time.sleep(0.005)
            return beside

        beside = started()
        with pytest.raises(openai.InternalServerError) as info:
            client.completions.create(model="tiny", prompt=long_prompt, max_tokens=1200,
                                      extra_body={"ignore_eos": True})
        beside.join(timeout=120)
        assert "this request failed on the server: the KV cache would grow to" \
            in info.value.message
        assert got["stream"] == "length" and engine.scheduler.error is None
        assert requests.get(url.removesuffix("/v1") + "/health").status_code == 200
        monkeypatch.undo()
        chunks: list[int] = []
        prefill = engine.scheduler._prefill

        def counted(budget, chunk, *rest):  # prompt tokens fed in steps where a stream
            fed, later = prefill(budget, chunk, *rest)  # decoded
            if chunk is not None and fed:
                chunks.append(fed)
            return fed, later

        engine.scheduler._prefill = counted
        ride = engine.scheduler._riding

        def riding(*args):  # or in the stream's rounds' own calls (score_pair)
            chunk = ride(*args)
            if chunk is not None:
                chunks.append(len(chunk.tokens))
            return chunk

        engine.scheduler._riding = riding
        beside = started()  # the long prompt comes in 16 tokens a step beside the stream
        again = client.completions.create(model="tiny", prompt=long_prompt, max_tokens=8,
                                          temperature=0).choices[0].text
        beside.join(timeout=120)
        assert again == alone and got["stream"] == "length"
        assert len(chunks) > 20 and max(chunks) == 16


def test_a_transformers_model_serves_generate_s_text(tiny_dir, capsys) -> None:
    from trtspec.runtime.hf import HFRunner
    from trtspec.runtime.models import load
    from trtspec.serve.scheduler import Scheduler
    from trtspec.serve.server import Engine, Limits, TokenizerTexts
    from trtspec.spec.propose import make_proposer, method_named

    def generated(*flags: str) -> str:
        main(["generate", "--model", str(tiny_dir), "--method", "layer_skip", "--draft-layers",
              "1", "--draft-len", "3", "--temperature", "0", "--max-tokens", "16", "--json",
              "--prompt", "Name three colours.", *flags])
        return json.loads(capsys.readouterr().out)["completions"][0]["text"]

    lm = load(str(tiny_dir), device="cpu")
    executor = SpecExecutor(HFRunner(lm.model, eos_token_id=lm.tokenizer.eos_token_id),
                            make_proposer(method_named("layer_skip", layers=1),
                                          HFRunner(lm.model)), 3)
    engine = Engine(Scheduler(executor, 4), TokenizerTexts(lm.tokenizer), "tiny", Limits())
    with serving(engine) as url:
        client = openai.OpenAI(base_url=url, api_key="x")
        chat = generated()
        for stream in (False, True):
            out = client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "Name three colours."}],
                max_tokens=16, temperature=0, stream=stream)
            text = "".join(c.choices[0].delta.content or "" for c in out) if stream \
                else out.choices[0].message.content
            assert text == chat
        plain = generated("--no-chat")
        for stream in (False, True):
            out = client.completions.create(model="tiny", prompt="Name three colours.",
                                            max_tokens=16, temperature=0, stream=stream)
            assert (_text(out) if stream else out.choices[0].text) == plain
        # a seed: streamed == not streamed, chat and completions
        for kind in ("chat", "completions"):
            texts = []
            for stream in (False, True):
                kw = dict(model="tiny", max_tokens=24, temperature=0.9, seed=11, stream=stream)
                out = client.chat.completions.create(
                    messages=[{"role": "user", "content": "Name three colours."}], **kw) \
                    if kind == "chat" else client.completions.create(prompt="Say:", **kw)
                texts.append(_text(out) if stream else (
                    out.choices[0].message.content if kind == "chat" else out.choices[0].text))
            assert texts[0] == texts[1] and texts[0], kind
        # a stop string in the middle of the greedy text ends it there, stream or not
        cut = len(plain) // 2
        stop = plain[cut: cut + 3]
        want = plain[: plain.index(stop)]
        for stream in (False, True):
            out = client.completions.create(model="tiny", prompt="Name three colours.",
                                            max_tokens=16, temperature=0, stop=[stop],
                                            stream=stream)
            chunks = list(out) if stream else [out]
            text = "".join(c.choices[0].text for c in chunks if c.choices)
            assert text == want and chunks[-1].choices[0].finish_reason == "stop"


def _text(stream) -> str:
    """The text of a streamed completion or chat completion."""
    parts = []
    for chunk in stream:
        for choice in chunk.choices:
            delta = getattr(choice, "delta", None)
            parts.append(delta.content or "" if delta is not None else choice.text)
    return "".join(parts)


def test_trtspec_serve_a_built_recipe_then_sigterm(tiny_dir, tmp_path) -> None:
    """The CLI end to end: build, serve (startup line: URL, model, policy, slots), answer with
    an API key, refuse without it, exit 0 on SIGTERM."""
    import signal

    import yaml

    recipe = tmp_path / "recipes" / "tiny.yaml"
    recipe.parent.mkdir()
    recipe.write_text(yaml.safe_dump({
        "name": "tiny", "target": {"model": str(tiny_dir), "dtype": "float32"},
        "methods": [{"method": "layer_skip", "layers": 1}], "draft_lengths": [2],
        "limits": {"max_batch_size": 3, "max_input_len": 512, "max_seq_len": 1024},
        "backend": {"kind": "torch", "device": "cpu"}}))
    main(["build", str(recipe)])
    proc, url = launch(str(recipe), "--draft-len-schedule", "1:2,2:1", TRTSPEC_API_KEY="k")
    try:
        client = openai.OpenAI(base_url=url, api_key="k")
        done = client.chat.completions.create(model=str(tiny_dir), max_tokens=8,
                                              messages=[{"role": "user", "content": "Hi"}])
        assert done.usage.completion_tokens <= 8 and done.model_extra["spec"]
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=url, api_key="wrong").models.list()
        # SIGTERM with a stream in flight: it is finished, not cut, and then the process exits
        body = {"model": str(tiny_dir), "prompt": "Count:", "max_tokens": 900,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        with requests.post(f"{url}/completions", json=body, stream=True, timeout=120,
                           headers={"Authorization": "Bearer k"}) as r:
            lines = r.iter_lines()
            before = [next(lines) for _ in range(2)]
            proc.send_signal(signal.SIGTERM)
            events = [json.loads(line[6:]) for line in [*before, *lines]
                      if line.startswith(b"data: {")]
        finish = [c["choices"][0]["finish_reason"] for c in events if c["choices"]]
        assert finish[-1] == "length" and events[-1]["usage"]["completion_tokens"] == 900
    finally:
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert "stopped (0 requests were still running)" in out
    assert url in out and "slots 3" in out
    assert "policy: layer_skip, D = 2 at 1, D = 1 at 2, plain decoding at 3 running" in out
    assert "objects held for good are out of the garbage collector's passes" in out, out


def test_policy_from_a_decided_eval(tmp_path) -> None:
    import click

    from trtspec.cli.policy import policy_from_eval
    from trtspec.serve.slots import DraftPolicy

    verdicts = [("ngram/D2/c1", "GO", 1.3), ("ngram/D4/c1", "GO", 1.6), ("ngram/D2/c4", "GO", 1.1),
                ("ngram/D4/c4", "NO-GO", 0.9), ("layer_skip/D2/c1", "GO", 1.2),
                ("layer_skip/D2/c8", "INCONCLUSIVE", 1.4)]
    (tmp_path / "decision.json").write_text(json.dumps({"verdicts": [
        {"condition": c, "category": "all", "verdict": v, "speedup": s}
        for c, v, s in verdicts] + [{"condition": "ngram/D2/c8", "category": "chat",
                                     "verdict": "GO", "speedup": 3.0}]}))
    # most GO conditions; c = 8 was measured and nothing was GO there: D = 0
    notes: list[str] = []
    assert policy_from_eval(tmp_path, None, notes) == ("ngram", DraftPolicy.parse("1:4,4:2,8:0"))
    assert "ngram by running requests up to 8; more running requests are decoded plainly" \
        in notes[0]
    assert policy_from_eval(tmp_path, "layer_skip", []) == ("layer_skip",
                                                            DraftPolicy.parse("1:2,4:0,8:0"))
    with pytest.raises(click.UsageError, match="draft_model has no GO condition in this eval "
                                               r"\(GO: layer_skip, ngram\)"):
        policy_from_eval(tmp_path, "draft_model", [])  # not plain decoding without a word
    # through the CLI: conflicts are refused (exit 2, one line); the startup line states the
    # whole policy as it will run, and what the eval did not measure
    for flags in (("--draft-len", "2"), ("--method", "draft_model")):
        with pytest.raises(SystemExit) as exit_info:
            main(["serve", "--backend", "toy", "--policy", str(tmp_path), *flags])
        assert exit_info.value.code == 2
    out = serve_toy("--policy", str(tmp_path))
    assert "policy: ngram, D = 4 at 1, D = 2 at 2–4, plain decoding at 5–8 running" in out, out
    assert "more running requests are decoded plainly" in out


def test_policy_from_the_file_decide_writes(tmp_path) -> None:
    """`--policy FILE` (schedules/trtspec-policy.yaml, the crossover applied), and an eval
    folder that has one serves it; a malformed file or another --method is one line, exit 2."""
    import click

    from trtspec.analysis.policy import ServePolicy, write_policy
    from trtspec.cli.policy import policy_from_eval
    from trtspec.serve.slots import DraftPolicy

    (tmp_path / "schedules").mkdir()
    file = write_policy(tmp_path / "schedules" / "trtspec-policy.yaml",
                        ServePolicy("ngram", ((1, 4), (3, 2)), ("ngram",)), "e1",
                        {"c_star": 3.4, "ci": [2.1, 6.0], "where": "between"})
    (tmp_path / "decision.json").write_text(json.dumps({"verdicts": [
        {"condition": "ngram/D4/c1", "category": "all", "verdict": "GO", "speedup": 1.5}]}))
    want = ("ngram", DraftPolicy.parse("1:4,3:2"))
    assert policy_from_eval(file, None, []) == want == policy_from_eval(tmp_path, None, [])
    assert policy_from_eval(tmp_path, "ngram", []) == ("ngram", DraftPolicy.parse("1:4"))
    with pytest.raises(click.UsageError, match="serves ngram: drop --method layer_skip"):
        policy_from_eval(file, "layer_skip", [])
    bad = tmp_path / "bad.yaml"
    bad.write_text("method: ngram\nschedule: {1: -2}\n")
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--backend", "toy", "--policy", str(bad)])
    assert exit_info.value.code == 2
    out = serve_toy("--policy", str(file))
    assert "policy: ngram, D = 4 at 1, D = 2 at 2–3, plain decoding at 4–8 running" in out, out


def serve_toy(*flags: str) -> str:
    """`trtspec serve --backend toy FLAGS` until it answers one completion; SIGTERM; returns
    its stdout."""
    import signal

    proc, url = launch("--backend", "toy", *flags)
    try:
        done = openai.OpenAI(base_url=url, api_key="x").completions.create(
            model="toy", prompt="1 2 3", max_tokens=4)
        assert done.usage.completion_tokens <= 4
    finally:
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    return out


def test_policy_from_a_decided_eval_with_an_adaptive_condition(tmp_path) -> None:
    from trtspec.cli.policy import policy_from_eval
    from trtspec.serve.slots import DraftPolicy

    verdicts = [("ngram/D4/c1", "GO", 1.6), ("ngram/Dadaptive/c1", "GO", 1.5),
                ("ngram/D2/c4", "GO", 1.1), ("ngram/Dadaptive/c4", "GO", 1.3),
                ("ngram/Dadaptive/c8", "NO-GO", 0.9)]
    (tmp_path / "decision.json").write_text(json.dumps({"verdicts": [
        {"condition": c, "category": "all", "verdict": v, "speedup": s}
        for c, v, s in verdicts]}))
    assert policy_from_eval(tmp_path, None, []) == ("ngram",
                                                    DraftPolicy.parse("1:4,4:adaptive,8:0"))


def test_a_build_folder_serves_without_its_recipe_file(tiny_dir, tmp_path) -> None:
    import yaml

    from trtspec.build.recipe import RecipeError
    from trtspec.cli.serve import describe_policy, recipe_engine

    recipe = tmp_path / "recipes" / "tiny.yaml"
    recipe.parent.mkdir()
    recipe.write_text(yaml.safe_dump({
        "name": "tiny", "target": {"model": str(tiny_dir), "dtype": "float32"},
        "methods": [{"method": "ngram", "max_n": 2}], "draft_lengths": [3],
        "backend": {"kind": "torch", "device": "cpu"}}))
    main(["build", str(recipe)])
    folder = tmp_path / "engines" / "tiny" / "cpu"
    recipe.unlink()  # the folder holds the recipe as built
    engine = recipe_engine(str(folder), (), tmp_path / "engines", None, None, None, 4, None)
    assert engine.model == str(tiny_dir) and describe_policy(engine).startswith("ngram, D = 3")
    assert engine.scheduler.executor.proposer.max_n == 2 and engine.scheduler.slots == 8
    with pytest.raises(RecipeError, match=r"no recipe\.yaml here"):
        recipe_engine(str(tmp_path), (), tmp_path, None, None, None, 4, None)
    # a --policy decided on another build is refused before any warm-up; its own build serves
    import click

    with pytest.raises(click.UsageError, match="was decided on another build"):
        recipe_engine(str(folder), (), tmp_path / "engines", None, None, None, 4, None,
                      ("p.yaml", "0" * 64))
    built = json.loads((folder / "manifest.json").read_text())["build_digest"]
    recipe_engine(str(folder), (), tmp_path / "engines", None, None, 2, 4, None,
                  ("p.yaml", built))


def test_eval_with_open_loop_arrivals_against_serve(tmp_path) -> None:
    from pathlib import Path

    from trtspec.eval.run import read_records

    recipe = Path(__file__).resolve().parents[2] / "recipes" / "cpu-smollm2.yaml"
    workload = tmp_path / "w.jsonl"
    workload.write_text("".join(json.dumps({"id": f"q{i}", "category": "c",
                                            "prompt": f"{1 + i} 2 3"}) + "\n"
                                for i in range(8)))
    with serving(toy(slots=2)) as url:
        main(["eval", str(recipe), "--endpoint", url, "--model", "toy", "-w", str(workload),
              "--max-tokens", "6", "--request-rate", "40", "--reports", str(tmp_path),
              "--eval-id", "poisson", "--no-mlflow"])
    records = read_records(tmp_path / "poisson")
    assert len(records) == 8 and not any(r.get("error") for r in records)
    starts = sorted(r["start_s"] for r in records)
    assert starts[-1] - starts[0] > 0.05  # sent over time, not at once (mean gap 25 ms)
    meta = json.loads((tmp_path / "poisson" / "eval.json").read_text())
    assert "eval.request_rate=40.0" in meta["overrides"]


def fail_on_call(engine, armed: threading.Event) -> None:
    """Make the target's score raise on its next call once ``armed`` is set (a model failure
    mid-round); until then every call takes 10 ms, so requests are still running."""
    target = engine.scheduler.executor.target
    score = target.score

    def failing(tokens, last_only=False):
        if armed.is_set():
            raise RuntimeError("CUDA error: an illegal memory access was encountered (test)")
        time.sleep(0.01)
        return score(tokens, last_only)

    target.score = failing


def test_a_model_failure_ends_every_request_with_an_error_then_503(capsys) -> None:
    engine = toy(slots=3)
    armed = threading.Event()
    fail_on_call(engine, armed)
    long = {"max_tokens": 4000, "extra_body": {"ignore_eos": True}}
    got: dict[str, object] = {}

    def streamed_openai(url: str) -> None:
        client = openai.OpenAI(base_url=url, api_key="x", max_retries=0)
        texts = []
        try:
            for chunk in client.completions.create(model="toy", prompt="1 2 3", stream=True,
                                                   **long):
                texts.append(chunk.choices[0].text)
        except openai.APIError as e:
            got["openai stream"] = (e.message, len(texts))

    def streamed_raw(url: str) -> None:
        body = {"model": "toy", "messages": [{"role": "user", "content": "4 5"}],
                "max_tokens": 4000, "ignore_eos": True, "stream": True}
        with requests.post(f"{url}/chat/completions", json=body, stream=True, timeout=60) as r:
            got["raw stream"] = [line for line in r.iter_lines() if line]

    def whole(url: str, key: str) -> None:
        r = requests.post(f"{url}/completions", timeout=60, json={
            "model": "toy", "prompt": "6 7", "max_tokens": 4000, "ignore_eos": True})
        got[key] = (r.status_code, r.json())

    with serving(engine) as url:
        threads = [threading.Thread(target=f, args=a) for f, a in (
            (streamed_openai, (url,)), (streamed_raw, (url,)), (whole, (url, "running")))]
        for t in threads:
            t.start()
        deadline = time.time() + 30
        while len(engine.scheduler._decoding()) < 3 and time.time() < deadline:
            time.sleep(0.01)  # all three decoding, not only holding a slot: a round of one
            # row that fails ends that request alone (the others go on), which is not this
            # test's case (under load one of them was still being prefilled when armed)
        threads.append(threading.Thread(target=whole, args=(url, "queued")))
        threads[-1].start()
        while engine.scheduler.waiting < 1 and time.time() < deadline:
            time.sleep(0.01)
        assert engine.scheduler.running == 3 and engine.scheduler.waiting == 1
        assert len(engine.scheduler._decoding()) == 3  # (not a deadline passed silently)
        armed.set()
        for t in threads:
            t.join(timeout=60)
        message, chunks = got["openai stream"]
        assert "the model failed: RuntimeError: CUDA error" in message and chunks > 0
        events = got["raw stream"]
        assert events[-1] == b"data: [DONE]" and len(events) > 2
        assert json.loads(events[-2][6:]) == {"error": {
            "message": "the model failed: RuntimeError: CUDA error: an illegal memory access "
                       "was encountered (test)", "type": "server_error", "param": None,
            "code": None}}
        assert all(b'"error"' not in e for e in events[:-2])
        for key in ("running", "queued"):
            status, body = got[key]
            assert status == 500 and body["error"]["type"] == "server_error", key
            assert "the model failed" in body["error"]["message"]
        # from now on: 503 with an OpenAI error body, for every client; /health too
        client = openai.OpenAI(base_url=url, api_key="x", max_retries=0)
        with pytest.raises(openai.APIStatusError) as info:
            client.completions.create(model="toy", prompt="1 2", max_tokens=3)
        assert info.value.status_code == 503 and info.value.type == "server_error"
        assert "the model failed" in info.value.message
        assert requests.get(url.removesuffix("/v1") + "/health").status_code == 503
        assert metric(url, 'trtspec:request_success_total{finish_reason="error"}') == 4
    log = capsys.readouterr().err
    assert log.count("POST /v1/completions 500 ") == 2  # the two whole requests
    assert "POST /v1/chat/completions 200 prompt=2 " in log and "finish=error" in log
    assert "POST /v1/completions 503 prompt=- completion=- finish=- D=draft_model/D4 " in log


def test_a_chunked_body_is_read_up_to_the_limit_and_no_further() -> None:
    import http.client

    engine = toy()
    engine.limits.max_body_bytes = 4096

    def body(prompt_bytes: int) -> Iterator[bytes]:
        yield b'{"model": "toy", "prompt": "'
        for _ in range(prompt_bytes // 100):
            yield b"1 " * 50
        yield b'", "max_tokens": 2}'

    with serving(engine) as url:
        r = requests.post(f"{url}/completions", data=body(200_000), timeout=30)
        assert r.request.headers["Transfer-Encoding"] == "chunked"
        assert r.status_code == 413 and "over the limit (4096 bytes)" in r.json()["error"][
            "message"]
        small = requests.post(f"{url}/completions", data=body(1000), timeout=30)
        assert small.status_code == 200 and small.json()["usage"]["prompt_tokens"] == 500
        # a declared Content-Length over the limit is refused before any of the body comes
        conn = http.client.HTTPConnection(url.split("//")[1].split("/")[0], timeout=10)
        conn.putrequest("POST", "/v1/completions")
        conn.putheader("Content-Type", "application/json")
        conn.putheader("Content-Length", str(10**9))
        conn.endheaders()
        declared = conn.getresponse()
        assert declared.status == 413 and b"1000000000 bytes" in declared.read()
        conn.close()


class RecordingTexts(IdTexts):
    """The toy texts, noting each encode call and whether it ran on an event loop."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, bool]] = []

    def encode(self, text: str) -> list[int]:
        self.calls.append(("encode", on_event_loop()))
        return super().encode(text)

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        self.calls.append(("encode_chat", on_event_loop()))
        return [t for m in messages for t in IdTexts.encode(self, m["content"])]


def on_event_loop() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


def test_an_over_long_prompt_is_refused_before_tokenizing_which_runs_off_the_loop() -> None:
    engine = toy()
    engine.texts = texts = RecordingTexts()
    cap = engine.limits.max_input_len * 16
    with serving(engine) as url:
        over = "1 " * (cap // 2 + 1)
        r = requests.post(f"{url}/completions", json={"model": "toy", "prompt": over})
        error = r.json()["error"]
        assert r.status_code == 400 and error["param"] == "prompt"
        assert error["message"] == (f"the prompt has {len(over)} characters, over the limit of "
                                    f"{cap} (max_input_len 2048 tokens × 16 characters)")
        r = requests.post(f"{url}/chat/completions", json={"model": "toy", "messages": [
            {"role": "system", "content": "1 " * (cap // 4)},
            {"role": "user", "content": "2 " * (cap // 4 + 1)}]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
        assert texts.calls == []  # neither was tokenized
        engine.limits.max_prompt_chars = 10
        r = requests.post(f"{url}/completions", json={"model": "toy", "prompt": "1 2 3 4 5 6"})
        assert r.status_code == 400 and "(max_prompt_chars)" in r.json()["error"]["message"]
        engine.limits.max_prompt_chars = None
        client = openai.OpenAI(base_url=url, api_key="x")
        client.completions.create(model="toy", prompt="1 2 3", max_tokens=2)
        client.chat.completions.create(model="toy", max_tokens=2,
                                       messages=[{"role": "user", "content": "1 2 3"}])
        assert texts.calls == [("encode", False), ("encode_chat", False)]


def test_fields_that_would_change_the_answer_are_400_by_name_and_defaults_pass() -> None:
    with serving(toy()) as url:
        client = openai.OpenAI(base_url=url, api_key="x", max_retries=0)
        for kw in ({"presence_penalty": 0.5}, {"logit_bias": {"3": 10}}, {"n": 2},
                   {"best_of": 2}, {"suffix": "!"}, {"logprobs": 1}):
            with pytest.raises(openai.BadRequestError) as info:
                client.completions.create(model="toy", prompt="1 2", max_tokens=3, **kw)
            (field,) = kw
            assert info.value.param == field and field in info.value.message
        for kw in ({"response_format": {"type": "json_object"}}, {"top_logprobs": 2},
                   {"logprobs": True}, {"frequency_penalty": 1.0},
                   {"tools": [{"type": "function", "function": {"name": "f"}}]},
                   {"tool_choice": "required"}):
            with pytest.raises(openai.BadRequestError) as info:
                client.chat.completions.create(
                    model="toy", messages=[{"role": "user", "content": "1"}], max_tokens=3,
                    **kw)
            (field,) = kw
            assert info.value.param == field
        defaults = {"n": 1, "presence_penalty": 0, "frequency_penalty": 0.0, "logit_bias": {}}
        done = client.completions.create(model="toy", prompt="1 2", max_tokens=3, best_of=1,
                                         echo=False, suffix=None, logprobs=None,
                                         extra_body={"top_logprobs": 0}, **defaults)
        assert done.usage.completion_tokens == 3
        done = client.chat.completions.create(
            model="toy", messages=[{"role": "user", "content": "1"}], max_tokens=3,
            response_format={"type": "text"}, tools=[], tool_choice="none", logprobs=False,
            top_logprobs=0, **defaults)
        assert done.usage.completion_tokens == 3


def test_with_include_usage_every_chunk_but_the_last_says_usage_null() -> None:
    with serving(toy()) as url:
        for path, body in (("completions", {"prompt": "1 2"}), ("chat/completions", {
                "messages": [{"role": "user", "content": "1 2"}]})):
            for include in (True, False):
                with requests.post(f"{url}/{path}", stream=True, timeout=30, json={
                        "model": "toy", "max_tokens": 9, "stream": True, **body,
                        "stream_options": {"include_usage": include}}) as r:
                    events = [json.loads(line[6:]) for line in r.iter_lines()
                              if line.startswith(b"data: {")]
                if include:
                    assert all("usage" in e and e["usage"] is None for e in events[:-1])
                    assert events[-1]["usage"]["completion_tokens"] == 9
                    assert events[-1]["choices"] == [] and len(events) > 2
                else:
                    assert all("usage" not in e for e in events) and events[-1]["choices"]


def test_per_request_speculative_decoding_metrics_in_vllm_s_shape_reconcile() -> None:
    engine = toy(draft_len=4)
    with serving(engine) as url:
        client = openai.OpenAI(base_url=url, api_key="x")
        seen = []
        for seed in range(4):
            done = client.completions.create(model="toy", prompt="1 2 3", max_tokens=30,
                                             temperature=0.8, seed=seed)
            seen.append((done.model_extra["metrics"]["speculative_decoding"],
                         done.model_extra["spec"]))
        chunks = list(client.chat.completions.create(
            model="toy", messages=[{"role": "user", "content": "4 5"}], max_tokens=30,
            stream=True, stream_options={"include_usage": True}))
        assert all(c.model_extra.get("metrics") is None for c in chunks[:-1])
        seen.append((chunks[-1].model_extra["metrics"]["speculative_decoding"],
                     chunks[-1].model_extra["spec"]))
        for sd, spec in seen:
            assert sd["num_spec_steps"] == spec["drafts"] == sum(sd["acceptance_histogram"])
            assert sd["num_draft_tokens"] == spec["proposed_tokens"]
            assert sd["num_accepted_draft_tokens"] == spec["accepted_draft_tokens"]
            assert sd["num_spec_tokens"] == 4 and len(sd["acceptance_histogram"]) == 5
            assert sd["mean_acceptance_length"] == pytest.approx(
                1 + sd["num_accepted_draft_tokens"] / sd["num_spec_steps"])
            assert sd["draft_acceptance_rate"] == pytest.approx(
                sd["num_accepted_draft_tokens"] / sd["num_draft_tokens"])
            assert sum(j * n for j, n in enumerate(sd["acceptance_histogram"])) == \
                sd["num_accepted_draft_tokens"]
            by_length = sd["acceptance_histogram_by_draft_length"]
            assert all(len(row) == int(k) + 1 for k, row in by_length.items())
            assert sum(map(sum, by_length.values())) == sd["num_spec_steps"]
            assert "per_step_accepted" not in sd
        assert metric(url, "trtspec:spec_decode_num_drafts_total") == \
            sum(sd["num_spec_steps"] for sd, _ in seen) > 0
        engine.spec_metrics = "detailed"
        sd = client.completions.create(model="toy", prompt="1 2 3", max_tokens=30).model_extra[
            "metrics"]["speculative_decoding"]
        assert len(sd["per_step_accepted"]) == len(sd["per_step_drafted"]) == \
            sd["num_spec_steps"] and sum(sd["per_step_accepted"]) == \
            sd["num_accepted_draft_tokens"] and sum(sd["per_step_drafted"]) == \
            sd["num_draft_tokens"]
        engine.spec_metrics = "none"
        done = client.completions.create(model="toy", prompt="1 2 3", max_tokens=3)
        assert "metrics" not in done.model_extra and done.model_extra["spec"]
    with serving(toy(method="none")) as url:  # no speculation: null, as vLLM without it
        done = openai.OpenAI(base_url=url, api_key="x").completions.create(
            model="toy", prompt="1 2 3", max_tokens=3)
        assert done.model_extra["metrics"] == {"speculative_decoding": None}


def test_one_access_log_line_per_request_and_models_created_is_the_start_time(capsys) -> None:
    import re

    engine = toy()
    before = int(time.time())
    with serving(engine) as url:
        after = int(time.time())
        created = requests.get(f"{url}/models").json()["data"][0]["created"]
        assert before <= created <= after
        client = openai.OpenAI(base_url=url, api_key="x", max_retries=0)
        client.completions.create(model="toy", prompt="1 2 3", max_tokens=5)
        list(client.chat.completions.create(model="toy", max_tokens=6, stream=True,
                                            messages=[{"role": "user", "content": "1 2"}]))
        with pytest.raises(openai.BadRequestError):
            client.completions.create(model="toy", prompt="1", max_tokens=-1)
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="gpt-9", prompt="1")
        requests.get(url.removesuffix("/v1") + "/health")  # probes are not logged
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith(
        ("GET", "POST"))]
    assert len(lines) == 5, lines
    pattern = r"(GET|POST) (\S+) (\d{3}) prompt=(\S+) completion=(\S+) finish=(\S+) D=(\S+) " \
              r"\d+\.\d\ds"
    parsed = [re.fullmatch(pattern, line).groups() for line in lines]
    assert parsed == [
        ("GET", "/v1/models", "200", "-", "-", "-", "draft_model/D4"),
        ("POST", "/v1/completions", "200", "3", "5", "length", "draft_model/D4"),
        ("POST", "/v1/chat/completions", "200", "2", "6", "length", "draft_model/D4"),
        ("POST", "/v1/completions", "400", "-", "-", "-", "draft_model/D4"),
        ("POST", "/v1/completions", "404", "-", "-", "-", "draft_model/D4")]
    # D as the access log names it by default: read off the policy the scheduler runs
    from trtspec.serve.slots import DraftPolicy

    assert toy(method="none").d_mode == "plain"
    assert toy(draft_len="adaptive").d_mode == "draft_model/adaptive"
    scheduled = toy(method="ngram")
    scheduled.scheduler.policy = DraftPolicy.parse("1:4,4:2,8:0")
    assert scheduled.d_mode == "ngram/by-load[1:4,4:2,8:0]"


def test_a_served_model_that_fails_ends_every_request_within_a_second_then_exits() -> None:
    """The CLI with a runner that raises on its 60th step while 2 requests run and 4 wait:
    every client gets its error within a second of the failure (streams an error event then
    [DONE], non-streamed a 500), nothing hangs, the gauges read 0, new requests get 503, and
    SIGTERM exits 0 within 5 s without a traceback."""
    import os
    import signal
    import subprocess
    import sys
    from concurrent.futures import ThreadPoolExecutor
    from pathlib import Path

    port = free_port()
    proc = subprocess.Popen([sys.executable, str(Path(__file__).with_name("faulty_serve.py")),
                             "--slots", "2", "--port", str(port)],
                            env={**os.environ, "TRTSPEC_TEST_FAIL_AT": "60"},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    root = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 60
        while time.time() < deadline:
            with contextlib.suppress(requests.ConnectionError):
                if requests.get(f"{root}/health", timeout=2).ok:
                    break
            time.sleep(0.05)

        def client(i: int) -> tuple[float, str]:
            body = {"model": "toy", "prompt": f"{1 + i} 2 3", "max_tokens": 2000,
                    "ignore_eos": True, "stream": i % 2 == 0}
            r = requests.post(f"{root}/v1/completions", json=body, timeout=30,
                              stream=i % 2 == 0)
            if i % 2:
                return time.time(), f"{r.status_code} {r.json()['error']['message']}"
            lines = [line for line in r.iter_lines() if line]
            return time.time(), lines[-2].decode() + " " + lines[-1].decode()

        with ThreadPoolExecutor(6) as pool:
            ended = list(pool.map(client, range(6)))
        for i, (_, what) in enumerate(ended):
            want = "500 the model failed: RuntimeError: CUDA error" if i % 2 else \
                'data: {"error": {"message": "the model failed: RuntimeError: CUDA error'
            assert what.startswith(want), what
            assert i % 2 or what.endswith("data: [DONE]"), what
        assert requests.get(f"{root}/health", timeout=5).status_code == 503
        late = requests.post(f"{root}/v1/completions", timeout=5,
                             json={"model": "toy", "prompt": "1 2", "max_tokens": 3})
        assert late.status_code == 503
        metrics = requests.get(f"{root}/metrics", timeout=5).text
        for gauge in ("trtspec:num_requests_running", "trtspec:num_requests_waiting"):
            assert f"{gauge} 0.0" in metrics
        assert 'trtspec:request_success_total{finish_reason="error"} 6.0' in metrics
    finally:
        stopped = time.time()
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    assert time.time() - stopped < 5 and proc.returncode == 0, err
    assert "Traceback" not in err, err
    failed_at = float(err.split("failed at ")[1].split()[0])
    assert all(t - failed_at < 1.0 for t, _ in ended), [t - failed_at for t, _ in ended]
    assert "a step failed (RuntimeError: CUDA error" in err


@pytest.mark.parametrize(("flags", "says"), [
    (["--draft-len", "4", "--draft-len-schedule", "1:4"], "not both"),
    (["--method", "none", "--draft-len", "4"], "--method none decodes plainly"),
    (["--method", "none", "--draft-len-schedule", "1:2"], "--method none decodes plainly"),
    (["--set", "limits.max_batch_size=2"], "--backend toy serves toy models"),
    (["--draft-len-schedule", "2:1,1:4"], "increasing order"),
    (["--prefill-stall", "0"], "--prefill-stall"),
    (["--prefill-stall", "nan"], "--prefill-stall must be a finite number"),
])
def test_flags_that_conflict_are_refused_in_one_line(flags, says, capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--backend", "toy", *flags])
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2 and says in err and len(err.splitlines()) == 1, err


def test_a_schedule_entry_past_the_slots_is_named_at_start_up() -> None:
    out = serve_toy("--slots", "2", "--draft-len-schedule", "1:4,2:2,8:1")
    assert "policy: draft_model, D = 4 at 1, D = 2 at 2 running" in out, out
    assert "note: schedule entries past --slots 2 never apply: 8:1" in out, out


def test_prefill_chunk_and_stall_are_said_at_start_up() -> None:
    out = serve_toy("--prefill-chunk", "8", "--prefill-stall", "2")
    assert "prompts are prefilled ≤ 8 tokens a step, paced to 2× a round while others " \
        "decode" in out, out


def test_vllm_extensions_are_honoured_or_refused_and_null_means_default() -> None:
    with serving(toy()) as url:
        root = url
        body = {"model": "toy", "prompt": "1 2 3", "max_tokens": 12, "temperature": 0}
        plain = requests.post(f"{root}/completions", json=body, timeout=30).json()
        ids = [int(t) for t in plain["choices"][0]["text"].split()]
        cut = requests.post(f"{root}/completions", timeout=30,
                            json={**body, "stop_token_ids": [ids[3]]}).json()
        assert cut["choices"][0]["finish_reason"] == "stop"
        assert cut["usage"]["completion_tokens"] == ids.index(ids[3]) + 1
        nulls = requests.post(f"{root}/completions", timeout=30, json={
            **body, "temperature": None, "top_p": None, "top_k": None, "seed": 3})
        assert nulls.status_code == 200, nulls.text
        for field, value in (("min_p", 0.1), ("repetition_penalty", 1.2),
                             ("guided_choice", ["a"]), ("use_beam_search", True)):
            r = requests.post(f"{root}/completions", json={**body, field: value}, timeout=30)
            assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
        assert requests.post(f"{root}/completions", timeout=30, json={
            **body, "min_p": 0, "repetition_penalty": 1}).status_code == 200


def test_a_request_whose_text_fails_to_decode_ends_at_once_and_the_server_goes_on() -> None:
    engine = toy(slots=2)
    decode, calls = engine.texts.decode, [0]

    def flaky(ids):
        calls[0] += 1
        if calls[0] == 3:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "test")
        return decode(ids)

    engine.texts.decode = flaky
    slow_down(engine)
    with serving(engine) as url:
        body = {"model": "toy", "prompt": "1 2 3", "max_tokens": 400, "ignore_eos": True,
                "stream": True}
        began = time.time()
        with requests.post(f"{url}/completions", json=body, stream=True, timeout=30) as r:
            lines = [line for line in r.iter_lines() if line]
        assert time.time() - began < 2  # not after 400 tokens
        assert lines[-2].startswith(b'data: {"error"') and lines[-1] == b"data: [DONE]"
        settled(url, "error", 1)
        after = openai.OpenAI(base_url=url, api_key="x").completions.create(
            model="toy", prompt="1 2 3", max_tokens=4)
        assert after.usage.completion_tokens == 4
        assert requests.get(url.removesuffix("/v1") + "/health").status_code == 200


def test_freeze_heap_collects_garbage_first_then_keeps_the_live_heap_out_of_full_passes(
) -> None:
    """A cycle nobody holds is garbage the freeze must not keep for good: freeze_heap's own
    collection frees it (automatic collection is off meanwhile, so nothing else can); a live
    object leaves the collector's view (no pass walks it) until unfrozen."""
    class Node:
        pass

    assert gc.get_freeze_count() == 0  # else unfreezing below would undo another's freeze
    enabled = gc.isenabled()
    gc.disable()
    try:
        garbage, kept = Node(), Node()
        garbage.me = garbage
        gone = weakref.ref(garbage)
        del garbage
        assert gone() is not None  # only a collection frees a cycle
        frozen, seconds = freeze_heap()
        assert gone() is None and seconds >= 0
        assert 0 < gc.get_freeze_count() <= frozen  # (other threads may free frozen objects)
        assert not any(o is kept for o in gc.get_objects())
    finally:
        gc.unfreeze()  # this test process keeps its collector as it was
        if enabled:
            gc.enable()
    assert any(o is kept for o in gc.get_objects())
