"""The eval record schema as analysis reads it: a request's timing (TTFT, ITL, TPOT, E2E on the
eval's clock), latency distributions and summaries, condition keys, failed and unanswered rows,
pairing, throughput per arm and the draft lengths adaptive conditions chose.

A record is one request of one arm (``baseline`` or ``spec``) of one condition
(``<method>/D<draft_len>/c<concurrency>``), written by :mod:`trtspec.eval.run`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from trtspec.spec.counters import SpecStats, histogram


@dataclass
class RequestTiming:
    """When one request's tokens reached the client (seconds, one clock).

    ``token_times[i]`` is the arrival of output token i; tokens of one speculative round arrive
    together, so ITL is bursty and TPOT is the steadier number (as vLLM's bench notes).
    """

    start: float
    token_times: list[float]  # per token; for endpoints, per streamed chunk
    end: float
    tokens: int | None = None  # output tokens when chunks carry several (server usage)

    @classmethod
    def from_record(cls, r: dict) -> RequestTiming:
        """An eval record on the eval's clock: ``start_s`` is when the request was sent (seconds
        on one clock per eval; 0 in records written before that clock existed), its
        ``token_times_s`` and ``e2e_s`` are relative to that start."""
        start = float(r.get("start_s") or 0.0)
        return cls(start, [start + t for t in r["token_times_s"]], start + r["e2e_s"],
                   r["output_tokens"])

    @property
    def output_tokens(self) -> int:
        return self.tokens if self.tokens is not None else len(self.token_times)

    @property
    def ttft(self) -> float | None:
        return self.token_times[0] - self.start if self.token_times else None

    @property
    def e2e(self) -> float:
        return self.end - self.start

    @property
    def tpot(self) -> float | None:
        """(E2E − TTFT) / (output tokens − 1); None for a single-token output."""
        if self.output_tokens < 2 or self.ttft is None:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)

    @property
    def itl(self) -> list[float]:
        """Inter-token latencies as the client sees them (0 inside a burst)."""
        return [b - a for a, b in zip(self.token_times, self.token_times[1:], strict=False)]


PERCENTILES = (50, 90, 99)


def distribution(values: Sequence[float], prefix: str, scale: float = 1e3) -> dict[str, float]:
    """{prefix_mean, prefix_p50, prefix_p90, prefix_p99} (× scale: seconds → ms by default)."""
    if not len(values):
        return {}
    arr = np.asarray(values, dtype=float) * scale
    out = {f"{prefix}_mean": float(arr.mean())}
    for p in PERCENTILES:
        out[f"{prefix}_p{p}"] = float(np.percentile(arr, p))
    return out


def busy_seconds(timings: Sequence[RequestTiming]) -> float:
    """Length of the union of the requests' [start, end] intervals: the wall time during which
    at least one of them was running. Two arms measured in turn each get only their own time;
    requests running together count once."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted((t.start, t.end) for t in timings):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def on_eval_clock(rows: Sequence[dict]) -> bool:
    """Whether records carry start times on the eval clock (records written before it have
    ``start_s`` 0: their intervals cannot be placed, so no aggregate throughput)."""
    return bool(rows) and all((r.get("start_s") or 0) > 0 for r in rows)


def condition_parts(key: str) -> tuple[str, int | str, int]:
    """A condition key "method/D4/c2" → ("method", 4, 2); an adaptive draft length's key
    "method/Dadaptive/c2" → ("method", "adaptive", 2)."""
    method, d, c = key.split("/")
    return method, int(d[1:]) if d[1:].isdigit() else d[1:], int(c[1:])


def failed(record: dict) -> bool:
    """A request that got no answer (an endpoint error): it has no latency to measure."""
    return record.get("error") is not None


