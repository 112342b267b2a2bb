"""`trtspec serve` as users run it: a built recipe on the compiled runner (the default), through
the CLI, over HTTP with the real `openai` client.

A pairwise design over method × D mode (every speculative method with a fixed D, adaptive D
and a schedule; plain decoding once), with slots equal to and different from
``limits.max_batch_size`` alternating so that each method and each D mode meets both. Every
server gets the requests that took servers down before: max_tokens 1, 2 and 8, EOS as the
first token, a client that leaves right after admission, then 16 concurrent streams; after
each, /health is 200 and the running / waiting gauges are 0. The first request after start-up
must not compile (the runner warns when a graph is compiled after warm-up).

The models are tiny random Llamas with SmolLM2's tokenizer, built once per session by
`trtspec build`; its inductor cache (the build folder's) is shared by every server, so graphs
are compiled once.
"""

from __future__ import annotations

import concurrent.futures
import signal
import time

import openai
import pytest
import requests

pytestmark = pytest.mark.compile

EOS_PROMPT = [1, 2, 3, 4, 5]  # its greedy first token is made an EOS id of the target
MAX_BATCH = 4


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """A recipe with every torch-backend method, built (compiled) once: (recipe path, the
    model name it serves, the extra EOS id)."""
    import subprocess
    import sys

    import torch
    import yaml
    from conftest import tiny_llama
    from transformers import AutoTokenizer

    from trtspec.runtime.models import resolve

    root = tmp_path_factory.mktemp("matrix")
    tokenizer = AutoTokenizer.from_pretrained(resolve("smollm2-135m-instruct"))
    target = tiny_llama(vocab=len(tokenizer), layers=4, seed=3, logit_scale=8.0)
    with torch.inference_mode():
        first = int(target(torch.tensor([EOS_PROMPT])).logits[0, -1].argmax())
    # two EOS ids, as Llama-3 lists several: the tokenizer's and this prompt's first token
    target.config.eos_token_id = [tokenizer.eos_token_id, first]
    target.generation_config.eos_token_id = [tokenizer.eos_token_id, first]
    draft = tiny_llama(vocab=len(tokenizer), layers=1, seed=4, logit_scale=8.0)
    for name, model in (("target", target), ("draft", draft)):
        model.save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
    recipe = root / "matrix.yaml"
    recipe.write_text(yaml.safe_dump({
        "name": "matrix", "target": {"model": str(root / "target"), "dtype": "float32"},
        "methods": [{"method": "ngram"}, {"method": "suffix", "scope": "request"},
                    {"method": "layer_skip", "layers": 2},
                    {"method": "draft_model", "model": str(root / "draft")}],
        "draft_lengths": [3], "max_draft_len": 4,
        "limits": {"max_batch_size": MAX_BATCH, "max_input_len": 256, "max_seq_len": 512},
        "backend": {"kind": "torch", "device": "cpu"}}))
    subprocess.run([sys.executable, "-m", "trtspec", "build", str(recipe), "--engines",
                    str(root / "engines")], check=True, cwd=root, capture_output=True,
                   env=_env())
    return recipe, str(root / "target"), first


def _env() -> dict[str, str]:
    """The environment users have: the compiled runner, no inductor cache of the test's."""
    import os

    return {k: v for k, v in os.environ.items()
            if k not in ("TRTSPEC_COMPILE", "TORCHINDUCTOR_CACHE_DIR")}


# method, D mode, slots: each method × D-mode pair once; slots alternate equal / different
SERVERS = [
    ("none", "fixed", MAX_BATCH),
    ("ngram", "fixed", 2), ("ngram", "adaptive", MAX_BATCH), ("ngram", "schedule", 3),
    ("suffix", "fixed", MAX_BATCH), ("suffix", "adaptive", 2), ("suffix", "schedule", MAX_BATCH),
    ("layer_skip", "fixed", 2), ("layer_skip", "adaptive", MAX_BATCH),
    ("layer_skip", "schedule", 2),
    ("draft_model", "fixed", MAX_BATCH), ("draft_model", "adaptive", 3),
    ("draft_model", "schedule", MAX_BATCH),
]
D_FLAGS = {"fixed": ["--draft-len", "3"], "adaptive": ["--draft-len", "adaptive"],
           "schedule": ["--draft-len-schedule", "1:4,2:adaptive,3:1"]}


