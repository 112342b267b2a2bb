"""TensorRT-LLM's own batch behind trtspec's server and eval (``backend.mode`` native or
drafter): the scheduler's interface over an :class:`~trtspec.runtime.trtllm.LlmArm`.

:class:`~trtspec.serve.scheduler.Scheduler` runs trtspec's executor round by round; here
TensorRT-LLM schedules, drafts (native) or takes trtspec's drafts (drafter) and verifies, and
trtspec only admits, streams and counts. The HTTP side, the metrics and the eval's clients
cannot tell the two apart: the same ``submit`` / ``cancel`` / ``step`` / ``serve_forever``,
the same tickets, deltas and finish reasons.

Terms:

* slot          a request sent to the LLM (at most ``slots``, the recipe's
                ``limits.max_batch_size``, so TensorRT-LLM's own queue stays empty and a
                waiting request waits here, where ``waiting`` and its bound are seen). A
                request ended here (a stop string, a cancel) keeps its slot until
                TensorRT-LLM says it ended there too
* step          a streamed response of one request (:class:`~trtspec.runtime.trtllm.Step`):
                its first is the first token, each later one an iteration of TensorRT-LLM's
                (a verification round: the drafts it kept, and one more token)
* counters      per request from the steps' token increments (``SpecStats.record_step``):
                rounds, emitted tokens, accepted drafts (a step's tokens less one; a lower
                bound on a last step cut by max_tokens or a stop). The drafts proposed to a
                request are not reported per request by 1.2 (nor, in mode drafter, can the
                drafter's own count be matched to the request reliably: it may run in
                TensorRT-LLM's worker process), so they stay unknown: 0, and
                ``rejected_rounds`` None
* round         what one :meth:`step` handed over (``on_round``): every response since the
                last, so a round here may hold several of TensorRT-LLM's iterations
* step thread   the thread calling :meth:`step` (or :meth:`serve_forever`): every ticket
                callback runs there, as with the Scheduler; the LLM's streams are read on
                threads of their own and queue their steps for it
"""

from __future__ import annotations

import collections
import logging
import queue
import time
from collections.abc import Callable, Sequence

import torch

from trtspec.runtime.trtllm_stream import LlmArm, Step, Stream
from trtspec.serve.scheduler import Scheduler
from trtspec.serve.slots import DraftPolicy, Slots, Ticket, notify, stop_at
from trtspec.spec.executor import Delta, Request, SpecExecutor
from trtspec.spec.sample.probs import SamplingParams

WAIT = 0.05  # seconds a step waits for TensorRT-LLM's next response when none is there
DRAIN_S = 30.0  # seconds an aborted request may keep its slot waiting for TensorRT-LLM