def drop_unpaired(records: Sequence[dict], arms: Sequence[str] = ("baseline", "spec")
                  ) -> tuple[list[dict], int]:
    """(the records whose request has a record in every arm of its condition, how many do
    not). An eval interrupted between the arms of a batch leaves requests measured in one arm
    only until it is resumed; comparing arms over different requests would bias both. A failed
    record (an endpoint error) is a record: failures are counted, not hidden. ``arms`` is what
    the eval measures (an endpoint eval without a baseline endpoint has "spec" only)."""
    seen: dict[tuple[str, str], set[str]] = {}
    for r in records:
        seen.setdefault((r["condition"], r["request_id"]), set()).add(r["arm"])
    kept = [r for r in records if seen[(r["condition"], r["request_id"])] >= set(arms)]
    return kept, len(records) - len(kept)


def unanswered(rows: Sequence[dict]) -> set[str]:
    """Ids of requests that failed in an arm and were not measured again successfully in that
    arm on resume."""
    answered = {(r["arm"], r["request_id"]) for r in rows if not failed(r)}
    return {r["request_id"] for r in rows
            if failed(r) and (r["arm"], r["request_id"]) not in answered}


def arm_throughput(records: Sequence[dict]) -> dict[str, dict[str, dict[str, float]]]:
    """Per condition and arm of eval records: requests, output tokens, busy wall seconds and
    tokens/s (records without the eval clock give no figure)."""
    out: dict[str, dict[str, dict[str, float]]] = {}
    for key in sorted({r["condition"] for r in records}):
        for arm in ("baseline", "spec"):
            rows = [r for r in records if r["condition"] == key and r["arm"] == arm
                    and not failed(r)]
            if not on_eval_clock(rows):  # written before the eval clock: no honest figure
                continue
            wall = busy_seconds([RequestTiming.from_record(r) for r in rows])
            if wall > 0:
                tokens = sum(r["output_tokens"] for r in rows)
                out.setdefault(key, {})[arm] = {"requests": len(rows), "output_tokens": tokens,
                                                "wall_s": wall, "tokens_per_s": tokens / wall}
    return out


def latency_summary(timings: Sequence[RequestTiming]) -> dict[str, float]:
    """TTFT, ITL, TPOT, E2E in ms (mean, p50, p90, p99), output tokens/s per request (mean) and
    aggregate throughput ``output_tokens_per_s`` = all output tokens / :func:`busy_seconds`
    (the wall time the requests were running, on one clock)."""
    if not timings:
        return {}
    out: dict[str, float] = {}
    out |= distribution([t.ttft for t in timings if t.ttft is not None], "ttft_ms")
    out |= distribution([x for t in timings for x in t.itl], "itl_ms")
    out |= distribution([t.tpot for t in timings if t.tpot is not None], "tpot_ms")
    out |= distribution([t.e2e for t in timings], "e2e_ms")
    rates = [t.output_tokens / t.e2e for t in timings if t.e2e > 0]
    if rates:
        out["request_output_tokens_per_s_mean"] = float(np.mean(rates))
    wall = busy_seconds(timings)
    if wall > 0:
        out["output_tokens_per_s"] = sum(t.output_tokens for t in timings) / wall
    out["requests"] = float(len(timings))
    return out


def chosen_draft_lengths(records: list[dict]) -> dict[str, dict]:
    """Per adaptive condition: the D its spec rounds asked (mean, share of rounds per D, and
    mean per category with any round), from the records' ``draft_lens``."""

    def asked(rows: list[dict]) -> SpecStats:
        return SpecStats(rounds_per_draft_len=histogram(d for r in rows
                                                        for d in r.get("draft_lens") or ()))

    out = {}
    for key in sorted({r["condition"] for r in records}):
        if isinstance(condition_parts(key)[1], int):
            continue
        rows = [r for r in records if r["condition"] == key and r["arm"] == "spec"
                and not failed(r)]
        stats = asked(rows)
        if stats.draft_len_share:
            per = {c: asked([r for r in rows if r["category"] == c])
                   for c in sorted({r["category"] for r in rows})}
            out[key] = {"mean": stats.draft_len_mean, "rounds": sum(stats.rounds_per_draft_len),
                        "share": {str(d): s for d, s in stats.draft_len_share.items()},
                        "by_category": {c: st.draft_len_mean for c, st in per.items()
                                        if st.draft_len_share}}
    return out
