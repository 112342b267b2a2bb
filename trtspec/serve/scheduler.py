"""Continuous batching on the exact executor.

A fixed number of slots (rows of the target's and the draft's batch). Between verification
rounds, waiting requests are admitted into free slots: the prompt is prefilled into that row
alone while the other rows keep their KV cache, and its first token is sampled. A request
leaves its slot when it finishes or is cancelled; nothing is recomputed for the others.

Terms:

* slot          a row of the running batch; ``slots`` is ``limits.max_batch_size``
* running       requests holding a slot; ``waiting`` requests queue FIFO, at most
                ``max_waiting`` of them (beyond that, :class:`QueueFull`)
* kept prompt   with ``keep_prompts``, a finished request's row is rolled back to its prompt
                instead of emptied, and a later request with the same prompt in that slot is
                admitted by scoring the prompt's last token only (the rest of the KV cache is
                the one the earlier prefill wrote, as after a rejection's rollback); the
                proposer is told (``release`` with ``keep``, ``admit`` with ``kept``), so a
                draft model's cache and an EAGLE head's keep the prompt too. The exactness
                audit uses it for its long prompt; serve and eval do not
* policy        the draft length D for the next round, from the number of running requests
                (like TensorRT-LLM's ``draft_len_schedule``); D = 0 is plain decoding through
                the same verify(), so a policy never changes the output distribution; D may
                be "adaptive": chosen per round from the running requests' acceptance and
                the round's cost (:mod:`trtspec.spec.adaptive`)

Exactness under batching: every request owns its generator (seeded from its params) and its
drafts are verified against the target's own p, so each request's output is distributed as the
target's alone, whatever else runs, under any D, schedule or adaptive choice — always. The
*sample* a seed gives is another matter: a round draws a request's uniforms in the same order
whatever else runs (the first token one, each round ``num_draft + 1`` after the draft's own),
so with a fixed D on a runner whose logits do not depend on the batch (the toy runner exactly;
the transformers runner up to float rounding, which can flip a near-tie), a seeded request gets
the tokens it gets alone. Under a schedule
or an adaptive D the rounds it sees depend on the load, and on the compiled runner the GEMM
shapes follow the row range, so logits (and, at near-ties, tokens) can differ in the last bits:
there a seed fixes the sample only for the same load.

One thread owns the models and calls :meth:`Scheduler.step`; other threads talk to it through
:meth:`submit` and :meth:`cancel` (thread-safe) and receive tokens in ``on_delta`` callbacks,
called on the step thread.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from trtspec.runtime import admit_row
from trtspec.spec.adaptive import ADAPTIVE
from trtspec.spec.counters import SpecStats
from trtspec.spec.executor import Delta, Request, SpecExecutor
from trtspec.spec.sample.probs import SamplingParams, make_generator


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
    cancelled: bool = False
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
    """What both schedulers share: this module's over trtspec's executor and
    :class:`~trtspec.serve.llmapi.LlmApiScheduler` over TensorRT-LLM's batch. ``slots``
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

    def cancel(self, ticket: Ticket) -> None:
        """Stop a request (thread-safe): the step thread ends it at its next step."""
        ticket.cancelled = True
        with self._wake:
            self._wake.notify()

    def _drop_cancelled(self) -> None:
        """End every cancelled request, running (its slot freed) or waiting."""
        for slot, ticket in enumerate(self._tickets):
            if ticket is not None and ticket.cancelled:
                self._free(slot, "abort")
        with self._lock:
            dropped = [t for t in self._waiting if t.cancelled]
            for ticket in dropped:
                self._waiting.remove(ticket)
        for ticket in dropped:
            self._end(ticket, "abort")

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
                reason = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e) else ''}"
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
                logging.getLogger("trtspec.serve.scheduler").error(
                    "counting an ended request failed (%s: %s)", type(e).__name__, e)
        ticket.done.set()