class LlmApiScheduler(Slots):
    """Slots over one :class:`LlmArm` (module docstring)."""

    def __init__(self, arm: LlmArm, slots: int, max_waiting: int = 256,
                 policy: DraftPolicy | None = None) -> None:
        super().__init__(slots, max_waiting)
        self.arm = arm
        self.policy = policy or DraftPolicy(arm.draft_len)
        self._streams: dict[int, Stream] = {}  # slot → its request's stream
        self._draining: dict[Ticket, tuple[int, float]] = {}  # ended here, aborted there:
        # its slot, and when (a slot TensorRT-LLM never lets go of is freed after DRAIN_S)
        self._steps: queue.Queue[tuple[Ticket, Step] | None] = queue.Queue()

    @property
    def speculates(self) -> bool:
        """Whether the arm drafts (native or drafter), as Scheduler.speculates."""
        return self.arm.draft_len > 0

    @property
    def draft_len(self) -> int:
        """The arm's D (its max_draft_len)."""
        return self.arm.draft_len

    def stops(self, params: SamplingParams) -> frozenset[int]:
        """The ids that end a request with these params."""
        return self.arm.stops(params)

    def submit(self, prompt: Sequence[int], params: SamplingParams,
               on_delta: Callable[[Delta], int | None] | None = None) -> Ticket:
        """Queue a request (thread-safe): ValueError for what TensorRT-LLM would refuse
        (LlmArm.check), QueueFull past the bound, SchedulerDown once a step failed."""
        self.arm.check(prompt, params)
        ticket = Ticket(list(prompt), params, on_delta)
        ticket.request = Request(ticket.prompt, params, self.arm.stops(params),
                                 torch.Generator())  # TensorRT-LLM samples: never drawn from
        self._enqueue(ticket)
        self._steps.put(None)  # a step waiting for responses admits it now
        return ticket

    def held(self) -> int:
        """Slots taken: running requests, and aborted ones TensorRT-LLM still holds (so
        run_until_idle also waits for those: they would sit in the next scheduler's batch)."""
        return self.running + len(self._draining)

    def cancel(self, ticket: Ticket, reason: str = "abort") -> None:
        """Stop a request (thread-safe): the next step asks TensorRT-LLM to end it."""
        super().cancel(ticket, reason)
        self._steps.put(None)

    def step(self) -> int:
        """Drop cancelled requests, send waiting ones to the LLM while slots are free, then
        hand over every response that came (waiting up to WAIT for the first). Returns how
        many requests hold a slot afterwards."""
        self._drop_cancelled()
        self._admit()
        if not self.running and not self._draining:
            return 0
        got: list[tuple[Ticket, Step] | None] = []
        try:
            got.append(self._steps.get(timeout=WAIT))
            while True:
                got.append(self._steps.get_nowait())
        except queue.Empty:
            pass
        deltas = []
        for item in got:
            if item is None:  # a wake-up (submit, cancel): admission is next step's
                continue
            ticket, step = item
            if ticket in self._draining and step.finish_reason is not None:
                del self._draining[ticket]  # TensorRT-LLM let go of it: the slot is free
                continue
            delta = self._deliver(ticket, step)
            if delta is not None and delta.draft_len:
                deltas.append(delta)
        now = time.monotonic()
        for ticket, (slot, since) in list(self._draining.items()):
            if now - since > DRAIN_S:
                logging.getLogger("trtspec.serve.llmapi").warning(
                    "TensorRT-LLM did not end an aborted request in %.0f s: its slot %d is "
                    "used again", DRAIN_S, slot)
                del self._draining[ticket]
        if deltas and self.on_round is not None:
            try:
                self.on_round(deltas)
            except Exception as e:  # metrics must not take the server down
                logging.getLogger("trtspec.serve.llmapi").error(
                    "counting a round failed (%s: %s)", type(e).__name__, e)
        return self.running

    def _admit(self) -> None:
        draining = {slot for slot, _ in self._draining.values()}
        for slot in range(self.slots):
            if self._tickets[slot] is not None or slot in draining:
                continue
            with self._lock:
                if not self._waiting:
                    return
                ticket = self._waiting.popleft()
            ticket.slot, self._tickets[slot] = slot, ticket
            ticket.admitted_at = time.perf_counter()
            try:
                self._streams[slot] = self.arm.start(
                    ticket.prompt, ticket.params,
                    lambda step, t=ticket: self._steps.put((t, step)))
            except Exception as e:  # TensorRT-LLM refused this request (its prompt, its
                logging.getLogger("trtspec.serve.llmapi").error(  # params): it alone ends
                    "TensorRT-LLM refused a request (%s: %s): it is ended", type(e).__name__, e)
                self._free(slot, "error")

    def _deliver(self, ticket: Ticket, step: Step) -> Delta | None:
        """One streamed step to its ticket; the delta handed over (None: the ticket had
        ended already, e.g. at a stop string, and this is its stream's tail)."""
        slot = ticket.slot
        if slot is None or self._tickets[slot] is not ticket:
            return None
        request = ticket.request
        assert request is not None
        if step.finish_reason is not None:
            self._streams.pop(slot, None)  # it ended there: nothing to abort
        if step.finish_reason == "error":
            logging.getLogger("trtspec.serve.llmapi").error(
                "a request failed in TensorRT-LLM (%s): it is ended", step.error)
            self._free(slot, "error")
            return None
        first = not request.output
        tokens = list(step.token_ids)
        accepted = 0
        if not first and tokens:
            accepted = len(tokens) - 1
            request.stats.record_step(accepted, len(tokens))
        request.output += tokens
        finish = step.finish_reason
        if finish is not None:
            request.finish_reason = finish
            request.stats.close_request()
        delta = Delta(slot, tokens, finish, 0, accepted,
                      0 if first else self.policy.for_running(self.running)
                      if self.speculates else 0)
        keep = notify(ticket, delta)
        if ticket.cancelled and ticket.reported == "error":  # its client callback failed
            self._free(slot, "error")
            return delta
        if keep is not None:  # a stop string: the request ends here (and in TensorRT-LLM)
            stop_at(ticket, keep)
        if request.finish_reason is not None:
            self._free(slot, None)
        return delta

    def _free(self, slot: int, reason: str | None) -> None:
        """Release a slot, asking TensorRT-LLM to end the request if it still runs there
        (its stream has not said it ended); ``reason`` ends a request that had not finished."""
        ticket = self._tickets[slot]
        self._tickets[slot] = None
        stream = self._streams.pop(slot, None)
        if stream is not None:
            if ticket is not None:  # the slot stays taken until TensorRT-LLM ends it too,
                self._draining[ticket] = (slot, time.monotonic())  # so its batch never
                # holds more than slots
            try:
                stream.abort()
            except Exception as e:  # already finished there: nothing to end
                logging.getLogger("trtspec.serve.llmapi").debug("abort: %s", e)
        if ticket is not None:
            self._end(ticket, reason)

    def _fail(self, reason: str) -> None:
        with self._lock:
            self.error = reason
            waiting, self._waiting = list(self._waiting), collections.deque()
        for slot, ticket in enumerate(self._tickets):
            if ticket is not None:
                self._free(slot, "error")
        for ticket in waiting:
            self._end(ticket, "error")


def make_scheduler(arm: SpecExecutor | LlmArm, slots: int, max_waiting: int = 256,
                   policy: DraftPolicy | None = None, keep_prompts: bool = False,
                   max_num_tokens: int = 8192) -> Scheduler | LlmApiScheduler:
    """The scheduler for what a build's ``arm`` gave: trtspec's over an executor, this
    module's over an LlmArm (``keep_prompts`` and the step budget ``max_num_tokens`` are
    trtspec's alone: TensorRT-LLM keeps prompts by block reuse and takes its budget from the
    options build wrote)."""
    if isinstance(arm, LlmArm):
        return LlmApiScheduler(arm, slots, max_waiting=max_waiting, policy=policy)
    return Scheduler(arm, slots, policy=policy, max_waiting=max_waiting,
                     keep_prompts=keep_prompts, max_num_tokens=max_num_tokens)
