"""What trtspec's two schedulers share: slots, tickets, the waiting queue, the draft
length policy and ending a request.

:class:`~trtspec.serve.scheduler.Scheduler` runs trtspec's executor step by step;
:class:`~trtspec.serve.llmapi.LlmApiScheduler` admits, streams and counts over TensorRT-LLM's
own batch. Both are :class:`Slots`: the HTTP side, the metrics and the eval's clients cannot
tell them apart.

Terms:

* slot          a request's place in the running batch; ``slots`` is ``limits.max_batch_size``
* running       requests holding a slot; ``waiting`` requests queue FIFO, at most
                ``max_waiting`` of them (beyond that, :class:`QueueFull`)
* ticket        a submitted request as its client sees it: tokens arrive in ``on_delta`` (on
                the step thread), ``done`` is set when it has ended
* policy        the draft length D for the next round, from the number of running requests
                (like TensorRT-LLM's ``draft_len_schedule``); D = 0 is plain decoding through
                the same verify(), so a policy never changes the output distribution; D may
                be "adaptive": chosen per round from the running requests' acceptance and
                the round's cost (:mod:`trtspec.spec.adaptive`)
* stop          a stop string the client's text side found, off the step thread
                (:meth:`Slots.stop`): the request ends at its next step with the tokens up to
                it; what came after counts as discarded

One thread owns the models and calls ``step``; other threads talk to it through ``submit``,
:meth:`Slots.cancel` and :meth:`Slots.stop` (thread-safe).
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from trtspec.spec.adaptive import ADAPTIVE
from trtspec.spec.counters import SpecStats
from trtspec.spec.executor import Delta, Request
from trtspec.spec.sample.probs import SamplingParams


class QueueFull(RuntimeError):
    """The waiting queue is at its bound: the caller should refuse the request (HTTP 429)."""


class SchedulerDown(RuntimeError):
    """A step failed: every request was ended with an error and no new one is taken (HTTP
    503 until the process is restarted)."""


@dataclass(frozen=True)
class DraftPolicy:
    """D for the next round from the number of running requests: ``schedule`` is
    ((max_running, D), …) by increasing max_running; above the last entry D = 0. Without a
    schedule every round proposes ``draft_len``. A D of "adaptive" lets the executor's
    AdaptiveDraft choose each round's D."""

    draft_len: int | str = 4
    schedule: tuple[tuple[int, int | str], ...] = ()

    @classmethod
    def parse(cls, text: str) -> DraftPolicy:
        """``"1:4,4:2,8:0"``: up to 1 running request D = 4, up to 4 D = 2, up to 8 D = 0;
        ``"1:adaptive,4:2"``: up to 1 running request an adaptive D."""
        pairs: list[tuple[int, int | str]] = []
        try:
            for item in text.split(","):
                running, _, d = item.partition(":")
                pairs.append((int(running), ADAPTIVE if d.strip() == ADAPTIVE else int(d)))
        except ValueError:
            pairs = []
        if not pairs or any(n < 1 or (d != ADAPTIVE and int(d) < 0) for n, d in pairs):
            raise ValueError(f"draft length schedule {text!r}: write RUNNING:D pairs, e.g. "
                             "1:4,4:2,8:0 (RUNNING ≥ 1, D ≥ 0 or adaptive)")
        keys = [p[0] for p in pairs]
        if keys != sorted(set(keys)):
            raise ValueError(f"draft length schedule {text!r}: give each RUNNING once, in "
                             "increasing order")
        return cls(draft_len=pairs[0][1], schedule=tuple((a, b) for a, b in pairs))

    @property
    def adaptive(self) -> bool:
        """Whether some round may use an adaptive D."""
        return ADAPTIVE in (self.draft_len, *(d for _, d in self.schedule))

    def unreachable(self, slots: int) -> tuple[tuple[int, int | str], ...]:
        """Entries no round can use with ``slots`` slots (past the first that covers them)."""
        first = next((i for i, (limit, _) in enumerate(self.schedule) if limit >= slots), None)
        return () if first is None else self.schedule[first + 1:]

    def describe(self, slots: int, cap: int) -> str:
        """The policy as it will run on ``slots`` slots, e.g. "D = 4 at 1 running, D = 2 at
        2–4, plain decoding at 5–8" (``cap``: an adaptive D's K)."""

        def name(d: int | str) -> str:
            return f"adaptive D ≤ {cap}" if d == ADAPTIVE else "plain decoding" if d == 0 \
                else f"D = {d}"

        if not self.schedule:
            return name(self.draft_len)
        spans: list[list] = []  # [name, low, high], neighbours with one name merged
        low = 1
        for limit, d in (*self.schedule, (slots, 0)):
            high = min(limit, slots)
            if low <= high:
                if spans and spans[-1][0] == name(d):
                    spans[-1][2] = high
                else:
                    spans.append([name(d), low, high])
            low = max(low, limit + 1)
        return ", ".join(f"{n} at {a}{'' if a == b else f'–{b}'}" for n, a, b in spans) + \
            " running"

    def for_running(self, running: int) -> int | str:
        if not self.schedule:
            return self.draft_len
        return next((d for limit, d in self.schedule if running <= limit), 0)


