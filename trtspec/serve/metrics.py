"""What `trtspec serve` tells about its requests: Prometheus metrics named like vLLM's (so its
dashboards carry over), each response's speculation counters, and one access-log line each.

Every request that ends is counted by its finish reason (``abort`` for a client that left,
``error`` when the model failed), with its speculation counters, on the scheduler's step
thread; latency histograms come from the HTTP side, which sees when tokens were sent.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from trtspec.serve.llmapi import LlmApiScheduler
from trtspec.serve.scheduler import Scheduler
from trtspec.serve.slots import Ticket
from trtspec.spec.counters import SpecStats

BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class ServeMetrics:
    def __init__(self, registry: Any, scheduler: Scheduler | LlmApiScheduler) -> None:
        from prometheus_client import Counter, Gauge, Histogram

        self.finished = Counter("trtspec:request_success", "ended requests by finish reason",
                                ["finish_reason"], registry=registry)
        Gauge("trtspec:num_requests_running", "requests holding a slot",
              registry=registry).set_function(lambda: scheduler.running)
        Gauge("trtspec:num_requests_waiting", "requests queued for a slot",
              registry=registry).set_function(lambda: scheduler.waiting)
        self.ttft = Histogram("trtspec:time_to_first_token_seconds", "TTFT", buckets=BUCKETS,
                              registry=registry)
        self.tpot = Histogram("trtspec:time_per_output_token_seconds",
                              "TPOT: (last token − first token) / (tokens − 1)",
                              buckets=BUCKETS, registry=registry)
        self.e2e = Histogram("trtspec:e2e_request_latency_seconds", "E2E", buckets=BUCKETS,
                             registry=registry)
        self.drafts = Counter("trtspec:spec_decode_num_drafts", "rounds that proposed drafts",
                              registry=registry)
        self.draft_tokens = Counter("trtspec:spec_decode_num_draft_tokens", "drafted tokens",
                                    registry=registry)
        self.accepted = Counter("trtspec:spec_decode_num_accepted_tokens", "accepted drafts",
                                registry=registry)
        self.per_pos = Counter("trtspec:spec_decode_num_accepted_tokens_per_pos",
                               "accepted drafts by position", ["position"], registry=registry)
        d_buckets = tuple(range(0, 17)) + (24, 32, 64)
        self.round_d = Histogram("trtspec:spec_decode_draft_len", "each verification "
                                 "round's D: the most any running request was asked to draft "
                                 "(fixed, scheduled or the adaptive chooser's; 0: plain)",
                                 buckets=d_buckets, registry=registry)
        self.request_d = Histogram("trtspec:spec_decode_request_draft_len_mean",
                                   "each request's mean D over its rounds", buckets=d_buckets,
                                   registry=registry)
        scheduler.on_end = self.ended
        scheduler.on_round = self.round

    def ended(self, ticket: Ticket) -> None:
        """A request left the scheduler (any reason): count it and its speculation."""
        stats = ticket.stats
        self.finished.labels(ticket.reported or ticket.finish_reason or "abort").inc()
        if stats.accepted_draft_tokens and not stats.proposed_tokens:
            return  # proposals unknown (TensorRT-LLM drafted): no acceptance series to skew
        self.drafts.inc(spec_field(stats)["drafts"])
        self.draft_tokens.inc(stats.proposed_tokens)
        self.accepted.inc(stats.accepted_draft_tokens)
        for i, n in enumerate(stats.accepted_per_position):
            self.per_pos.labels(str(i)).inc(n)
        if stats.draft_lens:
            self.request_d.observe(stats.draft_len_mean)

    def round(self, deltas: Sequence[Any]) -> None:
        """A verification round ran (on the step thread): its D, as it happens."""
        if deltas:
            self.round_d.observe(max(d.draft_len for d in deltas))

    def latency(self, first: float | None, last: float | None, tokens: int,
                sent: float) -> None:
        """Times (perf_counter) of a request's first and last token, and how many it sent."""
        if first is None or last is None:
            return
        self.ttft.observe(first - sent)
        self.e2e.observe(last - sent)
        if tokens > 1:
            self.tpot.observe((last - first) / (tokens - 1))