@pytest.mark.parametrize(("method", "mode", "slots"), SERVERS,
                         ids=[f"{m}-{d}-slots{s}" for m, d, s in SERVERS])
def test_a_served_build_survives_short_dropped_and_concurrent_requests(built, method, mode,
                                                                       slots) -> None:
    from conftest import launch

    recipe, model, _ = built
    flags = ["--method", method, "--slots", str(slots), "--engines",
             str(recipe.parent / "engines")]
    proc, url = launch(str(recipe), *flags, *([] if method == "none" else D_FLAGS[mode]),
                       **{"TRTSPEC_COMPILE": "1"})
    try:
        assert proc.poll() is None, proc.communicate()
        client = openai.OpenAI(base_url=url, api_key="x", max_retries=0, timeout=120)
        # max_tokens 1 (the first request after start-up: warm-up compiled its graphs)
        one = client.completions.create(model=model, prompt=[7, 8, 9], max_tokens=1,
                                        temperature=0)
        assert one.usage.completion_tokens == 1
        assert one.choices[0].finish_reason in ("length", "stop")
        two = list(client.completions.create(
            model=model, prompt=[9, 8, 7], max_tokens=2, temperature=0.8, seed=1,
            stream=True, stream_options={"include_usage": True}))
        eight = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Count to ten."}],
            max_tokens=8, temperature=0)
        assert eight.usage.completion_tokens <= 8
        assert two[-1].usage.completion_tokens <= 2 and two[-2].choices[0].finish_reason
        # EOS as the first token: the second EOS id of the generation config ends it
        stop = client.completions.create(model=model, prompt=EOS_PROMPT, max_tokens=8,
                                         temperature=0)
        assert stop.choices[0].finish_reason == "stop" and stop.usage.completion_tokens == 1
        assert stop.choices[0].text == ""  # a stop token's own text is not sent
        # a client that leaves right after admission
        with requests.post(f"{url}/completions", stream=True, timeout=60, json={
                "model": model, "prompt": [5, 4, 3], "max_tokens": 200, "ignore_eos": True,
                "stream": True}) as r:
            assert r.status_code == 200
            next(r.iter_lines())
        # 16 concurrent streams, sampled (rejections) and greedy
        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            outs = list(pool.map(lambda i: _stream(client, model, i), range(16)))
        for tokens, finish, limit in outs:
            assert finish in ("length", "stop") and 1 <= tokens <= limit
            assert finish == "stop" or tokens == limit
        _settled(url)
    finally:
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert "tokens a step at a prompt's start, fewer further in (a token at position p " \
        "counts 1 + p/" in out, out  # the compiled runner on a CPU prices its chunks
    assert "compiled a graph after warm-up" not in err, err  # no request waited for it
    assert "torch.compile failed" not in err and "compiling now" not in err, err  # compiled
    assert "Traceback" not in err, err


def _stream(client: openai.OpenAI, model: str, i: int) -> tuple[int, str, int]:
    """One streamed completion: (completion tokens, finish reason, max_tokens)."""
    limit = 4 + i % 9
    chunks = list(client.completions.create(
        model=model, prompt=[10 + i, 11, 12 + i % 3] * (1 + i % 4), max_tokens=limit,
        temperature=0.0 if i % 2 else 0.9, seed=i, stream=True,
        stream_options={"include_usage": True}))
    finish = [c.choices[0].finish_reason for c in chunks if c.choices]
    return chunks[-1].usage.completion_tokens, finish[-1], limit


def _settled(url: str) -> None:
    """/health 200 and nothing running or waiting, within a few seconds."""
    root = url.removesuffix("/v1")
    deadline = time.time() + 15
    while True:
        text = requests.get(f"{root}/metrics", timeout=10).text
        gauges = {name: float(line.split()[-1]) for line in text.splitlines()
                  for name in ("trtspec:num_requests_running", "trtspec:num_requests_waiting")
                  if line.startswith(name + " ")}
        if requests.get(f"{root}/health", timeout=10).status_code == 200 and \
                gauges and not any(gauges.values()):
            return
        assert time.time() < deadline, gauges
        time.sleep(0.2)