@dataclass(eq=False)
class Ticket:
    """A submitted request: its tokens arrive in ``on_delta``; ``done`` is set at the end."""

    prompt: list[int]
    params: SamplingParams
    # called on the step thread with each delta; it may return how many output tokens to
    # keep (a stop string it found): the request then ends there with "stop"
    on_delta: Callable[[Delta], int | None] | None = None
    request: Request | None = None
    slot: int | None = None
    admitted_at: float | None = None  # perf_counter when it got a slot
    kept: int = 0  # of its prompt's tokens, those its slot kept from the last request
    prefilled: int = 0  # of its prompt's tokens, those its row holds (chunked prefill)
    error: str | None = None  # why it ended with "error", for its client
    on_done: Callable[[], None] | None = None  # called on the step thread after ``done``
    cancelled: bool = False
    end_as: str = "abort"  # the finish reason a cancel ends it with ("error": its client's
    stop_keep: int | None = None  # side failed); a stop string found off the step thread:
    # the tokens its client keeps (``stop``)
    final_sent: bool = False  # its client got a delta with a finish reason
    reported: str | None = None  # the finish reason its client saw, if not the ticket's own
    # (a server ends a request at a stop string by cancelling it: "stop", not "abort")
    done: threading.Event = field(default_factory=threading.Event)

    @property
    def token_ids(self) -> list[int]:
        return self.request.output if self.request else []

    @property
    def finish_reason(self) -> str | None:
        return self.request.finish_reason if self.request else None

    @property
    def stats(self) -> SpecStats:
        return self.request.stats if self.request else SpecStats()


