"""`trtspec serve`'s Prometheus metrics, named like vLLM's so its dashboards carry over.

Every request that ends is counted by its finish reason (``abort`` for a client that left,
``error`` when the model failed), with its speculation counters, on the scheduler's step
thread; latency histograms come from the HTTP side, which sees when tokens were sent.
"""

from __future__ import annotations

from typing import Any

from trtspec.metrics import SpecStats
from trtspec.scheduler import Scheduler, Ticket

BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class ServeMetrics:
    def __init__(self, registry: Any, scheduler: Scheduler) -> None:
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
        scheduler.on_end = self.ended

    def ended(self, ticket: Ticket) -> None:
        """A request left the scheduler (any reason): count it and its speculation."""
        stats = ticket.stats
        self.finished.labels(ticket.reported or ticket.finish_reason or "abort").inc()
        self.drafts.inc(spec_field(stats)["drafts"])
        self.draft_tokens.inc(stats.proposed_tokens)
        self.accepted.inc(stats.accepted_draft_tokens)
        for i, n in enumerate(stats.accepted_per_position):
            self.per_pos.labels(str(i)).inc(n)

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