def spec_field(stats: SpecStats) -> dict[str, Any]:
    """The response's ``spec`` extension: this request's counters (the first token, from
    prefill, is in none) and AL = emitted / rounds; ``drafts`` = rounds that proposed."""
    rounds = stats.verification_rounds
    return {"proposed_tokens": stats.proposed_tokens,
            "accepted_draft_tokens": stats.accepted_draft_tokens,
            "emitted_tokens": stats.emitted_tokens, "verification_rounds": rounds,
            "drafts": stats.proposed_per_position[0] if stats.proposed_per_position else 0,
            "al": stats.emitted_tokens / rounds if rounds else None}


def speculative_decoding(steps: Sequence[tuple[int, int]], num_spec_tokens: int,
                         detailed: bool = False) -> dict[str, Any]:
    """A request's ``metrics.speculative_decoding``, in the shape vLLM returns with
    ``--per-request-spec-decode-metrics summary`` (``detailed`` adds the per-step lists).
    ``steps``: (drafted, accepted) for each round that proposed drafts, in order (rounds
    without drafts are left out, so ``num_spec_steps`` is the ``drafts`` counter); the ratios
    are null when there is nothing to divide by."""
    k = max([num_spec_tokens, *(d for d, _ in steps)])
    histogram = [0] * (k + 1)
    by_length: dict[int, list[int]] = {}
    for drafted, accepted in steps:
        histogram[accepted] += 1
        by_length.setdefault(drafted, [0] * (drafted + 1))[accepted] += 1
    accepted = sum(a for _, a in steps)
    drafted = sum(d for d, _ in steps)
    out: dict[str, Any] = {
        "mean_acceptance_length": 1 + accepted / len(steps) if steps else None,
        "draft_acceptance_rate": accepted / drafted if drafted else None,
        "acceptance_histogram": histogram,
        "acceptance_histogram_by_draft_length": {str(d): by_length[d] for d in sorted(by_length)},
        "num_spec_steps": len(steps), "num_accepted_draft_tokens": accepted,
        "num_draft_tokens": drafted, "num_spec_tokens": num_spec_tokens}
    if detailed:
        out["per_step_accepted"] = [a for _, a in steps]
        out["per_step_drafted"] = [d for d, _ in steps]
    return out


class _Stderr(logging.Handler):
    """Writes to whatever ``sys.stderr`` is when a line is logged (not when the server
    started), so a redirected stderr gets the lines too."""

    def emit(self, record: logging.LogRecord) -> None:
        print(self.format(record), file=sys.stderr, flush=True)


LOG = logging.getLogger("trtspec.serve")
if not LOG.handlers:
    LOG.addHandler(_Stderr())
    LOG.setLevel(logging.INFO)
    LOG.propagate = False
QUIET = {"/health", "/metrics"}  # probed and scraped all the time: logged only when they fail


def note(request: Any, **fields: Any) -> None:
    """Record what the access-log line of this request says (prompt, completion, finish)."""
    request.scope.setdefault("state", {}).setdefault("access", {}).update(fields)


class AccessLog:
    """ASGI middleware: one line per request to the ``trtspec.serve`` logger (stderr) when it
    ends (a stream: after its last event), errors included, e.g.
    ``POST /v1/chat/completions 200 prompt=12 completion=8 finish=length D=ngram/D4 0.42s``."""

    def __init__(self, app: Any, d_mode: Callable[[], str]) -> None:
        self.app, self.d_mode = app, d_mode

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start, status = time.perf_counter(), [500]  # an exception that escapes: a 500
        fields = scope.setdefault("state", {}).setdefault("access", {})

        async def sending(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            if scope["path"] not in QUIET or status[0] >= 400:
                finish = fields.get("finish") or (  # a client that left mid-request
                    "abort" if status[0] == 200 and "prompt" in fields else "-")
                LOG.info("%s %s %d prompt=%s completion=%s finish=%s D=%s %.2fs",
                         scope["method"], scope["path"], status[0], fields.get("prompt", "-"),
                         fields.get("completion", "-"), finish, self.d_mode(),
                         time.perf_counter() - start)