class Slots:
    """What both schedulers share: :class:`~trtspec.serve.scheduler.Scheduler` over
    trtspec's executor and :class:`~trtspec.serve.llmapi.LlmApiScheduler` over TensorRT-LLM's
    batch. ``slots``
    tickets run at once, the rest wait FIFO (at most ``max_waiting``, else QueueFull); the
    ended requests' counters add up in ``totals``; the step loop runs until stopped. Each
    scheduler defines ``step``, ``_free`` (release a slot) and ``_fail`` (a step failed)."""

    def __init__(self, slots: int, max_waiting: int) -> None:
        if slots < 1:
            raise ValueError(f"slots must be ≥ 1, got {slots}")
        self.slots, self.max_waiting = slots, max_waiting
        self._tickets: list[Ticket | None] = [None] * slots
        self._waiting: collections.deque[Ticket] = collections.deque()
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self.totals = SpecStats()  # every ended request's counters (no per-request lists)
        self.on_end: Callable[[Ticket], None] | None = None  # on the step thread (metrics)
        self.on_round: Callable[[list[Delta]], None] | None = None  # after each round, too
        self.error: str | None = None  # set when a step failed: the scheduler is down

    @property
    def running(self) -> int:
        """Requests holding a slot."""
        return sum(t is not None for t in self._tickets)

    @property
    def waiting(self) -> int:
        """Requests queued for a slot."""
        return len(self._waiting)

    def held(self) -> int:
        """Slots taken (LlmApiScheduler's also counts aborts TensorRT-LLM still holds)."""
        return self.running

    def step(self) -> int:
        raise NotImplementedError

    def _free(self, slot: int, reason: str | None) -> None:
        raise NotImplementedError

    def _fail(self, reason: str) -> None:
        raise NotImplementedError

    def _enqueue(self, ticket: Ticket) -> Ticket:
        """Queue a checked ticket (thread-safe): SchedulerDown once a step failed, QueueFull
        past the bound."""
        with self._wake:
            if self.error is not None:  # under the lock: _fail drains the queue under it
                raise SchedulerDown(f"the model failed: {self.error}")
            free = self.slots - self.held()  # those are admitted at the next step
            if len(self._waiting) >= self.max_waiting + free:
                raise QueueFull(f"{len(self._waiting)} requests are waiting for a slot (the "
                                f"bound is {self.max_waiting}): retry later")
            self._waiting.append(ticket)
            self._wake.notify()
        return ticket

    def cancel(self, ticket: Ticket, reason: str = "abort") -> None:
        """Stop a request (thread-safe): the step thread ends it at its next step, with
        ``reason`` ("error": its client's side failed)."""
        if not ticket.cancelled:
            ticket.end_as = reason
        ticket.cancelled = True
        with self._wake:
            self._wake.notify()

    def stop(self, ticket: Ticket, keep: int) -> None:
        """End a request at a stop string its client found off the step thread (thread-safe):
        at its next step it keeps its first ``keep`` tokens and ends with "stop"; what it
        emitted after them (a round may have run meanwhile) counts as discarded."""
        ticket.stop_keep = max(1, keep)
        self.cancel(ticket)

    def _drop_cancelled(self) -> None:
        """End every cancelled request, running (its slot freed) or waiting; one stopped at
        a stop string keeps its tokens up to it and ends with "stop"."""
        for slot, ticket in enumerate(self._tickets):
            if ticket is not None and ticket.cancelled:
                if ticket.stop_keep is not None and ticket.request is not None \
                        and ticket.request.output and ticket.request.finish_reason is None:
                    stop_at(ticket, min(ticket.stop_keep, len(ticket.request.output)))
                    self._free(slot, None)
                else:
                    self._free(slot, ticket.end_as)
        with self._lock:
            dropped = [t for t in self._waiting if t.cancelled]
            for ticket in dropped:
                self._waiting.remove(ticket)
        for ticket in dropped:
            self._end(ticket, ticket.end_as)

    def run_until_idle(self) -> None:
        """Step until nothing runs, waits or holds a slot (tests, offline batches)."""
        while self.step() or self._waiting or self.held():
            pass

    def serve_forever(self, stop: threading.Event) -> None:
        """The step loop: sleeps while there is nothing to do, until ``stop`` is set. A step
        that raises ends every request with "error" and takes the scheduler down (503)."""
        while not stop.is_set():
            try:
                busy = self.step()
            except Exception as e:
                reason = one_line(e)
                logging.getLogger(type(self).__module__).error(
                    "a step failed (%s): every request was ended with an error; new requests "
                    "get 503 until the server is restarted", reason)
                self._fail(reason)
                return
            if not busy:
                with self._wake:
                    if not self._waiting:
                        self._wake.wait(timeout=0.05)

    def _end(self, ticket: Ticket, reason: str | None) -> None:
        """A request leaves: ``reason`` ends one that had not finished (its client is told),
        its counters join ``totals``, ``on_end`` counts it (a failure there is logged:
        metrics must not take the server down), and ``done`` is set."""
        request = ticket.request
        assert request is not None
        if reason is not None and (request.finish_reason is None or not ticket.final_sent):
            if request.finish_reason is None:
                request.stats.close_request()
            request.finish_reason = reason
            notify(ticket, Delta(ticket.slot if ticket.slot is not None else -1, [], reason))
        totals = SpecStats.merge([self.totals, request.stats])
        totals.request_al.clear()  # a server runs for ever: counters only
        self.totals = totals
        if self.on_end is not None:
            try:
                self.on_end(ticket)
            except Exception as e:
                logging.getLogger("trtspec.serve.slots").error(
                    "counting an ended request failed (%s: %s)", type(e).__name__, e)
        ticket.done.set()
        if ticket.on_done is not None:
            try:
                ticket.on_done()
            except Exception as e:  # the client's side is gone (its event loop closed)
                logging.getLogger("trtspec.serve.slots").debug(
                    "telling a client its request ended failed (%s: %s)", type(e).__name__, e)


def one_line(error: BaseException) -> str:
    """``Type: first line of the message``, for logs and clients."""
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0] if text else ''}"


def stop_at(ticket: Ticket, keep: int) -> None:
    """End a request at a stop string its client found: the tokens after it were
    verified but dropped by stop handling (discarded, not emitted), now, not a round
    later."""
    request = ticket.request
    assert request is not None
    stats = request.stats
    extra = max(0, len(request.output) - keep)  # 1 ≤ keep: the first token stays
    del request.output[keep:]
    if request.finish_reason is not None and stats.verification_rounds:
        stats.request_al.pop()  # its AL was fixed before the trim: fixed again below
    stats.emitted_tokens -= extra
    stats.discarded_tokens += extra
    stats.close_request()
    request.finish_reason, ticket.reported, ticket.final_sent = "stop", "stop", True


def notify(ticket: Ticket, delta: Delta) -> int | None:
    """Hand a delta to the request's client (on_delta may return how many tokens to keep:
    a stop string). A client callback that raises ends that request, not the server."""
    if delta.finish_reason is not None:
        ticket.final_sent = True
    if ticket.on_delta is None:
        return None
    try:
        keep = ticket.on_delta(delta)
        if keep is not None and (type(keep) is not int or keep < 1):
            raise ValueError(f"on_delta returned {keep!r}, not a token count ≥ 1")
    except Exception as e:
        logging.getLogger("trtspec.serve.slots").error(
            "a request's client callback failed (%s: %s): the request is ended",
            type(e).__name__, e)
        ticket.cancelled, ticket.reported = True, "error"
        return None
    return None if keep is None else min(keep, len(ticket.token_ids))

