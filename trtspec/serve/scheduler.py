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

Terms (slots, running, waiting, tickets, the policy and stops: :mod:`trtspec.serve.slots`):

* slot          a row of the running batch; ``slots`` is ``limits.max_batch_size``
* budget        ``max_num_tokens``: the most tokens one step feeds the target: the round's
                ``D + 1`` per row first, then prompt chunks. While a prompt waits, the round
                leaves it its chunk (at most half the budget) and has its D cut to fit
                (adaptive too: the chooser chooses within it). Two exceptions: a round feeds
                every row at least one token, and with heads one whole prompt may pass it
* chunk         ``prefill_chunk``: the prompt tokens one step prefills while requests are
                decoding, over all the requests being admitted, first come first served (at
                most a chunk, and a tail below: under 1.5 chunks), counted at the prompt's
                start: further in, each token also attends over the prompt before it, so a
                chunk starting at position p counts 1 + p / ``prefill_context`` a token (the
                target's ``attention_context``, where its attention costs what its
                projections do: about 920 for SmolLM2-135M on the CPU; a target that names
                none, as the transformers and TensorRT-LLM runners, is not priced, nor is
                a paced chunk, learnt from time: "stall"), and a
                step feeds the chunk over that price (rounded down), never under a quarter
                of it (rounded up, and 2): an admission takes at most about 4× the steps,
                and past about 3 × ``prefill_context`` a step's cost grows with the position
                again. Why: on the 2-core CPU a
                16-token chunk in the round's call added 24–32 ms to a 38-ms round at
                position 64 and 58–90 ms at 1,900 (timed directly, two runs), so a fixed
                chunk's gap grew as the prompt came in; over a 2,000-token admission beside
                three streams, 16 tokens a step priced gave a largest gap of 2.1–3.3× their
                median (six runs, one session; TTFT 22 s) against 3.1–4.0× unpriced (12 s)
                and 2.6–3.5× for 7 tokens a step (as many steps, 22 s): for a long prompt no
                better than a fixed chunk of as many steps, but a short prompt keeps nearly
                the whole chunk (reports/bench-serve.md, "Admission: a chunk priced by its
                context")
                [default: 16 on a CPU: on a quiet 2-core CPU (the compiled runner, weights
                prepacked), three streams decoding while a 2,000-token prompt came in, its
                chunk riding in the round's call, before chunks were priced, their largest
                gap was 2.9× their median in each of 3 runs at 16 tokens a step (3.7× in a
                fourth, a one-run table), 2.7–3.2× at 8 and 4.6× at 32 (one run): at the
                ≤ 3× target, not under it; the prompt's TTFT 5.8, 9.6 and 3.9 s (priced:
                above). A step with a 32-token chunk at the
                prompt's end took about 80 ms beside an 18-ms round (timed directly), so the
                chunk trades the streams' gap for the prompt's TTFT (reports/bench-serve.md,
                "Admission with prepacked weights"; "stall" below paces it by time); 512 on
                a GPU, not measured here];
                with none decoding, no stream waits, so prompts take the whole budget. With
                Medusa or EAGLE heads prompts are prefilled whole (their heads read the hidden
                states of the prompt's one scoring call); a draft model takes each chunk
                into its own cache right after the target's (its cost, outside the budget;
                on the compiled runner its cache is checked for the prompt at the first).
                Each call has a fixed cost (16 ms for two tokens on the CPU, the weights
                prepacked; 20 ms for one before), and requests
                that speculation desynchronises are admitted one by one, beside rounds, so
                a prompt's tail shorter than half a chunk joins the chunk before it in the
                same call (a 20-token prompt is one call, not 16 and 4), and what a step has
                left after one prompt's call, under half a chunk, starts no other prompt
                unless it holds that prompt's whole rest (at 4 clients on the CPU, a 5-token
                call, ~30 ms, came after a 27-token prompt's; on a GPU, chunk 512,
                not measured). Beside running streams, a
                prompt that came in over several calls has its first token from its last
                chunk and joins the rounds at the next step (as in vLLM): its first round,
                at its whole context (every row scored with it attends that far), is not
                added to the step that already paid for its last chunk. One prefilled in
                one call (under 1.5 chunks unpaced, a kept prompt's last token, or any
                prompt with no stream running) joins in the same step