class Scheduler(Slots):
    """Slots over one executor's target (and proposer); see the module docstring."""

    def __init__(self, executor: SpecExecutor, slots: int, policy: DraftPolicy | None = None,
                 max_waiting: int = 256, keep_prompts: bool = False) -> None:
        super().__init__(slots, max_waiting)
        self.executor = executor
        # module docstring, "kept prompt": what each row still holds of a finished request
        self.keep_prompts = keep_prompts
        self._kept: list[list[int] | None] = [None] * slots
        self.policy = policy or DraftPolicy(ADAPTIVE if executor.adaptive is not None
                                            else executor.draft_len)
        self._idle = [Request([0], SamplingParams(), frozenset(), make_generator(0),
                              finish_reason="idle") for _ in range(slots)]
        self._rows: list[Request] = list(self._idle)  # what verify sees in each row
        executor.claim_target()  # its hidden states (heads) or none: the runner is shared
        executor.target.prefill([[0]] * slots)  # the rows exist from now on; admission refills
        if executor.proposer is not None:
            executor.proposer.start([[0]] * slots)

    @property
    def speculates(self) -> bool:
        """Whether requests here may get drafts (a proposer; D may still be 0 at a load)."""
        return self.executor.proposer is not None

    @property
    def draft_len(self) -> int:
        """The executor's D (an adaptive one's cap)."""
        return self.executor.draft_len

    def stops(self, params: SamplingParams) -> frozenset[int]:
        return self.executor.stops(params)

    def submit(self, prompt: Sequence[int], params: SamplingParams,
               on_delta: Callable[[Delta], int | None] | None = None) -> Ticket:
        """Queue a request (thread-safe). A bad prompt raises ValueError here, a full queue
        QueueFull: neither takes a slot."""
        ticket = Ticket(list(prompt), params, on_delta)
        ticket.request = self.executor.request(ticket.prompt, params)
        return self._enqueue(ticket)

    def step(self) -> int:
        """Drop cancelled requests, admit waiting ones into free slots, run one round for the
        running ones. Returns how many requests hold a slot afterwards."""
        self._drop_cancelled()
        self._admit()
        live = [b for b, t in enumerate(self._tickets)
                if t is not None and t.request.finish_reason is None and not t.cancelled]
        if live:
            draft_len = self.policy.for_running(len(live))
            deltas = self.executor.round(self._rows, live, draft_len)
            if self.on_round is not None:
                try:
                    self.on_round(deltas)
                except Exception as e:  # metrics must not take the server down
                    logging.getLogger("trtspec.serve.scheduler").error(
                        "counting a round failed (%s: %s)", type(e).__name__, e)
            for delta in deltas:
                self._deliver(delta)
        return self.running

    def _fail(self, reason: str) -> None:
        """A step raised: end every running and waiting request with "error", without calling
        back into the runner or proposer that failed (their state is unknown), and refuse new
        ones (:class:`SchedulerDown`)."""
        with self._lock:
            self.error = reason
            waiting, self._waiting = list(self._waiting), collections.deque()
        running = [t for t in self._tickets if t is not None]
        self._tickets = [None] * self.slots
        for ticket in [*running, *waiting]:  # also those the failed round had finished but
            self._end(ticket, "error")  # not yet told (final_sent is False for them)

    def _admit(self) -> None:
        for slot in range(self.slots):
            if self._tickets[slot] is not None:
                continue
            with self._lock:
                if not self._waiting:
                    return
                ticket = self._waiting.popleft()
            ticket.slot, self._tickets[slot], self._rows[slot] = slot, ticket, ticket.request
            ticket.admitted_at = time.perf_counter()
            kept = self._kept_part(slot, ticket.prompt)
            logits = admit_row(self.executor.target, slot, ticket.prompt, kept)  # [V]
            if self.executor.proposer is not None:
                self.executor.proposer.admit(slot, ticket.prompt, kept)
            for delta in self.executor.first_tokens(self._rows, [slot], logits[None]):
                self._deliver(delta)

    def _kept_part(self, slot: int, prompt: list[int]) -> int:
        """How many of ``prompt``'s tokens ``slot`` still holds (module docstring: all but the
        last, whose logits admission needs, when the slot kept this very prompt; else 0)."""
        kept, self._kept[slot] = self._kept[slot], None
        return len(prompt) - 1 if kept == prompt and len(prompt) >= 2 else 0

    def _deliver(self, delta: Delta) -> None:
        ticket = self._tickets[delta.index]
        assert ticket is not None and ticket.request is not None
        keep = notify(ticket, delta)
        if ticket.cancelled and ticket.reported == "error":  # its client callback failed
            self._free(delta.index, "error")
            return
        if keep is not None:  # a stop string: the client keeps the first ``keep`` tokens
            stop_at(ticket, keep)
        if ticket.request.finish_reason is not None:
            self._free(delta.index, None)

    def _free(self, slot: int, reason: str | None) -> None:
        """Release a slot; ``reason`` ends a request that had not finished (a cancel). The
        request ends even when releasing its row fails (then the step fails after it)."""
        ticket = self._tickets[slot]
        self._tickets[slot], self._rows[slot] = None, self._idle[slot]
        try:
            lengths = self.executor.target.lengths()
            held, lengths[slot] = lengths[slot], 0  # an idle row holds nothing: it costs no
            # attention width in later rounds, unless it keeps its prompt (module docstring)
            if self.keep_prompts and ticket is not None and reason is None and \
                    held >= len(ticket.prompt):
                lengths[slot], self._kept[slot] = len(ticket.prompt), ticket.prompt
            self.executor.target.rollback(lengths)
            if self.executor.proposer is not None:
                self.executor.proposer.release(slot, lengths[slot])
        finally:
            if ticket is not None:
                self._end(ticket, reason)



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
        logging.getLogger("trtspec.serve.scheduler").error(
            "a request's client callback failed (%s: %s): the request is ended",
            type(e).__name__, e)
        ticket.cancelled, ticket.reported = True, "error"
        return None
    return None if keep is None else min(keep, len(ticket.token_ids))

