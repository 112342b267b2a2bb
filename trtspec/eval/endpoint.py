"""Evaluate any OpenAI-compatible endpoint (trtspec serve, vLLM, trtllm-serve, SGLang …).

Streaming chat completions through the real ``openai`` client, so TTFT and ITL are what a
client sees. Concurrency is N client coroutines. The speculative server is the ``spec`` arm; an
optional second server without speculation is the ``baseline`` arm (same requests, seeds,
sampling and limits). Around each arm the server's Prometheus counters are scraped: vLLM's
``vllm:spec_decode_num_drafts / _num_draft_tokens / _num_accepted_tokens`` give the acceptance
rate and AL = 1 + Δaccepted / Δdrafts for that arm.

Records have the in-process schema; chunk arrival times stand in for token times (a chunk of a
speculative round carries several tokens), and output_tokens comes from the server's usage. The
arms alternate batch by batch (A B, then B A) as in-process evals do. A request the server
fails (any ``openai.APIError``, a broken connection, or a stream cut off before its
finish_reason) is recorded with its ``error`` and counted as failed; it does
not stop the arm, and a resumed eval measures it again. An endpoint that fails a whole first
batch stops the eval with one line.

A server that returns trtspec's ``spec`` extension with the usage (``trtspec serve``) fills
each record's speculation counters from it, so the records add up to its /metrics. Other
servers' samplers are not visible per request: their records' counters stay 0, and what their
counters say is in ``server_counters.json`` as ``al_from_counters`` (vLLM's
1 + Δaccepted / Δdrafts over the arm), which is not the in-process AL (emitted / rounds).

A condition is named after what the speculating server says it runs: before the first batch
one short probe request (the workload's first prompt, one token) reads the response's
per-request ``metrics.speculative_decoding`` (vLLM's shape, which trtspec serve sends):
``null`` means plain decoding (``endpoint/D0/c…``), ``num_spec_tokens`` = D the most drafts a
round may propose (``endpoint/D4/c…``). A server that does not say is ``endpoint/Dunknown/c…``.
A resumed eval keeps the names its records have.
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

from trtspec.analysis.records import failed
from trtspec.build.files import write_atomic
from trtspec.eval.run import (
    DIVERGENCES,
    RECORDS,
    append_line,
    done_keys,
    eval_clock,
    first_divergence,
    read_jsonl,
    request_seed,
)
from trtspec.eval.workloads.request import WorkloadRequest
from trtspec.spec.sample.probs import SamplingParams

COUNTERS = {  # Prometheus name (without _total) → our name
    "vllm:spec_decode_num_drafts": "drafts",
    "vllm:spec_decode_num_draft_tokens": "proposed_tokens",
    "vllm:spec_decode_num_accepted_tokens": "accepted_draft_tokens",
    "trtspec:spec_decode_num_drafts": "drafts",  # trtspec serve names them like vLLM
    "trtspec:spec_decode_num_draft_tokens": "proposed_tokens",
    "trtspec:spec_decode_num_accepted_tokens": "accepted_draft_tokens",
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
    return {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}


def counter_rates(delta: dict[str, float]) -> dict[str, float]:
    """The counters' deltas, their acceptance rate and their AL, labelled as what they are."""
    out = dict(delta)
    if delta.get("proposed_tokens"):
        out["acceptance_rate"] = delta.get("accepted_draft_tokens", 0.0) / delta["proposed_tokens"]
    if delta.get("drafts"):
        out["al_from_counters"] = 1 + delta.get("accepted_draft_tokens", 0.0) / delta["drafts"]
    return out


class EndpointUnreachable(RuntimeError):
    """An endpoint that does not answer at all (refused, unknown host, timeout)."""


def check_reachable(base_url: str, timeout: float = 10.0) -> None:
    """Raise one line when nothing answers at ``base_url``; any HTTP answer (even 401 or 404)
    means a server is there."""
    import urllib.error

    try:
        with urllib.request.urlopen(f"{base_url.rstrip('/')}/models", timeout=timeout):
            return
    except urllib.error.HTTPError:
        return
    except (OSError, ValueError) as e:
        reason = getattr(e, "reason", None) or e
        raise EndpointUnreachable(f"{base_url}: cannot connect ({reason}): is the server "
                                  "running, and is the URL its …/v1 base? Nothing was "
                                  "written") from None