* riding        beside running streams, a prompt admitted over several calls has its chunk
                scored in the round's own target call where the target would pair them
                (the compiled runner's ``score_pair`` and ``pairs``: the projections run
                once over both, each group attends over its own span), not in a call of its
                own: one call's fixed cost a step instead of two. Not with a proposer that
                has a model (its cache takes each chunk), heads, a stall (its chunk is
                learnt from the chunk's own call's time; learnt from a riding step's time
                beyond the rounds' average instead, at 1× a round it gave no smaller gap,
                and that average goes stale while every step rides), or while a batch-aware
                chooser's plain round is due a timing that could change its choice
                (``AdaptiveDraft.wants_timing``) and STALE_RIDES steps in a row
                rode while it was (then the prompts wait that step and its round runs
                alone, timed: :meth:`Scheduler._riding` says why); one prompt a step; a
                round that fails with a chunk in it is put back and the step runs as
                without (logged; STRIKES in a row that the same work without the chunk did
                not repeat, and chunks stop riding for good: :meth:`Scheduler._ride_failed`).
                On the 2-core CPU, timed call by call (a 1,900-token prompt, three
                streams, median of 15 calls), a round with a chunk of 2, 4 or 13 tokens in
                it took 1.6, 1.8 and 2.4 rounds against 2.2, 2.0 and 3.8 for two calls; over
                a 2,000-token admission at 4 tokens a step the streams' largest gap was
                2.8–2.9× their median (three runs) against 3.0–3.4× with two calls, at 8
                tokens 3.5–3.9× against 3.9–4.6×, at 16 no different (reports/bench-serve.md,
                "Admission: the chunk in the round's call")
