"""Load on the serving scheduler, as `vllm bench serve` makes it: closed-loop clients (c
requests in flight, the next sent when one finishes) or open-loop Poisson arrivals at R
requests/s (seeded; ``inf`` sends everything at once). TTFT is measured from when a request
is sent, so it includes queueing for a slot, as a server's client sees it."""

from __future__ import annotations

import contextlib
import math
import random
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from trtspec.runtime.trtllm_stream import LlmArm
from trtspec.serve.llmapi import make_scheduler
from trtspec.serve.slots import Ticket
from trtspec.spec.executor import Delta, SpecExecutor
from trtspec.spec.sample.probs import SamplingParams


def arrival_offsets(n: int, rate: float | None, seed: int) -> list[float] | None:
    """Seconds after the start at which each of n requests is sent: Poisson arrivals at
    ``rate`` requests/s, all at 0 for ``inf``; None for closed-loop clients."""
    if rate is None:
        return None
    if math.isinf(rate):
        return [0.0] * n
    rng, t, out = random.Random(seed), 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


@dataclass
class Sent:
    """One request as its client saw it (perf_counter seconds)."""

    ticket: Ticket
    sent: float
    token_times: list[float] = field(default_factory=list)  # after ``sent``, per token

    @property
    def admitted(self) -> float | None:
        """When it got a slot (perf_counter), as the scheduler recorded it."""
        return self.ticket.admitted_at


def run_clients(executor: SpecExecutor | LlmArm, prompts: Sequence[list[int]],
                params: Sequence[SamplingParams], concurrency: int, slots: int,
                offsets: list[float] | None = None) -> tuple[list[Sent], float]:
    """Every prompt through a scheduler with ``slots`` slots, sent by ``concurrency`` closed-
    loop clients, or at ``offsets`` (open loop). Returns each request's timings, in prompt
    order, and the perf_counter time the load started. ``executor``: trtspec's, or an
    LlmArm (TensorRT-LLM's batch, :mod:`trtspec.serve.llmapi`)."""
    scheduler = make_scheduler(executor, slots, max_waiting=len(prompts))
    todo = deque(range(len(prompts)))
    sent: list[Sent | None] = [None] * len(prompts)
    start = time.perf_counter()

    def send(i: int) -> None:
        # open loop: a request arrives at its offset even if a step delayed its submission
        now = time.perf_counter() if offsets is None else start + offsets[i]
        record: Sent | None = None

        def on_delta(delta: Delta) -> None:
            assert record is not None
            record.token_times += [time.perf_counter() - record.sent] * len(delta.token_ids)

        record = Sent(scheduler.submit(prompts[i], params[i], on_delta), now)
        sent[i] = record

    while todo or scheduler.running or scheduler.waiting:
        if offsets is None:
            in_flight = sum(1 for s in sent if s is not None and not s.ticket.done.is_set())
            while todo and in_flight < concurrency:
                send(todo.popleft())
                in_flight += 1
        else:
            elapsed = time.perf_counter() - start
            while todo and offsets[todo[0]] <= elapsed:
                send(todo.popleft())
            if not scheduler.running and not scheduler.waiting and todo:
                time.sleep(max(0.0, offsets[todo[0]] - elapsed))
                continue
        scheduler.step()
    return [s for s in sent if s is not None], start


def reset_peak_rss() -> None:
    """Start a new peak-RSS window (Linux: writing 5 to clear_refs resets VmHWM)."""
    with contextlib.suppress(OSError):  # not Linux, or not allowed: then a lifetime peak
        Path("/proc/self/clear_refs").write_text("5")


def peak_rss_mb() -> float:
    """The process's peak resident set since :func:`reset_peak_rss` (VmHWM), in MiB; where
    /proc is missing, the lifetime peak from getrusage."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    import resource
    import sys

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 1024  # bytes vs KiB


def cuda_in_use() -> bool:
    import sys

    torch = sys.modules.get("torch")
    return bool(torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized())