def detect_server(base_url: str, timeout: float = 5.0) -> str:
    """Which server answers (vllm, trtllm, sglang, trtspec …) from /v1/models' owned_by, for
    the MLflow backend tag; "unknown" when it does not say."""
    try:
        with urllib.request.urlopen(f"{base_url.rstrip('/')}/models", timeout=timeout) as r:
            owner = str(json.loads(r.read())["data"][0].get("owned_by", ""))
    except (OSError, ValueError, KeyError, IndexError, TypeError):
        return "unknown"
    for name, hint in (("trtllm", "tensorrt"), ("vllm", "vllm"), ("sglang", "sglang"),
                       ("trtspec", "trtspec")):
        if hint in owner.lower():
            return name
    return owner or "unknown"


UNKNOWN = "unknown"


def announced_draft_len(extra: dict[str, Any]) -> int | str:
    """D as a response says it (its fields beyond OpenAI's): ``metrics.speculative_decoding``
    null → 0 (plain decoding), else its ``num_spec_tokens``; "unknown" when it says neither."""
    metrics = extra.get("metrics")
    if not isinstance(metrics, dict) or "speculative_decoding" not in metrics:
        return UNKNOWN
    spec = metrics["speculative_decoding"]
    if spec is None:
        return 0
    d = spec.get("num_spec_tokens") if isinstance(spec, dict) else None
    return d if isinstance(d, int) and not isinstance(d, bool) and d >= 0 else UNKNOWN


async def _probe(url: str, model: str, request: WorkloadRequest, params: SamplingParams
                 ) -> int | str:
    """D the server at ``url`` says it runs, from one streamed one-token request (the usage
    chunk carries the extensions); "unknown" when it says nothing or the request fails."""
    import openai
    from openai import AsyncOpenAI

    messages = request.chat()
    if isinstance(messages, str):
        messages = [{"role": "user", "content": messages}]
    client = AsyncOpenAI(base_url=url, api_key=os.environ.get("OPENAI_API_KEY", "EMPTY"),
                         max_retries=0)
    said: int | str = UNKNOWN
    try:
        stream = await client.chat.completions.create(
            model=model, messages=messages, stream=True, stream_options={"include_usage": True},
            max_tokens=1, temperature=params.temperature, seed=params.seed)
        async for chunk in stream:
            if chunk.usage is not None:
                said = announced_draft_len(chunk.model_extra or {})
    except (openai.APIError, *_transport_errors(), ConnectionError):
        return UNKNOWN
    finally:
        await client.close()
    return said


def condition_key(url: str, model: str, requests: Sequence[WorkloadRequest],
                  params: SamplingParams, c: int, recorded: set[str]) -> str:
    """``endpoint/D<d>/c<c>``: the name the records of concurrency c already have (a resumed
    eval, failed records included), else D from :func:`_probe` of the speculating server."""
    named = sorted(k for k in recorded if k.startswith("endpoint/") and k.endswith(f"/c{c}"))
    if named:
        return named[0]
    d = asyncio.run(_probe(url, model, requests[0], params)) if requests else UNKNOWN
    return f"endpoint/D{d}/c{c}"


