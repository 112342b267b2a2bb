"""Baseline vs speculative, under identical conditions, one JSON record per finished request.

A condition is method × D × concurrency (D: a draft length, or "adaptive": each request
chooses its own per round, and records keep each round's D in ``draft_lens``). For each
condition the two arms, ``baseline`` (plain decoding) and ``spec``, run the same requests with
the same seeds, sampling, output limits and warm-up, in the order A B for even batches and B A
for odd ones, so that drift on a shared machine hits both alike.
Context length is a property of each request (``context_tokens``), so any bucketing is a split
of the records, not another run.

Every finished request is appended to ``records.jsonl`` and flushed at once. ``resume`` skips
the (condition, arm, request) triples already there and drops a last line torn by a kill, so
killing the process loses only the requests in flight.
"""

from __future__ import annotations

import json
import os
import time
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from trtspec.analysis.records import failed, on_eval_clock, unanswered
from trtspec.build.files import write_atomic
from trtspec.eval.clients import cuda_in_use, peak_rss_mb, reset_peak_rss
from trtspec.eval.workloads.request import WorkloadRequest
from trtspec.runtime.trtllm_stream import LlmArm
from trtspec.spec.executor import SpecExecutor
from trtspec.spec.sample.probs import SamplingParams

RECORDS = "records.jsonl"
ARMS = ("baseline", "spec")
_ORIGIN = (time.time(), time.perf_counter())


def eval_clock() -> float:
    """The eval's clock: epoch seconds, so records of a resumed run (another process) share it,
    but advancing with perf_counter, so a step of the wall clock (NTP) cannot bend intervals
    within a run."""
    return _ORIGIN[0] + time.perf_counter() - _ORIGIN[1]


@dataclass(frozen=True)
class Condition:
    """One method × D × concurrency; D is an int or "adaptive" (each request chooses its own
    per round: the key reads method/Dadaptive/cN)."""

    method: str
    draft_len: int | str
    concurrency: int

    @property
    def key(self) -> str:
        return f"{self.method}/D{self.draft_len}/c{self.concurrency}"


@dataclass
class EvalInputs:
    """What an eval needs besides its output folder; built from a recipe + manifest by the CLI,
    or directly (toy models) in tests."""

    requests: Sequence[WorkloadRequest]
    conditions: Sequence[Condition]
    # (condition, arm) → trtspec's executor, or an LlmArm (TensorRT-LLM's batch)
    make_executor: Callable[[Condition, str], SpecExecutor | LlmArm]
    encode: Callable[[WorkloadRequest], list[int]]
    sampling: SamplingParams  # max_tokens here is the default; a request's own wins
    warmup: int = 1
    # (prompt + common output prefix, token a, token b) → (|logit a − logit b| under the
    # target, the dtype it ran in); at temperature 0 it tells a numerical tie from a real
    # divergence between the arms
    margin: Callable[[list[int], int, int], tuple[float, str]] | None = None
    slots: int | None = None  # the scheduler's slots [default: the condition's concurrency]
    request_rate: float | None = None  # open-loop arrivals per second; None = closed loop
    look: int = 0  # which round of requests (eval --until-decided adds rounds): names turns


def request_seed(base: int, request_id: str) -> int:
    """The same seed for a request in both arms and every condition (stable across runs)."""
    return (base * 1_000_003 + zlib.crc32(request_id.encode())) % 2**31


def repair_jsonl(path: Path) -> None:
    """Drop a last line torn by a kill; every line before it is intact (each was flushed and
    fsynced whole)."""
    if not path.is_file():
        return
    good = 0
    with path.open("rb") as f:
        for raw in f:
            try:
                json.loads(raw)
            except json.JSONDecodeError:
                break
            good += len(raw)
    if good != path.stat().st_size:
        with path.open("r+b") as f:
            f.truncate(good)


def append_line(sink: Any, record: dict[str, Any]) -> None:
    """One JSON line, flushed and fsynced at once: a kill loses at most the line in flight,
    which :func:`repair_jsonl` drops."""
    sink.write(json.dumps(record) + "\n")
    sink.flush()
    os.fsync(sink.fileno())


