"""Evaluate any OpenAI-compatible endpoint (trtspec serve, vLLM, trtllm-serve, SGLang …).

Streaming chat completions through the real ``openai`` client, so TTFT and ITL are what a
client sees. Concurrency is N client coroutines. The speculative server is the ``spec`` arm; an
optional second server without speculation is the ``baseline`` arm (same requests, seeds,
sampling and limits). Around each arm the server's Prometheus counters are scraped: vLLM's
``vllm:spec_decode_num_drafts / _num_draft_tokens / _num_accepted_tokens`` give the acceptance
rate and AL = 1 + Δaccepted / Δdrafts for that arm.

Records have the in-process schema; chunk arrival times stand in for token times (a chunk of a
speculative round carries several tokens), and output_tokens comes from the server's usage.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import re
import time
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from trtspec.eval.run import RECORDS, done_keys, request_seed
from trtspec.eval.workloads import WorkloadRequest
from trtspec.sampling import SamplingParams

COUNTERS = {  # Prometheus name (without _total) → our name
    "vllm:spec_decode_num_drafts": "drafts",
    "vllm:spec_decode_num_draft_tokens": "proposed_tokens",
    "vllm:spec_decode_num_accepted_tokens": "accepted_draft_tokens",
    "trtspec_verification_rounds": "drafts",
    "trtspec_proposed_tokens": "proposed_tokens",
    "trtspec_accepted_draft_tokens": "accepted_draft_tokens",
}


def scrape(base_url: str, timeout: float = 5.0) -> dict[str, float] | None:
    """Spec-decode counters from <server>/metrics, or None when the server exposes none."""
    root = re.sub(r"/v1/?$", "", base_url.rstrip("/"))
    try:
        with urllib.request.urlopen(f"{root}/metrics", timeout=timeout) as r:
            text = r.read().decode()
    except OSError:
        return None
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        name = line.split("{")[0].split()[0].removesuffix("_total")
        if name in COUNTERS:
            out[COUNTERS[name]] = out.get(COUNTERS[name], 0.0) + float(line.split()[-1])
    return out or None


def counter_delta(before: dict[str, float] | None, after: dict[str, float] | None
                  ) -> dict[str, float]:
    if not before or not after:
        return {}
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    if d.get("proposed_tokens"):
        d["acceptance_rate"] = d.get("accepted_draft_tokens", 0.0) / d["proposed_tokens"]
    if d.get("drafts"):
        d["al_pooled"] = 1 + d.get("accepted_draft_tokens", 0.0) / d["drafts"]
    return d


async def _one(client: Any, model: str, request: WorkloadRequest, params: SamplingParams
               ) -> dict[str, Any]:
    messages = request.chat()
    if isinstance(messages, str):
        messages = [{"role": "user", "content": messages}]
    start = time.perf_counter()
    times: list[float] = []
    text, usage, finish = [], None, None
    stream = await client.chat.completions.create(
        model=model, messages=messages, stream=True, stream_options={"include_usage": True},
        max_tokens=request.max_tokens or params.max_tokens, temperature=params.temperature,
        top_p=params.top_p, seed=params.seed)
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            if choice.delta and choice.delta.content:
                times.append(time.perf_counter() - start)
                text.append(choice.delta.content)
            finish = choice.finish_reason or finish
    end = time.perf_counter() - start
    out_tokens = usage.completion_tokens if usage is not None else len(times)
    digest = hashlib.sha256("".join(text).encode()).hexdigest()[:16]
    return {"token_times_s": times, "output_tokens": out_tokens, "e2e_s": end,
            "output_digest": digest,
            "ttft_s": times[0] if times else None, "finish_reason": finish or "stop",
            "prompt_tokens": usage.prompt_tokens if usage is not None else None,
            "text_chars": len("".join(text))}


async def _arm(url: str, model: str, requests: Sequence[WorkloadRequest],
               sampling: SamplingParams, concurrency: int, key: str, arm: str,
               sink: Any, done: set[tuple[str, str, str]], on_record: Callable[[], None]
               ) -> None:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=url, api_key=os.environ.get("OPENAI_API_KEY", "EMPTY"),
                         max_retries=0)
    gate = asyncio.Semaphore(concurrency)

    async def go(r: WorkloadRequest) -> None:
        params = sampling.model_copy(update={"seed": request_seed(sampling.seed or 0, r.id)})
        async with gate:
            result = await _one(client, model, r, params)
        method, d, c = key.split("/")
        record = {"condition": key, "method": method, "draft_len": int(d[1:] or 0),
                  "concurrency": int(c[1:]), "arm": arm, "request_id": r.id,
                  "category": r.category, "source": r.source,
                  "context_tokens": result.pop("prompt_tokens"), "seed": params.seed,
                  "start_s": 0.0, "prefill_s": result["ttft_s"],
                  "decode_s": result["e2e_s"] - (result["ttft_s"] or 0.0),
                  "proposed_tokens": 0, "accepted_draft_tokens": 0,
                  "emitted_tokens": 0, "verification_rounds": 0, "discarded_tokens": 0,
                  "accepted_per_position": [], "proposed_per_position": [],
                  "per_token_times": False, "wall_clock": time.time(), **result}
        sink.write(json.dumps(record) + "\n")
        sink.flush()
        os.fsync(sink.fileno())
        on_record()

    await asyncio.gather(*(go(r) for r in requests if (key, arm, r.id) not in done))
    await client.close()


def run_endpoint_eval(out_dir: str | Path, requests: Sequence[WorkloadRequest], url: str,
                      model: str, sampling: SamplingParams, concurrency: Sequence[int],
                      baseline_url: str | None = None, resume: bool = False,
                      progress: Callable[[int, int], None] | None = None) -> Path:
    """Records for the endpoint (``spec``) and, if given, the baseline endpoint; server
    counters per arm go to ``server_counters.json``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / RECORDS
    if path.exists() and not resume:
        raise FileExistsError(f"{path} exists: pass --resume to continue that eval")
    done = done_keys(path)
    arms = [("spec", url)] + ([("baseline", baseline_url)] if baseline_url else [])
    total, finished = len(concurrency) * len(arms) * len(requests), [len(done)]
    counters_path = out / "server_counters.json"
    counters: dict[str, Any] = json.loads(counters_path.read_text()) \
        if counters_path.is_file() else {}

    def tick() -> None:
        finished[0] += 1
        if progress:
            progress(finished[0], total)

    with path.open("a") as sink:
        for c in concurrency:
            key = f"endpoint/D0/c{c}"
            for arm, arm_url in arms:
                before = scrape(arm_url)
                asyncio.run(_arm(arm_url, model, requests, sampling, c, key, arm, sink, done,
                                 tick))
                delta = counter_delta(before, scrape(arm_url))
                if delta:
                    counters[f"{key}/{arm}"] = delta
    counters_path.write_text(json.dumps(counters, indent=2) + "\n")
    return path