async def _one(client: Any, model: str, request: WorkloadRequest, params: SamplingParams,
               sent: float | None = None, top_logprobs: int | None = None) -> dict[str, Any]:
    """One streamed request; times run from ``sent`` (perf_counter: an open-loop arrival that
    waited for a client) or from now. ``top_logprobs``: ask for that many alternatives per
    token, kept in the record (``output_token_texts``, ``top_logprobs``) so a greedy
    divergence's margin is known (:func:`record_divergences`)."""
    import openai

    messages = request.chat()
    if isinstance(messages, str):
        messages = [{"role": "user", "content": messages}]
    start = time.perf_counter() if sent is None else sent
    started = eval_clock() - (time.perf_counter() - start)  # shared by both arms and resumes
    times: list[float] = []
    text, usage, finish, spec = [], None, None, None
    tokens: list[str] = []
    tops: list[list[list[Any]]] = []
    asked = {"logprobs": True, "top_logprobs": top_logprobs} if top_logprobs else {}
    try:
        stream = await client.chat.completions.create(
            model=model, messages=messages, stream=True, stream_options={"include_usage": True},
            max_tokens=request.max_tokens or params.max_tokens, temperature=params.temperature,
            top_p=params.top_p, seed=params.seed,
            extra_body=_extensions(params), **asked)
        async for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
                spec = (chunk.model_extra or {}).get("spec")  # trtspec serve's extension
            for choice in chunk.choices:
                if choice.delta and choice.delta.content:
                    times.append(time.perf_counter() - start)
                    text.append(choice.delta.content)
                if top_logprobs and choice.logprobs is not None:
                    for entry in choice.logprobs.content or []:
                        tokens.append(entry.token)
                        tops.append([[t.token, float(t.logprob)]
                                     for t in entry.top_logprobs or []])
                finish = choice.finish_reason or finish
        if finish is None:  # cut off: not a completion, whatever came before
            raise ConnectionError("the stream ended without a finish_reason")
    except (openai.APIError, *_transport_errors(), ConnectionError) as e:
        reason = str(e).splitlines()[0] if str(e) else ""
        return {"error": f"{type(e).__name__}: {reason}"[:300], "start_s": started,
                "token_times_s": [], "output_tokens": 0, "e2e_s": time.perf_counter() - start,
                "output_digest": None, "ttft_s": None, "finish_reason": "error",
                "prompt_tokens": None, "text_chars": 0}
    end = time.perf_counter() - start
    out_tokens = usage.completion_tokens if usage is not None else len(times)
    digest = hashlib.sha256("".join(text).encode()).hexdigest()[:16]
    logprobs = {"output_token_texts": tokens, "top_logprobs": tops} if tokens else {}
    return {"start_s": started, "token_times_s": times, "output_tokens": out_tokens,
            "e2e_s": end, "output_digest": digest,
            "ttft_s": times[0] if times else None, "finish_reason": finish,
            "prompt_tokens": usage.prompt_tokens if usage is not None else None,
            "text_chars": len("".join(text)), **_counters(spec), **logprobs}


def _transport_errors() -> tuple[type[Exception], ...]:
    """The HTTP libraries' base errors, which the openai client lets through while a stream
    is read (a server that dies mid-stream): httpx's, and the httpx2 newer clients use."""
    found: list[type[Exception]] = [OSError]
    for name in ("httpx2", "httpx"):
        try:
            found.append(__import__(name).HTTPError)
        except (ImportError, AttributeError):
            continue
    return tuple(found)


SPEC_FIELDS = ("proposed_tokens", "accepted_draft_tokens", "emitted_tokens",
               "verification_rounds")


def _counters(spec: Any) -> dict[str, Any]:
    """A record's speculation counters from trtspec serve's ``spec`` extension (else none).
    Per round emitted + discarded = accepted + 1, so discarded is implied; whether a round
    rejected a draft is not sent (``rejected_rounds`` None: not recorded)."""
    if not isinstance(spec, dict) or not all(isinstance(spec.get(k), int) for k in SPEC_FIELDS):
        return {}
    out = {k: int(spec[k]) for k in SPEC_FIELDS}
    out["discarded_tokens"] = (out["accepted_draft_tokens"] + out["verification_rounds"]
                               - out["emitted_tokens"])
    out["rejected_rounds"] = None
    return out

def _extensions(params: SamplingParams) -> dict[str, Any] | None:
    """Sampling the OpenAI schema lacks, as vLLM, SGLang and trtllm-serve accept it."""
    extra = {"top_k": params.top_k} if params.top_k else {}
    if params.ignore_eos:
        extra["ignore_eos"] = True
    return extra or None


