"""Continuous batching on the exact executor.

A fixed number of slots (rows of the target's and the draft's batch). Each step is a token
budget (vLLM v1's scheduler is the model): the running requests' verification round first,
each row ``D + 1`` tokens, then prompt chunks for the requests being admitted, at most
``prefill_chunk`` tokens a step and what is left of ``max_num_tokens``. A long prompt is
thus prefilled over several steps while the running streams keep getting tokens, instead of
freezing them for its whole prefill; its first token is sampled when its last chunk is in
(a chunk emits nothing, so exactness is untouched: the rows' logits are those of one prefill,
up to float rounding of other GEMM shapes). A request leaves its slot when it finishes or is
cancelled; nothing is recomputed for the others.

Terms:

* slot          a row of the running batch; ``slots`` is ``limits.max_batch_size``
* budget        ``max_num_tokens``: the most tokens one step feeds the target: the round's
                ``D + 1`` per row first, then prompt chunks. While a prompt waits, the round
                leaves it its chunk (at most half the budget) and has its D cut to fit
                (adaptive too: the chooser chooses within it). Two exceptions: a round feeds
                every row at least one token, and with heads one whole prompt may pass it
* chunk         ``prefill_chunk``: the most prompt tokens one step prefills while requests
                are decoding, over all the requests being admitted, first come first served
                [default: 16 on a CPU, the smallest measured: a one-row call costs about a
                decode round whatever its width, so a stream's gap is about twice its median
                and its largest 3.9× (7× in the step where the cache grows; reports/
                bench-serve.md, "Admission"); 512 on a GPU, not measured here]; with none
                decoding, no stream waits, so prompts take the whole budget. With Medusa or
                EAGLE heads prompts are prefilled whole (their heads read the hidden states
                of the prompt's one scoring call); a draft model prefills its own copy of the
                prompt whole when the target's last chunk is in (its cost, outside the budget)
* failure       a prompt chunk that raises ends that request alone; a round that raises
                before it committed anything is run again row by row, and a row that fails
                alone ends that request alone (with an EAGLE head, whose state a failed
                round leaves part way, a failed round ends every request as below). The KV
                cache is checked before it grows (at admission, to the prompt; before a
                round proposes, to the round): a prompt that cannot fit is refused, a round
                that cannot fit ends its longest request, each with "error" saying why. A
                runner that cannot continue (every row fails alone, three requests fail with
                none completing and no round running between them, three rounds in a row
                fail batched but not row by row, a failure after a round committed, or
                rolling back fails) ends every request and takes the scheduler down
                (SchedulerDown: 503). "Alone" holds for failures that do not depend on the
                tokens sampled: a row that goes on after a retried round had its drafts
                drawn again, so a failure caused by some draft tokens (or by a request's
                length: memory) would bias what survives it
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
there a seed fixes the sample only for the same load. A round that failed and was run again
row by row (see "failure") drew the drafts' uniforms twice: the rows that go on keep the
target's distribution, not the sample their seeds give alone.

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

from trtspec.runtime import CacheFull
from trtspec.spec.adaptive import ADAPTIVE
from trtspec.spec.counters import SpecStats
from trtspec.spec.executor import Delta, Request, RoundFailed, SpecExecutor
from trtspec.spec.sample.probs import SamplingParams, make_generator

PREFILL_CHUNK = {"cpu": 16}  # default prompt tokens a step, by device type; else 512
STRIKES = 3  # requests failing in a row (nothing succeeding between) that say the runner is


def default_prefill_chunk(device: object | None) -> int:  # broken, not the requests
    """The default ``prefill_chunk`` on a runner's device (module docstring, "chunk"); a
    runner that names none (TensorRT-LLM's context logits) runs where CUDA is, if anywhere."""
    if device is None:
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    return PREFILL_CHUNK.get(getattr(device, "type", str(device)), 512)


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
                logging.getLogger("trtspec.serve.scheduler").error(
                    "counting an ended request failed (%s: %s)", type(e).__name__, e)
        ticket.done.set()
        if ticket.on_done is not None:
            try:
                ticket.on_done()
            except Exception as e:  # the client's side is gone (its event loop closed)
                logging.getLogger("trtspec.serve.scheduler").debug(
                    "telling a client its request ended failed (%s: %s)", type(e).__name__, e)


class Scheduler(Slots):
    """Slots over one executor's target (and proposer); see the module docstring."""

    def __init__(self, executor: SpecExecutor, slots: int, policy: DraftPolicy | None = None,
                 max_waiting: int = 256, keep_prompts: bool = False,
                 max_num_tokens: int = 8192, prefill_chunk: int | None = None) -> None:
        super().__init__(slots, max_waiting)
        if max_num_tokens < 1 or (prefill_chunk is not None and prefill_chunk < 1):
            raise ValueError(f"max_num_tokens ({max_num_tokens}) and prefill_chunk "
                             f"({prefill_chunk}) must be ≥ 1")
        self.executor = executor
        # module docstring, "kept prompt": what each row still holds of a finished request
        self.keep_prompts = keep_prompts
        self._kept: list[list[int] | None] = [None] * slots
        self.policy = policy or DraftPolicy(ADAPTIVE if executor.adaptive is not None
                                            else executor.draft_len)
        self.max_num_tokens = max_num_tokens
        # heads read the hidden states of a prompt's one scoring call: whole prompts there
        self._heads = bool(getattr(executor.proposer, "hidden_layers", None))
        self.prefill_chunk = None if self._heads else \
            prefill_chunk or default_prefill_chunk(getattr(executor.target, "device", None))
        self._strikes = 0  # requests failed in a row (module docstring, "failure")
        self._split = 0  # rounds in a row that failed batched, then ran row by row
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
        """Drop cancelled requests, give free slots to waiting ones, then spend one step's
        token budget: a round for the running requests, prompt chunks for those being
        admitted. Returns how many requests hold a slot afterwards."""
        self._drop_cancelled()
        self._admit()
        self._fit()
        decoding = self._decoding()
        draft_len = self.policy.for_running(len(decoding))
        want = self.executor.draft_len if draft_len == ADAPTIVE else int(draft_len)
        # chunks keep running streams going: with none running, a prompt takes the budget
        chunk = self.prefill_chunk if decoding else None
        # rounds go first, but leave prompts their chunk (D is cut to fit), at most half
        floor = max(1, min(chunk, self.max_num_tokens // 2)) \
            if chunk and self._prefilling() else 0
        reserved = min(self.max_num_tokens - floor, len(decoding) * (want + 1))
        used = self._prefill(self.max_num_tokens - reserved, chunk)
        live = self._decoding()  # with those whose prompt just completed
        if live:
            draft_len = self.policy.for_running(len(live))
            deltas = self._round(live, draft_len, max(len(live), self.max_num_tokens - used))
            if self.on_round is not None and deltas:
                try:
                    self.on_round(deltas)
                except Exception as e:  # metrics must not take the server down
                    logging.getLogger("trtspec.serve.scheduler").error(
                        "counting a round failed (%s: %s)", type(e).__name__, e)
            for delta in deltas:
                self._deliver(delta)
        return self.running

    def _fit(self) -> None:
        """Give back the memory of long requests that left (the compiled runner's
        fit_cache), keeping the room reserved for the prompts being admitted; after _admit,
        so a waiting prompt's reservation is not shrunk and grown again. Optional: a failure
        is logged, never fatal."""
        fit = getattr(self.executor.target, "fit_cache", None)
        if fit is None:
            return
        try:
            fit(max((len(self._tickets[b].prompt) + 1 for b in self._prefilling()),
                    default=0))
        except Exception as e:
            logging.getLogger("trtspec.serve.scheduler").warning(
                "shrinking the KV cache failed (%s): it keeps its size", one_line(e))

    def _decoding(self) -> list[int]:
        """Slots whose request has its prompt in and runs rounds."""
        return [b for b, t in enumerate(self._tickets) if t is not None and not t.cancelled
                and self._rows[b] is t.request and t.request.finish_reason is None]

    def _prefilling(self) -> list[int]:
        """Slots whose request is still being prefilled, first admitted first."""
        rows = [b for b, t in enumerate(self._tickets) if t is not None and not t.cancelled
                and self._rows[b] is not t.request]
        return sorted(rows, key=lambda b: self._tickets[b].admitted_at or 0.0)

    def _round(self, live: list[int], draft_len: int | str, budget: int) -> list[Delta]:
        """One round for ``live``; a round that failed before committing is run again row by
        row, and a row that fails alone ends its request alone (module docstring)."""
        try:
            deltas = self.executor.round(self._rows, live, draft_len, budget)
        except RoundFailed as e:
            if len(live) == 1:
                self._row_failed(live[0], e)
                return []
            if is_memory(e.__cause__):  # the cache cannot grow for the longest
                lengths = self.executor.target.lengths()  # row: it ends, the rest go on
                longest = max(live, key=lambda b: lengths[b])  # (alone, a row fed fewer
                self._row_failed(longest, e)  # tokens might still fit, until it did not)
                return self._round([b for b in live if b != longest], draft_len, budget)
            deltas, failed = [], []
            for b in live:
                try:
                    deltas += self.executor.round(self._rows, [b], draft_len, budget)
                except RoundFailed as alone:
                    failed.append((b, alone))
            if len(failed) == len(live):  # no row runs alone: the runner cannot go on
                raise e.__cause__ or e from None
            self._strikes = 0  # some rows ran: the runner works
            if not failed:  # the batch failed, every row alone did not: the runner is not
                self._split += 1  # to be trusted for long
                logging.getLogger("trtspec.serve.scheduler").warning(
                    "a round of %d rows failed (%s) and every row then ran alone", len(live),
                    one_line(e.__cause__ or e))
                if self._split >= STRIKES:
                    raise RuntimeError(f"{STRIKES} rounds in a row failed batched and ran row "
                                       f"by row (the last: {one_line(e.__cause__ or e)})"
                                       ) from None
            for b, alone in failed:
                self._row_failed(b, alone)
        else:
            self._split = 0
        if deltas:
            self._strikes = 0  # only a round that ran clears the strikes
        return deltas

    def _row_failed(self, slot: int, error: Exception) -> None:
        """End ``slot``'s request with "error" (its row is where it was before the failed
        call) and say why; three such failures in a row mean the runner is broken."""
        ticket = self._tickets[slot]
        cause = error.__cause__ if isinstance(error, RoundFailed) and error.__cause__ else error
        reason = one_line(cause)
        logging.getLogger("trtspec.serve.scheduler").error(
            "a request failed and was ended alone (%s); the others go on", reason)
        if ticket is not None:
            ticket.error = str(cause) if isinstance(cause, CacheFull) else reason
        self._free(slot, "error")
        if not is_memory(cause):  # a request too big for memory is not a fault
            self._strikes += 1  # (cleared by a round that runs)
            if self._strikes >= STRIKES:
                raise RuntimeError(f"{STRIKES} requests in a row failed (the last: {reason})")

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
        """Give free slots to waiting requests, first come first served: each row is rolled
        back to what it keeps of the prompt (a kept prompt) and prefilled by later steps."""
        for slot in range(self.slots):
            if self._tickets[slot] is not None:
                continue
            with self._lock:
                if not self._waiting:
                    return
                ticket = self._waiting.popleft()
            ticket.slot, self._tickets[slot] = slot, ticket
            ticket.admitted_at = time.perf_counter()
            ticket.kept = ticket.prefilled = self._kept_part(slot, ticket.prompt)
            self._reset_row(slot, ticket.kept)
            reserve = getattr(self.executor.target, "reserve", None)  # the compiled runner
            if reserve is not None:
                try:  # its cache grows once, to the prompt, and a prompt that cannot fit
                    reserve(len(ticket.prompt) + 1)  # is refused now, before any work
                except Exception as e:
                    self._row_failed(slot, e)

    def _reset_row(self, slot: int, kept: int) -> None:
        """Drop what ``slot``'s row holds past its first ``kept`` tokens (a kept prompt's)."""
        lengths = self.executor.target.lengths()
        lengths[slot] = kept
        self.executor.target.rollback(lengths)

    def _prefill(self, budget: int, chunk: int | None) -> int:
        """Feed prompt chunks, first admitted first, at most ``chunk`` tokens in all and
        ``budget``, one row a call (a call pads its rows to the longest); a prompt whose last
        chunk is in gets its first token. Heads prefill whole prompts. Returns the tokens
        fed."""
        whole = self._heads
        left, used = min(budget, self.max_num_tokens if chunk is None else chunk), 0
        for slot in self._prefilling():
            ticket = self._tickets[slot]
            assert ticket is not None and ticket.request is not None
            todo = len(ticket.prompt) - ticket.prefilled
            n = todo if whole else min(todo, left)
            if n <= 0 or (whole and used and n > left):  # heads: one whole prompt past it
                break
            feed: list[list[int]] = [[] for _ in range(self.slots)]
            feed[slot] = ticket.prompt[ticket.prefilled: ticket.prefilled + n]
            try:
                logits = self.executor.target.score(feed, last_only=True)[slot, 0]  # [V]
            except Exception as e:  # this prompt's own call: its request ends alone
                lengths = self.executor.target.lengths()
                lengths[slot] = min(lengths[slot], ticket.prefilled)
                self.executor.target.rollback(lengths)
                self._row_failed(slot, e)
                continue
            ticket.prefilled += n
            left, used = left - n, used + n
            if ticket.prefilled < len(ticket.prompt):
                continue
            self._rows[slot] = ticket.request
            try:  # the proposer's own prefill (a draft model's, whole) is this request's too
                if self.executor.proposer is not None:
                    self.executor.proposer.admit(slot, ticket.prompt, ticket.kept)
                deltas = self.executor.first_tokens(self._rows, [slot], logits[None])
            except Exception as e:
                self._row_failed(slot, e)  # its row and the proposer's are released
                continue
            for delta in deltas:
                self._deliver(delta)
        return used

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
            self._strikes = 0  # a request completed: the runner works
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


def is_memory(error: BaseException | None) -> bool:
    """Whether ``error`` is memory running short (CacheFull, MemoryError, torch's out of
    memory): a request too big for what is free, not a broken runner."""
    import torch

    return isinstance(error, (MemoryError, torch.OutOfMemoryError))


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
        logging.getLogger("trtspec.serve.scheduler").error(
            "a request's client callback failed (%s: %s): the request is ended",
            type(e).__name__, e)
        ticket.cancelled, ticket.reported = True, "error"
        return None
    return None if keep is None else min(keep, len(ticket.token_ids))