def done_keys(path: Path) -> set[tuple[str, str, str]]:
    """(condition, arm, request id) already measured; a failed request (an endpoint error) is
    not, so a resumed eval measures it again."""
    return {(r["condition"], r["arm"], r["request_id"]) for r in read_jsonl(path)
            if not failed(r)}


def run_eval(out_dir: str | Path, inputs: EvalInputs, resume: bool = False,
             progress: Callable[[int, int, str], None] | None = None) -> Path:
    """Run every condition × arm × request not yet recorded; returns records.jsonl."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / RECORDS
    if path.exists() and not resume:
        raise FileExistsError(f"{path} exists: pass --resume to continue that eval, or choose "
                              "another --eval-id")
    cut = cut_turns(inputs, {(r["condition"], r["arm"], r["request_id"])
                             for r in read_jsonl(path)})
    if cut:  # measured again whole, in both arms: a pair's two halves run minutes apart,
        for name in (RECORDS, DIVERGENCES):  # not one now and one before the interruption
            if (out / name).is_file():
                write_atomic(out / name, "".join(
                    json.dumps(r) + "\n" for r in read_jsonl(out / name)
                    if (r["condition"], r["request_id"]) not in cut))
    done = done_keys(path)
    total = len(inputs.conditions) * len(ARMS) * len(inputs.requests)
    finished = sum((c.key, arm, r.id) in done for c in inputs.conditions for arm in ARMS
                   for r in inputs.requests)  # of this call's: a round counts its own
    with path.open("a") as sink:
        for condition in inputs.conditions:
            if all((condition.key, arm, r.id) in done for arm in ARMS for r in inputs.requests):
                continue  # measured already (a resumed eval): no models to load
            if progress:
                progress(finished, total, f"{condition.key}: loading and warming up")
            executors = {arm: inputs.make_executor(condition, arm) for arm in ARMS}
            _warm_up(executors, inputs, _slots(inputs, condition))
            turn = turn_size(condition.concurrency, inputs.request_rate, len(inputs.requests))
            for i, batch in enumerate(turns(inputs.requests, turn)):
                for arm in alternate(ARMS, i):
                    if all((condition.key, arm, r.id) in done for r in batch):
                        continue
                    label = f"{condition.key} {arm}"
                    if progress:
                        progress(finished, total, label)
                    # the whole batch again, so a resumed request runs beside the others it
                    # is measured with; only what is missing is recorded
                    for record in _measure(executors[arm], batch, inputs, condition, arm,
                                           f"{inputs.look}.{i}"):
                        if (condition.key, arm, record["request_id"]) in done:
                            continue
                        append_line(sink, record)
                        finished += 1
                        if progress:
                            progress(finished, total, label)
    if inputs.sampling.greedy and inputs.margin is not None:
        record_divergences(out, read_records(path), inputs)
    return path


OPEN_LOOP_TURN = 8  # requests per turn with open-loop arrivals, at least


def turn_size(concurrency: int, rate: float | None, total: int) -> int:
    """Requests per turn of an arm, the unit the arms alternate in (A B, then B A) and the
    decide step resamples. Closed-loop clients: one at c = 1 (the arms alternate request by
    request); at c > 1, 4c, so that clients start requests as others finish (each turn ends
    with a drain, as the last requests finish). Open-loop arrivals (``rate``): blocks of
    max(8, 4c) arrivals, each arm's block sent at the same seeded offsets, so drift and
    one-off costs land on both arms alike rather than on whichever ran second."""
    if rate is not None:
        return min(total, max(OPEN_LOOP_TURN, 4 * concurrency))
    return 1 if concurrency == 1 else 4 * concurrency


def turns(requests: Sequence[WorkloadRequest], size: int) -> Iterator[list[WorkloadRequest]]:
    for i in range(0, len(requests), size):
        yield list(requests[i: i + size])


def cut_turns(inputs: EvalInputs, recorded: set[tuple[str, str, str]]) -> set[tuple[str, str]]:
    """(condition, request id) of every request of a turn that an interruption left recorded
    in part (``recorded``: (condition, arm, request id) with a record, failed or not; some of
    the turn's requests or one of its arms have none): a resumed eval drops what that turn
    recorded and measures it again in both arms, so each pair's baseline and spec ran side by
    side, not hours apart on a machine that may have changed. A turn whose every request has
    a record is whole: a request that failed at an endpoint is measured again in its arm
    alone, as an error is not an interruption."""
    cut = set()
    for condition in inputs.conditions:
        size = turn_size(condition.concurrency, inputs.request_rate, len(inputs.requests))
        for batch in turns(inputs.requests, size):
            keys = {(condition.key, arm, r.id) for arm in ARMS for r in batch}
            if keys & recorded and not keys <= recorded:
                cut |= {(condition.key, r.id) for r in batch}
    return cut


def alternate(arms: tuple[str, ...], batch_index: int) -> tuple[str, ...]:
    """A B for even batches, B A for odd ones: neither arm always goes first, and each goes
    first equally often (one more at most)."""
    return arms if batch_index % 2 == 0 else arms[::-1]


def _slots(inputs: EvalInputs, condition: Condition) -> int:
    """The scheduler's slots: the build's batch, capped at c with open-loop arrivals (where c
    caps the requests running at once). Warm-up compiles for the same number."""
    slots = inputs.slots or condition.concurrency
    return min(slots, condition.concurrency) if inputs.request_rate is not None else slots


def _warm_up(executors: dict[str, SpecExecutor | LlmArm], inputs: EvalInputs, slots: int
             ) -> None:
    """Compiled graphs for the scheduler's batch of ``slots`` rows, then ``inputs.warmup``
    requests per arm, untimed (an LlmArm's through its scheduler: TensorRT-LLM captured its
    graphs when its LLM was made)."""
    from trtspec.eval.clients import run_clients

    for executor in executors.values():  # (a runner returns at once for a batch it warmed)
        if isinstance(executor, SpecExecutor):
            executor.target.warm_up(slots)
    if not inputs.warmup:
        return
    warm = list(inputs.requests[: inputs.warmup])
    params = inputs.sampling.model_copy(update={"max_tokens": 8})
    for executor in executors.values():
        if not isinstance(executor, SpecExecutor):  # on a prompt of its own: TensorRT-LLM's
            prompt = list(range(1, 9))  # n-gram pool keeps what it saw, and must not have
            run_clients(executor, [prompt] * len(warm), [params] * len(warm), len(warm),
                        slots)  # seen the measured prompts
            if executor.forget is not None:
                executor.forget()
            continue
        executor.generate([inputs.encode(r) for r in warm], params)
        if executor.proposer is not None:  # suffix: warm-up outputs are not there to be
            executor.proposer.forget()  # drafted from


def _measure(executor: SpecExecutor | LlmArm, batch: list[WorkloadRequest], inputs: EvalInputs,
             condition: Condition, arm: str, block: str) -> list[dict[str, Any]]:
    """One turn of an arm: the batch through the serving scheduler, sent by ``concurrency``
    closed-loop clients, or arriving at ``request_rate`` with at most ``concurrency`` running
    at once (the scheduler's slots; the rest wait); times run from when each request was sent,
    so TTFT includes waiting for a slot. ``block`` names the turn in the records."""
    from trtspec.eval.clients import arrival_offsets, run_clients

    prompts = [inputs.encode(r) for r in batch]
    cuda = cuda_in_use()
    if cuda:
        import torch

        torch.cuda.reset_peak_memory_stats()
    reset_peak_rss()
    params = [inputs.sampling.model_copy(update={
        "seed": request_seed(inputs.sampling.seed or 0, r.id),
        "max_tokens": r.max_tokens or inputs.sampling.max_tokens}) for r in batch]
    offsets = arrival_offsets(len(batch), inputs.request_rate,
                              request_seed(inputs.sampling.seed or 0, batch[0].id))
    clock = eval_clock() - time.perf_counter()  # perf_counter → the eval's clock
    sent, _ = run_clients(executor, prompts, params, condition.concurrency,
                          _slots(inputs, condition), offsets)
    memory = {"peak_rss_mb": peak_rss_mb()}
    if cuda:
        import torch

        memory["cuda_max_allocated_mb"] = torch.cuda.max_memory_allocated() / 2**20
        memory["cuda_total_mb"] = torch.cuda.get_device_properties(
            torch.cuda.current_device()).total_memory / 2**20
    records = []
    for r, prompt, p, s in zip(batch, prompts, params, sent, strict=True):
        stats, times, tokens = s.ticket.stats, s.token_times, s.ticket.token_ids
        queue = (s.admitted - s.sent) if s.admitted is not None else None
        records.append({
            "condition": condition.key, **asdict(condition), "arm": arm, "request_id": r.id,
            "prompt_id": r.copy_of or r.id, "block": block,
            "category": r.category, "source": r.source, "context_tokens": len(prompt),
            "output_tokens": len(tokens), "finish_reason": s.ticket.finish_reason,
            "output_digest": _digest(tokens), "output_token_ids": tokens,
            "seed": p.seed, "start_s": clock + s.sent, "token_times_s": times,
            "ttft_s": times[0] if times else None, "e2e_s": times[-1] if times else 0.0,
            "queue_s": queue,
            "prefill_s": (times[0] - (queue or 0.0)) if times else None,
            "decode_s": (times[-1] - times[0]) if times else 0.0,
            "proposed_tokens": stats.proposed_tokens,
            "accepted_draft_tokens": stats.accepted_draft_tokens,
            "emitted_tokens": stats.emitted_tokens,
            "verification_rounds": stats.verification_rounds,
            "discarded_tokens": stats.discarded_tokens,
            "rejected_rounds": stats.rejected_rounds,
            "accepted_per_position": stats.accepted_per_position,
            "proposed_per_position": stats.proposed_per_position,
            "draft_lens": stats.draft_lens, "proposed_lens": stats.proposed_lens,
            "wall_clock": time.time(), **memory,
        })
    return records


DIVERGENCES = "divergences.jsonl"


def first_divergence(a: Sequence[int], b: Sequence[int]) -> int | None:
    """The first position where two outputs differ (a length difference counts), or None."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def record_divergences(out: Path, records: Sequence[dict[str, Any]], inputs: EvalInputs) -> None:
    """For greedy evals: where each spec output first differs from its baseline, and the
    target's logit margin between the two tokens there (one prefill of prompt + common prefix).
    A margin within the decide step's tie tolerance is a numerical near-tie (bf16 kernels may
    order two almost-equal logits differently in a 1-token and a (D+1)-token forward), not a
    verification error. Appended to divergences.jsonl; pairs already there are skipped."""
    assert inputs.margin is not None
    path = out / DIVERGENCES
    seen = {(d["condition"], d["request_id"]) for d in read_jsonl(path)}
    by_id = {r.id: r for r in inputs.requests}
    arms: dict[tuple[str, str], dict[str, dict[str, Any]]] = {}
    for r in records:
        arms.setdefault((r["condition"], r["request_id"]), {})[r["arm"]] = r
    with path.open("a") as sink:
        for (condition, rid), pair in sorted(arms.items()):
            if (condition, rid) in seen or len(pair) < 2 or rid not in by_id:
                continue
            base = pair["baseline"].get("output_token_ids")
            spec = pair["spec"].get("output_token_ids")
            if base is None or spec is None:
                continue
            at = first_divergence(base, spec)
            if at is None:
                continue
            if at >= min(len(base), len(spec)):  # one output stopped early: no token pair
                entry = {"position": at, "baseline_token": None, "spec_token": None,
                         "margin": None, "dtype": None}
            else:
                prefix = inputs.encode(by_id[rid]) + list(base[:at])
                margin, dtype = inputs.margin(prefix, base[at], spec[at])
                entry = {"position": at, "baseline_token": base[at], "spec_token": spec[at],
                         "margin": margin, "dtype": dtype}
            append_line(sink, {"condition": condition, "request_id": rid, **entry})


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The lines of a JSONL file; a last line torn by a kill is dropped (and the file
    repaired), as for records."""
    if not path.is_file():
        return []
    repair_jsonl(path)
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _digest(token_ids: list[int]) -> str:
    """Identifies an output (greedy identity across arms) without storing the tokens."""
    import hashlib

    return hashlib.sha256(json.dumps(token_ids).encode()).hexdigest()[:16]


def read_records(path: str | Path) -> list[dict[str, Any]]:
    path = Path(path)
    if path.is_dir():
        path = path / RECORDS
    return read_jsonl(path)


def summarize(records: Sequence[dict[str, Any]], arms: Sequence[str] = ARMS
              ) -> dict[str, dict[str, Any]]:
    """Per condition: each arm's latency distributions and speculation stats, and the
    baseline/spec ratios of TPOT p50 and E2E p50 (> 1 means speculation is faster), over the
    same requests: those answered in every arm. A failed request (an endpoint error) is
    counted in its arm's ``failed_requests`` and left out of every arm's figures; a request
    measured in one arm only (an interrupted eval) is left out and counted as
    ``unpaired_records``."""
    from trtspec.analysis.records import drop_unpaired

    out: dict[str, dict[str, Any]] = {}
    keys = sorted({r["condition"] for r in records})
    for key in keys:
        rows, unpaired = drop_unpaired([r for r in records if r["condition"] == key], arms)
        entry: dict[str, Any] = {"unpaired_records": unpaired} if unpaired else {}
        answered = {arm: {r["request_id"] for r in rows if r["arm"] == arm and not failed(r)}
                    for arm in arms}
        both = set.intersection(*answered.values()) if answered else set()
        for arm in ARMS:
            arm_rows = [r for r in rows if r["arm"] == arm]
            if not arm_rows:
                continue
            good = [r for r in arm_rows if r["request_id"] in both and not failed(r)]
            entry[arm] = _arm_summary(good)
            entry[arm]["failed_requests"] = len(unanswered(arm_rows))
            entry[arm]["categories"] = {c: _arm_summary([r for r in good if r["category"] == c])
                                        for c in sorted({r["category"] for r in good})}
        base, spec = entry.get("baseline", {}), entry.get("spec", {})
        for metric in ("tpot_ms_p50", "e2e_ms_p50"):
            if base.get(metric) and spec.get(metric):
                entry[f"speedup_{metric.removesuffix('_ms_p50')}_p50"] = base[metric] / spec[metric]
        out[key] = entry
    return out


def _arm_summary(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Latency distributions, prefill/decode split, memory and speculation stats of records."""
    from trtspec.analysis.records import RequestTiming, distribution, latency_summary
    from trtspec.spec.counters import SpecStats

    stats = SpecStats.merge(SpecStats.from_record(r) for r in rows)
    out = {**latency_summary([RequestTiming.from_record(r) for r in rows]), **stats.summary(),
           "acceptance_per_position": stats.acceptance_per_position,
           "draft_len_share": {str(d): share for d, share in stats.draft_len_share.items()}}
    if not on_eval_clock(rows):
        out.pop("output_tokens_per_s", None)
    out |= distribution([r["prefill_s"] for r in rows if r.get("prefill_s") is not None],
                        "prefill_ms")
    out |= distribution([r["decode_s"] for r in rows if r.get("decode_s") is not None],
                        "decode_ms")
    for key, names in (("peak_rss_mb", ("peak_rss_mb", "rss_mb")),
                       ("peak_cuda_max_allocated_mb", ("cuda_max_allocated_mb",))):
        values = [v for r in rows for n in names if (v := r.get(n)) is not None]
        if values:
            out[key] = max(values)
    return out