async def _batch(url: str, model: str, batch: Sequence[WorkloadRequest],
                 sampling: SamplingParams, key: str, arm: str, sink: Any,
                 on_record: Callable[[], None], measured: set[str] = frozenset(),
                 rate: float | None = None, block: str = "0.0",
                 top_logprobs: int | None = None) -> list[dict[str, Any]]:
    """One turn of one arm: ``c`` closed-loop clients (a request is sent when one finishes),
    or open-loop arrivals at ``rate`` requests/s with at most ``c`` in flight (an arrival
    waits for one to finish, and its times count the wait); records of the requests not in
    ``measured``."""
    from openai import AsyncOpenAI

    from trtspec.eval.clients import arrival_offsets

    client = AsyncOpenAI(base_url=url, api_key=os.environ.get("OPENAI_API_KEY", "EMPTY"),
                         max_retries=0)
    method, d, c = key.split("/")
    clients = asyncio.Semaphore(int(c[1:]))
    offsets = arrival_offsets(len(batch), rate, request_seed(sampling.seed or 0, batch[0].id))
    start = time.perf_counter()

    async def go(i: int, r: WorkloadRequest) -> dict[str, Any] | None:
        params = sampling.model_copy(update={"seed": request_seed(sampling.seed or 0, r.id)})
        arrival = None
        if offsets is not None:
            await asyncio.sleep(max(0.0, start + offsets[i] - time.perf_counter()))
            arrival = time.perf_counter()
        async with clients:
            result = await _one(client, model, r, params, arrival, top_logprobs)
        record = {"condition": key, "method": method,
                  "draft_len": int(d[1:]) if d[1:].isdigit() else d[1:],
                  "concurrency": int(c[1:]), "arm": arm, "request_id": r.id, "block": block,
                  "category": r.category, "source": r.source,
                  "context_tokens": result.pop("prompt_tokens"), "seed": params.seed,
                  "prefill_s": result["ttft_s"],
                  "decode_s": result["e2e_s"] - (result["ttft_s"] or 0.0),
                  "proposed_tokens": 0, "accepted_draft_tokens": 0,
                  "emitted_tokens": 0, "verification_rounds": 0, "discarded_tokens": 0,
                  "accepted_per_position": [], "proposed_per_position": [],
                  "per_token_times": False, "wall_clock": time.time(), **result}
        if r.id in measured:
            return None
        append_line(sink, record)
        on_record()
        return record

    try:
        return [x for x in await asyncio.gather(*(go(i, r) for i, r in enumerate(batch)))
                if x is not None]
    finally:
        await client.close()


def run_endpoint_eval(out_dir: str | Path, requests: Sequence[WorkloadRequest], url: str,
                      model: str, sampling: SamplingParams, concurrency: Sequence[int],
                      baseline_url: str | None = None, resume: bool = False,
                      progress: Callable[[int, int, str], None] | None = None,
                      rate: float | None = None, top_logprobs: int | None = None,
                      dtype: str | None = None) -> Path:
    """Records for the endpoint (``spec``) and, if given, the baseline endpoint, turn by turn
    (c = 1: one request; else 4c requests from c closed-loop clients; with a ``rate``,
    max(8, 4c) arrivals, at most c in flight)
    with alternating arm order; server counters per arm go to ``server_counters.json``.
    ``top_logprobs``: at temperature 0, ask both servers for that many top log-probabilities
    per token (where both accept them), so a divergence's margin is known; ``dtype`` is what
    the target ran in, for the tie margin (None: not known)."""
    out = Path(out_dir)
    path = out / RECORDS
    if path.exists() and not resume:
        raise FileExistsError(f"{path} exists: pass --resume to continue that eval")
    recorded = {r["condition"] for r in read_jsonl(path)} if path.exists() else set()
    urls = {"spec": url, **({"baseline": baseline_url} if baseline_url else {})}
    keys = [(c, condition_key(url, model, requests, sampling, c, recorded))
            for c in concurrency]
    asked = bool(sampling.greedy and baseline_url and top_logprobs and requests)
    k = top_logprobs if asked and all(  # both arms or neither
        accepts_logprobs(u, model, requests[0], sampling, top_logprobs or 0)
        for u in urls.values()) else None
    total = len(concurrency) * len(urls) * len(requests)
    run_arms(out, requests, urls, model, sampling, keys, progress, rate, k, total)
    if k:
        record_divergences(out, read_jsonl(path), dtype)
    return path