* stall         ``prefill_stall`` (off unless set): while requests decode, the prompt chunk
                of a step aims at taking this many times the step's round (an EMA of the
                rounds' seconds), so the streams' inter-token gap while a prompt comes in
                aims at (1 + stall) rounds. A feedback loop, not a bound: the scheduler's
                first paced step feeds PACED_MIN tokens (at 61ca3aa a first chunk of 32 took
                81 ms beside a 37-ms round on the 2-core CPU, the admission's largest gap), and the
                chunk is learnt from the steps that fed a whole one and did no one-off work
                (cache growth, row swaps): scaled by (stall × round) / its time, at most ×2
                or ÷2 a step, between PACED_MIN (an admission always goes on: where one call
                of that many costs more than the stall, the gap is what it costs, so a stall
                of 1 or less mostly pins the chunk there) and ``prefill_chunk``; later
                admissions start from what was learnt. A short tail does not join a paced
                chunk (that call would pass the stall). On the 2-core CPU a one-row call
                cost 20 ms at 1 token and 130–150 ms at 32 before the weights were prepacked
                (16 ms at 2 and 33–71 ms at 32 after, by the prompt's position, timed
                directly), so a short gap costs the admitted
                prompt's TTFT (reports/bench-serve.md, "Admission")
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
* kept prompt   with ``keep_prompts``, a finished request's row is rolled back to its prompt
                instead of emptied, and a later request with the same prompt in that slot is
                admitted by scoring the prompt's last token only (the rest of the KV cache is
                the one the earlier prefill wrote, as after a rejection's rollback); the
                proposer is told (``release`` with ``keep``, ``admit`` with ``kept``), so a
                draft model's cache and an EAGLE head's keep the prompt too. The exactness
                audit uses it for its long prompt; serve and eval do not

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
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from trtspec.runtime import CacheFull
from trtspec.serve.slots import DraftPolicy, Slots, Ticket, notify, one_line, stop_at
from trtspec.spec.adaptive import ADAPTIVE
from trtspec.spec.executor import Delta, PromptChunk, Request, RoundFailed, SpecExecutor, settle
from trtspec.spec.sample.probs import SamplingParams, make_generator

if TYPE_CHECKING:
    import torch

PREFILL_CHUNK = {"cpu": 16}  # default prompt tokens a step, by device type; else 512
PACED_MIN = 4  # prompt tokens a paced step feeds at least, so an admission always goes on
STALE_RIDES = 2  # steps in a row a chunk rides while the batch-aware chooser wants a timing
PACE_RATE = 0.3  # of the newest round in a paced scheduler's EMA of round seconds
STRIKES = 3  # requests failing in a row (nothing succeeding between) that say the runner is


def default_prefill_chunk(device: object | None) -> int:  # broken, not the requests
    """The default ``prefill_chunk`` on a runner's device (module docstring, "chunk"); a
    runner that names none (TensorRT-LLM's context logits) runs where CUDA is, if anywhere."""
    if device is None:
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    return PREFILL_CHUNK.get(getattr(device, "type", str(device)), 512)


class Scheduler(Slots):
    """Slots over one executor's target (and proposer); see the module docstring."""

    def __init__(self, executor: SpecExecutor, slots: int, policy: DraftPolicy | None = None,
                 max_waiting: int = 256, keep_prompts: bool = False,
                 max_num_tokens: int = 8192, prefill_chunk: int | None = None,
                 prefill_stall: float | None = None) -> None:
        super().__init__(slots, max_waiting)
        if max_num_tokens < 1 or (prefill_chunk is not None and prefill_chunk < 1):
            raise ValueError(f"max_num_tokens ({max_num_tokens}) and prefill_chunk "
                             f"({prefill_chunk}) must be ≥ 1")
        if prefill_stall is not None and not prefill_stall > 0:
            raise ValueError(f"prefill_stall must be > 0, got {prefill_stall}")
        # module docstring, "stall": the chunk a step's time allows, learnt as steps run
        self.prefill_stall, self._paced, self._round_s = prefill_stall, None, None
        self.clock = time.perf_counter
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
        # module docstring, "chunk": what prices a prompt token by its position (None: 1 each)
        context = getattr(executor.target, "attention_context", None)
        self.prefill_context = float(context) \
            if isinstance(context, int | float) and context > 0 else None
        self._strikes = 0  # requests failed in a row (module docstring, "failure")
        self._split = 0  # rounds in a row that failed batched, then ran row by row
        self._timing_rides = 0  # steps in a row a chunk rode while the chooser wanted a timing
        self._timing_hold = False  # this step's prompts wait, so its round is timed alone
        self._pair_failures = 0  # rounds in a row that failed with a chunk riding in them
        self._ended_alone = 0  # requests ended by a failure of their own, so far
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
        paced = chunk is not None and self.prefill_stall is not None
        if paced:  # what the stall allows, from PACED_MIN at first (docstring, "stall")
            chunk = min(chunk, max(PACED_MIN, int((self._paced or PACED_MIN) + 1e-6)))
            one_offs = getattr(self.executor.target, "one_offs", 0)
        # rounds go first, but leave prompts their chunk (D is cut to fit), at most half:
        # priced at the first waiting prompt's position, as _prefill and _riding feed it
        waiting = self._prefilling()
        if chunk and waiting and not paced:
            chunk_now = self._chunk_at(chunk, self._tickets[waiting[0]].prefilled)
        else:
            chunk_now = chunk
        floor = max(1, min(chunk_now, self.max_num_tokens // 2)) if chunk and waiting else 0
        reserved = min(self.max_num_tokens - floor, len(decoding) * (want + 1))
        budget = self.max_num_tokens - reserved
        self._timing_hold = False  # _riding: this step's chunk waits for a timed round
        riding = None if paced else self._riding(decoding, budget, chunk, want,
                                                 draft_len == ADAPTIVE)
        deltas = failed = None
        if riding is not None:  # the prompt's chunk in the round's own call
            ended = self._ended_alone
            try:
                deltas = self._round(decoding, draft_len, max(len(decoding), self.max_num_tokens -
                                                               len(riding.tokens)), riding)
            except RoundFailed as e:  # put back as it was: the step runs as below instead
                failed = e
            else:
                self._pair_failures = 0  # the round returned: its chunk was scored
                self._chunk_in(riding.row, len(riding.tokens), riding.logits)
        if deltas is None:  # nothing rode (or the round it rode in failed): STALE_RIDES
            self._timing_rides = 0  # counts steps in a row that rode
            began = self._now(paced)
            # a plain round due a timing runs alone; the prompts wait this step (_riding)
            used, later = (0, set()) if self._timing_hold else \
                self._prefill(budget, chunk, paced)
            chunk_s = self._now(paced) - began
            # with those whose prompt just completed, but beside running streams a prompt
            # that came in over several calls joins the rounds at the next step (docstring,
            # "chunk")
            live = [b for b in self._decoding() if not decoding or b not in later]
            if live:
                draft_len = self.policy.for_running(len(live))
                began = self._now(paced)
                deltas = self._round(live, draft_len, max(len(live), self.max_num_tokens - used))
                if paced and getattr(self.executor.target, "one_offs", 0) == one_offs:
                    self._pace(chunk, used, chunk_s, self._now(paced) - began)  # (not a step
                    # that grew the cache or swapped rows: its time is no chunk's or round's)
        if failed is not None:  # the pairing is suspect where the same work ran without it
            self._ride_failed(failed, self._ended_alone == ended and  # and ended nobody
                              not is_memory(failed.__cause__))
        if deltas:
            if self.on_round is not None:
                try:
                    self.on_round(deltas)
                except Exception as e:  # metrics must not take the server down
                    logging.getLogger("trtspec.serve.scheduler").error(
                        "counting a round failed (%s: %s)", type(e).__name__, e)
            for delta in deltas:
                self._deliver(delta)
        return self.running

    def _riding(self, decoding: list[int], budget: int, chunk: int | None, want: int,
                adaptive: bool) -> PromptChunk | None:
        """The first admitted prompt's next chunk, to be scored in the round's own call
        (module docstring, "riding"; ``want``: the rounds' D; ``adaptive``: the round's D
        is the chooser's, whose clock it times), or None where the step runs it in a call of
        its own:
        no stream decoding, a target without ``score_pair`` or that would not pair these
        (its ``pairs``), a proposer with a model of its own (its cache takes each chunk),
        heads, a prompt this step prefills in one call (it joins this step's round), STRIKES
        rounds in a row that failed with a chunk riding (:meth:`_ride_failed`), or a
        batch-aware chooser whose plain round is due a timing that could change its choice
        (``AdaptiveDraft.wants_timing``: its clock's baseline stale, and at the round cost's
        prices it would draft or probe) after STALE_RIDES steps in a row rode while it was:
        then the step's prompts wait (``_timing_hold``) and its round runs alone, timed.
        Not called when paced.

        Why a few steps: while the chooser's clock is stale its rounds are plain, and a round
        with a chunk in its call is not timed, so riding keeps the clock stale. Never riding
        then cost a call of its own per admission: in a profiled block of 16 short prompts
        at 8 clients, the batch-aware arm (drafting nothing) rode in none of its admissions'
        steps and made 6 calls more than plain decoding, which rode in 6; the bench had it at
        0.97-0.98× plain at 8 and 16 clients. Riding always would keep the clock stale for as
        long as prompts keep arriving. So a chunk rides up to STALE_RIDES steps in a row
        while the clock is stale (after a step with nothing riding, a prompt of two chunks
        rides whole), and at the next the prompts wait a step, so its round runs alone and
        is timed (one that did one-off work is not, and a batch size new to the clock needs
        RoundClock.FIRST timed rounds). Waiting, not a call of its own for the chunk: at 4
        clients on open-ended prompts (one bench run of 12 blocks, timed by part) the
        speculative arms' chunks in calls of their own took 5.15–5.26 s against plain
        decoding's 4.84 s, 0.6–0.8 % of the step loop's time; with the chunk waiting,
        4.74–4.78 s against 4.75 s, for one step of the prompt's TTFT per timing. A
        chooser that would draft nothing whatever the timing said needs none, so its chunks
        ride as plain decoding's do: at 16 clients on open-ended prompts (the prepacked
        runner, chunks of 16; one profiled run of three blocks of 16 prompts, each arm), the
        arm that stayed plain made 386 target calls against plain's 372, and 371 once it
        asked for timings only where they could change its choice."""
        proposer, target = self.executor.proposer, self.executor.target
        chooser = self.executor.adaptive
        if not decoding or chunk is None or self._heads or self._pair_failures >= STRIKES or \
                getattr(target, "score_pair", None) is None or \
                getattr(proposer, "draft_runner", None) is not None or \
                getattr(proposer, "admit_chunk", None) is not None:
            return None
        waiting = self._prefilling()
        if not waiting:
            return None
        ticket = self._tickets[waiting[0]]
        assert ticket is not None
        todo = len(ticket.prompt) - ticket.prefilled
        chunk = self._chunk_at(chunk, ticket.prefilled)
        n = self._take(todo, min(budget, chunk), chunk, budget, 0, True)
        if n == todo and ticket.prefilled == ticket.kept:
            return None
        if not target.pairs(decoding, waiting[0], want + 1, n):  # two calls there: the
            return None  # step's own (which may feed more prompts)
        timing_due = adaptive and chooser is not None and \
            chooser.wants_timing(self.executor.rows_scored(decoding))
        if timing_due and self._timing_rides >= STALE_RIDES:
            self._timing_hold = True  # the plain round is due a timing: it runs alone and
            return None  # the prompts wait the step (step() starts the count again, as
            # after any step with nothing riding)
        self._timing_rides = self._timing_rides + 1 if timing_due else 0
        start = ticket.prefilled
        return PromptChunk(waiting[0], ticket.prompt[start: start + n], n == todo)

    def _ride_failed(self, error: RoundFailed, suspect: bool) -> None:
        """A round failed with a prompt's chunk riding in it (both put back; the step ran
        them in calls of their own, where a failure is a request's, as any). Said; the
        pairing is ``suspect`` where that same work then ran with no request ending and the
        failure was not memory (which the cache's growth for the prompt can run short of
        whether it rides or not). STRIKES suspect failures in a row and chunks stop riding
        for the scheduler's lifetime, as the compiled runner stops pairing after its graph
        failed: each would cost a step the work of a call that fails."""
        reason = one_line(error.__cause__ or error)
        log = logging.getLogger("trtspec.serve.scheduler")
        if not suspect:
            log.warning("a round with a prompt's chunk riding in it failed (%s); run without "
                        "it, the step failed a request too (or ran short of memory): not "
                        "counted against riding", reason)
            return
        self._pair_failures += 1
        if self._pair_failures >= STRIKES:
            log.warning("%d rounds in a row failed with a prompt's chunk riding in them and "
                        "ran without it (the last: %s); prompt chunks take calls of their "
                        "own from now on", STRIKES, reason)
        else:
            log.warning("a round with a prompt's chunk riding in it failed (%s) and ran "
                        "without it", reason)

    def _price(self, position: int) -> float:
        """What one prompt token at ``position`` counts against a step's chunk (module
        docstring, "chunk"): 1 + position / the target's ``attention_context``, or 1."""
        return 1.0 if self.prefill_context is None else 1.0 + position / self.prefill_context

    @staticmethod
    def least_chunk(chunk: int) -> int:
        """The fewest prompt tokens a priced ``chunk`` feeds a step: a quarter of it, rounded
        up (and 2, the least that rides in a round's call; at most the chunk itself)."""
        return min(chunk, max(2, -(-chunk // 4)))

    def _chunk_at(self, chunk: int, position: int) -> int:
        """The prompt tokens a whole ``chunk`` feeds from ``position`` on (module docstring,
        "chunk"): ``chunk`` over the price of the chunk's first token, rounded down, at least
        ``least_chunk``, so an admission takes at most about 4× the steps."""
        return max(self.least_chunk(chunk), int(chunk / self._price(position) + 1e-9))

    def _take(self, todo: int, left: int, chunk: int | None, budget: int, used: int,
              join_tail: bool) -> int:
        """How many of a prompt's ``todo`` tokens its next call feeds: what is ``left`` of
        the step's chunk, or all of them when the tail after would be under half a chunk
        (``join_tail``) and they fit the ``budget`` (``used`` of it spent)."""
        n = min(todo, left)
        if join_tail and chunk is not None and n > 0 and 0 < todo - n < chunk / 2 and \
                used + todo <= budget:
            n = todo  # a short tail joins this call: one call costs about the same
        return n

    def _now(self, timed: bool) -> float:
        """The clock, after the work queued on a GPU (timing a paced step), else 0."""
        if not timed:
            return 0.0
        settle(self.executor.target)
        return self.clock()

    def _pace(self, chunk: int, used: int, chunk_s: float, round_s: float) -> None:
        """Learn the chunk a step's time allows from one paced step that fed ``used`` prompt
        tokens (``chunk`` allowed) in ``chunk_s`` seconds beside a round of ``round_s``
        (module docstring, "stall"): rounds as an EMA; the chunk (kept as a float, so small
        gains add up), from a step that fed a whole one, scaled by how far its time was off
        what the stall allows, at most ×2 or ÷2 a step (a prompt's last, shorter call would
        teach a call's fixed cost as if it were its tokens')."""
        assert self.prefill_stall is not None
        self._round_s = round_s if self._round_s is None else \
            self._round_s + PACE_RATE * (round_s - self._round_s)
        if used < chunk or chunk_s <= 0:
            return
        scale = min(2.0, max(0.5, self.prefill_stall * self._round_s / chunk_s))
        least = min(PACED_MIN, self.prefill_chunk or PACED_MIN)
        self._paced = max(float(least), min(float(self.prefill_chunk or chunk),
                                            max(self._paced or chunk, chunk) * scale))

    def _fit(self) -> None:
        """Give back the memory of long requests that left (the compiled runner's
        fit_cache), keeping the room reserved for the prompts being admitted; after _admit,
        so a waiting prompt's reservation is not shrunk and grown again. Optional: a failure
        is logged, never fatal."""
        runners = [self.executor.target]
        draft = getattr(self.executor.proposer, "draft_runner", None)
        if draft is not None and draft is not self.executor.target:  # a draft model's own
            runners.append(draft)  # cache: its reservations too
        reserved = max((len(self._tickets[b].prompt) + 1 for b in self._prefilling()),
                       default=0)
        for runner in runners:
            fit = getattr(runner, "fit_cache", None)
            if fit is None:
                continue
            try:
                fit(reserved)
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

    def _round(self, live: list[int], draft_len: int | str, budget: int,
               beside: PromptChunk | None = None) -> list[Delta]:
        """One round for ``live``; a round that failed before committing is run again row by
        row, and a row that fails alone ends its request alone (module docstring). With a
        prompt chunk ``beside`` it in the same call, a failure is raised as it is
        (RoundFailed: the caller runs the step without it)."""
        try:
            deltas = self.executor.round(self._rows, live, draft_len, budget, beside)
        except RoundFailed as e:
            if beside is not None:
                raise
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
        self._ended_alone += 1
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
                try:  # its cache grows once, to the prompt, a few tensors a step while the
                    reserve(len(ticket.prompt) + 1, gradual=True)  # prompt comes in chunks;
                except Exception as e:  # one that cannot fit is refused now, before any work
                    self._row_failed(slot, e)

    def _reset_row(self, slot: int, kept: int) -> None:
        """Drop what ``slot``'s row holds past its first ``kept`` tokens (a kept prompt's)."""
        lengths = self.executor.target.lengths()
        lengths[slot] = kept
        self.executor.target.rollback(lengths)

    def _prefill(self, budget: int, chunk: int | None, paced: bool = False
                 ) -> tuple[int, set[int]]:
        """Feed prompt chunks, first admitted first, at most ``chunk`` in all (its tokens
        priced by their position, unless ``paced``; and a tail under half a chunk unless
        ``paced``, whose chunk is what a step's time allows; module docstring) and
        ``budget`` tokens, one row a call (a call pads
        its rows to the longest); after the first prompt's call, a leftover under half a
        chunk that does not hold the next prompt's whole rest ends the step's prefill
        (first come first served: no later prompt goes first); a prompt whose last chunk
        is in gets its first token. Heads
        prefill whole prompts. Returns the tokens fed and the slots whose prompt completed
        here after earlier calls' chunks (beside running streams, they join the rounds at the
        next step)."""
        whole = self._heads
        # what is left of the chunk, priced (budget - used caps the tokens themselves)
        left: float = min(budget, self.max_num_tokens) if chunk is None else chunk
        used = 0  # prompt tokens fed
        later: set[int] = set()
        take = getattr(self.executor.proposer, "admit_chunk", None)  # a draft model
        for slot in self._prefilling():
            ticket = self._tickets[slot]
            assert ticket is not None and ticket.request is not None
            todo = len(ticket.prompt) - ticket.prefilled
            price, at = 1.0, chunk  # at: the tokens a whole chunk feeds here
            if chunk is not None and not paced:
                price, at = self._price(ticket.prefilled), self._chunk_at(chunk, ticket.prefilled)
            room = min(budget, at) if not used and at is not None else \
                min(budget - used, int(left / price + 1e-9))  # the first prompt: its chunk
            n = todo if whole else self._take(todo, room, at, budget, used, not paced)
            if n <= 0 or (whole and used and n > left):  # heads: one whole prompt past it
                break
            if at is not None and used and n < min(todo, at / 2):  # a call's fixed
                break  # cost for a sliver of a prompt the next step would feed in one call
            feed: list[list[int]] = [[] for _ in range(self.slots)]
            feed[slot] = ticket.prompt[ticket.prefilled: ticket.prefilled + n]
            try:
                logits = self.executor.target.score(feed, last_only=True)[slot, 0]  # [V]
                if take is not None:  # takes the same chunk into its own cache
                    take(slot, ticket.prompt, ticket.prefilled, ticket.prefilled + n)
            except Exception as e:  # this prompt's own call: its request ends alone (its
                self._row_failed(slot, e)  # row is emptied as the slot is freed)
                continue
            several = ticket.prefilled > ticket.kept  # earlier calls fed its first chunks
            left, used = left - n * price, used + n
            if self._chunk_in(slot, n, logits) and several:
                later.add(slot)
        return used, later

    def _chunk_in(self, slot: int, n: int, logits: torch.Tensor | None) -> bool:
        """``n`` more of ``slot``'s prompt are in, ``logits`` [V] after the last of them
        (None: not computed, for a chunk before the last); when that completes the prompt,
        the request gets its first token (or fails alone). Returns whether it completed."""
        ticket = self._tickets[slot]
        assert ticket is not None and ticket.request is not None
        ticket.prefilled += n
        if ticket.prefilled < len(ticket.prompt):
            return False
        assert logits is not None, "the prompt's last chunk is scored with its logits"
        self._rows[slot] = ticket.request
        try:  # the proposer's admission (a kept prompt's, a lookup's index) is this
            # request's too
            if self.executor.proposer is not None:
                self.executor.proposer.admit(slot, ticket.prompt, ticket.kept)
            deltas = self.executor.first_tokens(self._rows, [slot], logits[None])
        except Exception as e:
            self._row_failed(slot, e)  # its row and the proposer's are released
            return True
        for delta in deltas:
            self._deliver(delta)
        return True

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