def run_arms(out_dir: str | Path, requests: Sequence[WorkloadRequest], urls: dict[str, str],
             model: str, sampling: SamplingParams, keys: Sequence[tuple[int, str]],
             progress: Callable[[int, int, str], None] | None = None,
             rate: float | None = None, top_logprobs: int | None = None,
             total: int | None = None) -> Path:
    """Measure the ``urls`` arms (``spec``, ``baseline`` or both, alternating batch by batch)
    of the conditions ``keys`` ((concurrency, condition name)), appending what is not yet
    recorded; ``total``: the records of the whole eval, for ``progress``."""
    from trtspec.eval.run import alternate, turn_size, turns

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / RECORDS
    done = done_keys(path)
    total = total if total is not None else len(keys) * len(urls) * len(requests)
    finished = [len(done)]
    label = [""]
    counters_path = out / "server_counters.json"
    # raw counter deltas per condition/arm, added across batches and resumed sessions
    saved: dict[str, Any] = json.loads(counters_path.read_text()) \
        if counters_path.is_file() else {}

    def tick() -> None:
        finished[0] += 1
        if progress:
            progress(finished[0], total, label[0])

    with path.open("a") as sink:
        for c, key in keys:
            # an arm that never answered stops the eval after one batch (a dead endpoint)
            answered = {arm: any((key, arm, r.id) in done for r in requests) for arm in urls}
            for i, batch in enumerate(turns(requests, turn_size(c, rate, len(requests)))):
                for arm in alternate(tuple(urls), i):
                    measured = {r.id for r in batch if (key, arm, r.id) in done}
                    if len(measured) == len(batch):
                        continue
                    label[0] = f"{key} {arm}"
                    # the whole batch again, so a resumed request runs at the concurrency it
                    # is measured for; only what is missing is recorded
                    before = scrape(urls[arm])
                    got = asyncio.run(_batch(urls[arm], model, batch, sampling, key, arm, sink,
                                             tick, measured, rate, f"0.{i}", top_logprobs))
                    delta = counter_delta(before, scrape(urls[arm]))
                    if delta:  # per batch: a batch measured again replaces its delta
                        entry = saved.setdefault(f"{key}/{arm}", {})
                        entry.setdefault("batches", {})[str(i)] = delta
                        raw: dict[str, float] = {}
                        for batch_delta in entry["batches"].values():
                            for name, value in batch_delta.items():
                                raw[name] = raw.get(name, 0.0) + value
                        entry |= {"raw": raw, **counter_rates(raw)}
                        write_atomic(counters_path, json.dumps(saved, indent=2) + "\n")
                    answered[arm] |= not all(failed(r) for r in got)
                    if not answered[arm]:
                        raise RuntimeError(f"{urls[arm]} ({arm} arm) failed every request of "
                                           f"its first batch: {got[0]['error']}; records so "
                                           f"far are kept in {out}")
    return path


TOP_LOGPROBS = 5  # alternatives per token asked of a greedy eval's servers


def warm_up(url: str, model: str, requests: Sequence[WorkloadRequest], params: SamplingParams
            ) -> None:
    """Send ``requests`` once, untimed and unrecorded, one after another: a server just
    started captures graphs and tunes kernels on its first requests, which would otherwise
    land in whichever arm runs first."""
    asyncio.run(_warm(url, model, requests, params))


async def _warm(url: str, model: str, requests: Sequence[WorkloadRequest],
                params: SamplingParams) -> None:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=url, api_key=os.environ.get("OPENAI_API_KEY", "EMPTY"),
                         max_retries=0)
    try:
        for request in requests:
            await _one(client, model, request, params)  # a failure is the eval's to see
    finally:
        await client.close()


def accepts_logprobs(url: str, model: str, request: WorkloadRequest, params: SamplingParams,
                     k: int = TOP_LOGPROBS) -> bool:
    """Whether the server at ``url`` returns top log-probabilities (one streamed one-token
    request asking for ``k``): trtspec serve refuses them (400), others may ignore them."""
    return bool(asyncio.run(_logprobs_probe(url, model, request, params, k)))


async def _logprobs_probe(url: str, model: str, request: WorkloadRequest,
                          params: SamplingParams, k: int) -> bool:
    import openai
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=url, api_key=os.environ.get("OPENAI_API_KEY", "EMPTY"),
                         max_retries=0)
    one = request.model_copy(update={"max_tokens": 1})
    try:
        got = await _one(client, model, one, params.model_copy(update={"max_tokens": 1}),
                         top_logprobs=k)
    except (openai.APIError, *_transport_errors(), ConnectionError):
        return False
    finally:
        await client.close()
    return "error" not in got and any(got.get("top_logprobs") or [])


def divergence(base: dict[str, Any], spec: dict[str, Any], dtype: str | None = None
               ) -> dict[str, Any] | None:
    """Where a greedy spec output first differs from its baseline, from the tokens and top
    log-probabilities the servers returned: the target's margin between the two tokens there
    is |log p(a) − log p(b)| (= |logit a − logit b|, the normaliser cancels), read from the
    baseline's top list, the reference; only where the baseline listed nothing at that
    position from the speculating server's (both saw the same prefix). A list without both
    tokens is evidence of a real gap: ``margin`` None (a divergence) and ``margin_at_least``
    the gap to its last entry, so a server whose own (possibly wrong) logits show a near-tie
    cannot certify its divergence as a tie. None when the outputs do not differ or a record
    has no tokens."""
    a, b = base.get("output_token_texts"), spec.get("output_token_texts")
    if not a or not b or base.get("output_digest") == spec.get("output_digest"):
        return None
    at = first_divergence(a, b)
    if at is None:
        return None
    entry: dict[str, Any] = {"position": at, "baseline_token": None, "spec_token": None,
                             "margin": None, "dtype": dtype, "margin_from": "top_logprobs"}
    if at >= min(len(a), len(b)):  # one output stopped early: no token pair
        return entry
    entry |= {"baseline_token": a[at], "spec_token": b[at]}
    for arm, record in (("baseline", base), ("spec", spec)):
        tops = record.get("top_logprobs") or []
        listed = dict((t, lp) for t, lp in reversed(tops[at])) if at < len(tops) else {}
        if not listed:
            continue  # this arm listed nothing here: the other's list, if any
        if a[at] in listed and b[at] in listed:
            return entry | {"margin": abs(listed[a[at]] - listed[b[at]]), "margin_arm": arm}
        if a[at] in listed:  # b below the list: the gap is at least to its last entry
            entry["margin_at_least"] = listed[a[at]] - min(listed.values())
        return entry  # the first arm with a list decides: never a tie it did not show
    return entry


def record_divergences(out: Path, records: Sequence[dict[str, Any]], dtype: str | None = None
                       ) -> None:
    """divergences.jsonl for a greedy endpoint eval (see :func:`divergence`); pairs already
    there are skipped, as in-process."""
    path = out / DIVERGENCES
    seen = {(d["condition"], d["request_id"]) for d in read_jsonl(path)}
    arms: dict[tuple[str, str], dict[str, dict[str, Any]]] = {}
    for r in records:
        if not failed(r):
            arms.setdefault((r["condition"], r["request_id"]), {})[r["arm"]] = r
    with path.open("a") as sink:
        for (condition, rid), pair in sorted(arms.items()):
            if (condition, rid) in seen or len(pair) < 2:
                continue
            entry = divergence(pair["baseline"], pair["spec"], dtype)
            if entry is not None:
                append_line(sink, {"condition": condition, "request_id": rid, **entry})
