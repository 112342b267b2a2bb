"""SpecExecutor: propose → score → verify → commit / roll back, for a batch of requests.

One round for request b, whose last emitted token x₀ the target has not seen yet::

    drafts  d₁..d_D  ~ q             proposer.propose (D = draft_len, clipped to the budget)
    logits  p₁..p_{D+1}              target.score([x₀, d₁..d_D])   — one call, D+1 positions
    tokens  d₁..d_a, y               verify(): a accepted, y recovered (a < D) or bonus (a = D)
    commit  stop handling            EOS / stop token / max_tokens inside the run truncates it
    rollback target to prompt + output − y;  proposer.observe(a)

The first output token is sampled from the prefill logits (it sets TTFT) and is in no counter.
With no proposer, each round is a plain decoding step through the same verify() with D = 0:
the baseline shares every line of sampling code with the speculative path.

With an :class:`~trtspec.spec.adaptive.AdaptiveDraft` (``draft_len`` "adaptive"), each request's D
for each round comes from the acceptance estimates and the cost of the round (at most the
executor's ``draft_len``, K); verification is unchanged, so the output distribution is too.
With a :class:`~trtspec.spec.round_cost.RoundCost`, a round with drafts is scored at the width
it says is cheapest (one row's feed lengthened by repeats of its last token; the runner pads
every row to the widest anyway): positions after a row's own tokens change none of its logits
in exact arithmetic (in floating point, as any other batch shape, up to rounding), and what
they wrote is rolled back with the rejections.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import torch

from trtspec.runtime import Runner
from trtspec.spec.adaptive import ADAPTIVE, AdaptiveDraft, AdaptiveState
from trtspec.spec.counters import SpecStats
from trtspec.spec.propose.proposer import Draft, Proposer
from trtspec.spec.round_cost import RoundCost
from trtspec.spec.sample.probs import SamplingParams, make_generator, rows_to_probs
from trtspec.spec.sample.verify import VerifyOutput, verify


def settle(runner: Runner) -> None:
    """Wait for the work queued on the runner's GPU, if it has one (timing: a CUDA call
    returns before its kernels finish)."""
    device = getattr(runner, "device", None)
    if getattr(device, "type", None) == "cuda":
        torch.cuda.synchronize(device)


class RoundFailed(Exception):
    """A round raised before it committed anything (while proposing, scoring or verifying):
    the target, the proposer and the chooser's probe bookkeeping were put back where the round
    found them, so the batch can go on without the rows that made it fail. ``__cause__`` is
    what was raised."""


@dataclass
class Delta:
    """Tokens a request gained in one step (prefill or round), as a stream would send them."""

    index: int
    token_ids: list[int]
    finish_reason: str | None  # None while running, then "stop" or "length"
    num_draft: int = 0  # drafts proposed in this round (0 after prefill)
    num_accepted: int = 0  # of which the target accepted
    draft_len: int = 0  # the D asked of the proposer for this request in this round


@dataclass
class PromptChunk:
    """Tokens of a prompt being admitted in ``row``, scored in a round's own target call (the
    compiled runner's ``score_pair``: one call reads the weights once for both; a chunk
    emits nothing, so the round's sampling is untouched; a round that returns scored it, one
    that failed rolled it back). ``last``: the chunk completes its prompt, so the logits
    after it are wanted (the first token is sampled from them; the head is not run for a
    chunk before it); ``logits`` [V], after its last token, then: None until scored, and
    for a chunk before the last."""

    row: int
    tokens: list[int]
    last: bool = True
    logits: torch.Tensor | None = None


@dataclass
class Completion:
    prompt_token_ids: list[int]
    token_ids: list[int]
    finish_reason: str
    stats: SpecStats


@dataclass
class Request:
    """One request's state in an executor or a scheduler slot."""

    prompt: list[int]
    params: SamplingParams
    stops: frozenset[int]
    generator: torch.Generator
    output: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stats: SpecStats = field(default_factory=SpecStats)
    adaptive: AdaptiveState | None = None  # its acceptance estimates, under an adaptive D

    @property
    def remaining(self) -> int:
        return self.params.max_tokens - len(self.output)

    def commit(self, tokens: list[int]) -> list[int]:
        """Append tokens up to the first stop token or the budget; return what was kept."""
        kept = tokens[: self.remaining]
        for i, tok in enumerate(kept):
            if tok in self.stops:
                kept, self.finish_reason = kept[: i + 1], "stop"
                break
        else:
            if len(kept) == self.remaining:
                self.finish_reason = "length"
        self.output.extend(kept)
        return kept


class SpecExecutor:
    """Runs exact speculative sampling (or, without a proposer, plain decoding) on a Runner.

    ``clip_draft`` (default) never proposes more drafts than the remaining budget can emit
    (D ≤ remaining − 1). With ``clip_draft=False`` every round proposes D, as vLLM and
    TensorRT-LLM do; what lands past max_tokens is counted in ``discarded_tokens``.

    With ``adaptive``, rounds choose D (see :mod:`trtspec.spec.adaptive`), at most ``draft_len``; a
    round given a fixed ``draft_len`` drafts that instead. ``round_cost`` [default: the
    chooser's] says at what width a round with drafts is scored.
    """

    def __init__(self, target: Runner, proposer: Proposer | None = None, draft_len: int = 4,
                 clip_draft: bool = True, adaptive: AdaptiveDraft | None = None,
                 eos_token_ids: Iterable[int] | None = None,
                 round_cost: RoundCost | None = None) -> None:
        if draft_len < 0:
            raise ValueError(f"draft_len must be ≥ 0, got {draft_len}")
        self.target, self.proposer, self.clip_draft = target, proposer, clip_draft
        # every id that ends a request unless it ignores EOS [default: the target's one EOS]
        eos = target.eos_token_id
        self.eos_token_ids = frozenset(eos_token_ids if eos_token_ids is not None else
                                       () if eos is None else (eos,))
        self.draft_len = draft_len if proposer is not None else 0
        self.adaptive = adaptive if proposer is not None else None
        self.round_cost = round_cost or (adaptive.round_cost if adaptive is not None else None)

    def generate(self, prompts: Sequence[Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams] | None = None,
                 on_step: Callable[[list[Delta]], None] | None = None) -> list[Completion]:
        """Run the batch to completion; ``on_step`` sees the new tokens after every step."""
        reqs = self._requests(prompts, params)
        for deltas in self._run(reqs):
            if on_step is not None:
                on_step(deltas)
        return [Completion(r.prompt, r.output, r.finish_reason or "length", r.stats) for r in reqs]

    def stream(self, prompts: Sequence[Sequence[int]],
               params: SamplingParams | Sequence[SamplingParams] | None = None
               ) -> Iterator[list[Delta]]:
        """Yield the batch's new tokens after prefill and after every round."""
        yield from self._run(self._requests(prompts, params))

    def _requests(self, prompts: Sequence[Sequence[int]],
                  params: SamplingParams | Sequence[SamplingParams] | None) -> list[Request]:
        params = SamplingParams() if params is None else params
        plist = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(plist) != len(prompts):
            raise ValueError(f"{len(plist)} SamplingParams for {len(prompts)} prompts")
        return [self.request(prompt, p, i)
                for i, (prompt, p) in enumerate(zip(prompts, plist, strict=True))]

    def request(self, prompt: Sequence[int], params: SamplingParams, i: int = 0) -> Request:
        """A checked request with its own generator (seeded from params.seed)."""
        vocab = self.target.vocab_size
        if not prompt:
            raise ValueError(f"prompt {i} is empty: give at least one token")
        if min(prompt) < 0 or max(prompt) >= vocab:
            raise ValueError(f"prompt {i} has token ids outside 0..{vocab - 1}")
        return Request(list(prompt), params, self.stops(params), make_generator(params.seed))

    def stops(self, params: SamplingParams) -> frozenset[int]:
        """The token ids that end a request with these params: its stop_token_ids and,
        unless it ignores EOS, every EOS id."""
        ids = frozenset(params.stop_token_ids)
        return ids if params.ignore_eos else ids | self.eos_token_ids

    def claim_target(self) -> None:
        """Before a batch starts on the target Runner (which other executors, e.g. the
        baseline arm, share): keep the hidden states this proposer reads (heads), or none, so
        no other arm pays for them."""
        keep = getattr(self.target, "capture_hidden", None)
        if keep is not None:
            keep(list(getattr(self.proposer, "hidden_layers", [])))

    def _run(self, reqs: list[Request]) -> Iterator[list[Delta]]:
        if not reqs:
            return
        self.claim_target()
        logits = self.target.prefill([r.prompt for r in reqs])  # [B, V]
        if self.proposer is not None:
            self.proposer.start([r.prompt for r in reqs])
        yield self.first_tokens(reqs, list(range(len(reqs))), logits)
        while True:
            live = [i for i, r in enumerate(reqs) if r.finish_reason is None]
            if not live:
                return
            try:
                deltas = self.round(reqs, live)
            except RoundFailed as e:  # offline, nothing runs on without the failed rows:
                raise (e.__cause__ or e) from None  # what failed, as it was raised
            yield deltas

    def first_tokens(self, reqs: list[Request], rows: list[int], logits: torch.Tensor
                     ) -> list[Delta]:
        """Each row's first output token from its prompt's logits [len(rows), V]: a round with
        D = 0, so it draws one uniform from the request's generator, alone or in any batch."""
        chosen = [reqs[b] for b in rows]
        params = [r.params for r in chosen]
        first = verify(rows_to_probs(logits, params)[:, None],  # [n, 1, V]
                       torch.empty((len(rows), 0), dtype=torch.long), None,
                       torch.zeros(len(rows), dtype=torch.long),
                       [r.generator for r in chosen], torch.tensor([p.greedy for p in params]))
        first_ids = first.token_ids[:, 0].tolist()  # one host copy, not one sync per row
        return [Delta(b, r.commit([first_ids[i]]), r.finish_reason)
                for i, (b, r) in enumerate(zip(rows, chosen, strict=True))]

    def round(self, reqs: list[Request], live: list[int], draft_len: int | str | None = None,
              max_tokens: int | None = None, beside: PromptChunk | None = None
              ) -> list[Delta]:
        """One verification round for the rows ``live`` of a batch (other rows are left alone),
        proposing ``draft_len`` tokens each [default: the executor's: adaptive when it has a
        chooser], clipped to the budget; "adaptive": each row's own D (needs a chooser).
        ``max_tokens`` bounds the tokens the round feeds the target (a step's token budget):
        each row's D is cut to ``max_tokens // len(live) − 1`` when the D asked would pass it.
        ``beside``: a prompt chunk the target scores in the round's own call (its
        ``score_pair``; the caller checks it has one): scored when the round returns (its
        logits filled in where it is its prompt's last chunk), and a failed round rolls it
        back with the rest.

        A failure before anything is committed raises :class:`RoundFailed` with the target
        rolled back, the proposer's drafts undone and the chooser's probe bookkeeping put
        back (not the requests' generators: a failure after their draws, a draft model's or
        verification's, leaves them advanced, so a round run again is still exact but not
        the sample the seed gives alone); one after (committing, observing) is raised as it
        is: the batch's state is then unknown."""
        chooser = self.adaptive if draft_len in (None, ADAPTIVE) else None
        if draft_len == ADAPTIVE and chooser is None and self.proposer is not None:
            raise ValueError("draft_len adaptive needs an executor built with an AdaptiveDraft")
        if not live:
            return []
        batch = len(reqs)
        want = self.draft_len if draft_len in (None, ADAPTIVE) else int(draft_len)
        if self.proposer is None:
            want, chooser = 0, None
        draft_len = [0] * batch
        for i in live:
            draft_len[i] = max(0, min(want, reqs[i].remaining - 1) if self.clip_draft else want)
        if max_tokens is not None and sum(draft_len[i] + 1 for i in live) > max_tokens:
            cap = max(0, max_tokens // len(live) - 1)  # the chooser sees the same bound
            for i in live:
                draft_len[i] = min(draft_len[i], cap)
        before = self.target.lengths()
        rows = self.rows_scored(live)
        reserve = getattr(self.target, "reserve", None)  # the compiled runner: its cache
        if reserve is not None:  # grows (or says it cannot) before anything is proposed
            widest = max(draft_len[i] for i in live) + 1
            if self.round_cost is not None and widest > 1:
                widest = max(widest, self.round_cost.width(rows, widest))
            scored = live if rows == len(live) else range(live[0], live[-1] + 1)  # packed, or
            try:  # the rows between the live ones take part in the call too
                reserve(max(before[b] for b in scored) + widest)
            except MemoryError as e:
                raise RoundFailed(f"{type(e).__name__}: {e}") from e
        mark = None
        if chooser is not None:  # every live request's state exists before the mark, so a
            for i in live:  # failed round leaves none half-used (a new one's probe flag)
                if reqs[i].adaptive is None:
                    reqs[i].adaptive = chooser.start()
            mark = chooser.mark([reqs[i].adaptive for i in live])
        clock = chooser is not None and chooser.clock is not None
        if clock:  # what this round costs, and nothing queued before it (a GPU runs ahead)
            settle(self.target)
            one_offs, began = self._one_offs(), time.perf_counter()
        try:
            n_draft, out = self._score_and_verify(reqs, live, draft_len, chooser, rows, beside)
        except Exception as e:
            self.target.rollback(before)  # scoring appends only: this always rolls back
            if mark is not None:  # the chooser's probe bookkeeping too (its run again
                chooser.back_to(mark)  # chooses anew)
            if beside is not None:  # (the chunk too)
                beside.logits = None
            if self.proposer is not None:
                self.proposer.undo()  # RuntimeError where it cannot: the batch ends
            raise RoundFailed(f"{type(e).__name__}: {e}") from e
        deltas, accepted, lengths = [], [0] * batch, self.target.lengths()
        emitted, num_accepted = out.token_ids.tolist(), out.num_accepted.tolist()  # to host once
        for row, b in enumerate(live):
            r, a = reqs[b], num_accepted[row]
            if chooser is not None and r.adaptive is not None:
                chooser.update(r.adaptive, n_draft[b], a, draft_len[b])
            kept = r.commit(emitted[row][: a + 1])
            r.stats.record_round(n_draft[b], a, len(kept), draft_len[b])
            if r.finish_reason is None:
                lengths[b] = len(r.prompt) + len(r.output) - 1  # all but the new last token
            else:
                r.stats.close_request()
            accepted[b] = a
            deltas.append(Delta(b, kept, r.finish_reason, n_draft[b], a, draft_len[b]))
        self.target.rollback(lengths)
        if self.proposer is not None:
            self.proposer.observe(accepted)
        if clock:  # what this round took, for the next ones' choice: not a round that did
            settle(self.target)  # one-off work (grew the cache, swapped rows, compiled);
            k = max(n_draft[b] for b in live)  # one asked to draft that got nothing is
            if self._one_offs() == one_offs and beside is None:  # width 0 (its lookups are
                # no plain round's); a call that also took a prompt's chunk is no round's
                width = k + 1 if k or not any(draft_len[b] for b in live) else 0
                chooser.observe_round(getattr(self.target, "last_scored", rows), width,
                                      time.perf_counter() - began)  # B: the rows scored
        return deltas

    def _one_offs(self) -> int:
        """One-off work the target's and the draft's runners have done so far (grown caches,
        swapped rows, late compiles: the compiled runner counts them)."""
        runners = (self.target, getattr(self.proposer, "draft_runner", None))
        return sum(getattr(r, "one_offs", 0) for r in runners if r is not None)

    def rows_scored(self, live: Sequence[int]) -> int:
        """The rows the target scores in a call that feeds the batch rows ``live``: the
        contiguous range they span, or only them where the runner packs live rows (the
        compiled runner's ``scored_rows``)."""
        count = getattr(self.target, "scored_rows", None)
        return count(live) if count is not None else live[-1] - live[0] + 1

    def _score_and_verify(self, reqs: list[Request], live: list[int], draft_len: list[int],
                          chooser: AdaptiveDraft | None, span: int,
                          beside: PromptChunk | None = None) -> tuple[list[int], VerifyOutput]:
        """A round up to its verdict, with nothing committed: D chosen (adaptive), drafts
        proposed, the target's p scored, verify() run; ``span``: the rows the target scores
        (B, :meth:`rows_scored`). Returns the drafts each row got and verify's result."""
        batch = len(reqs)
        if chooser is not None:  # choose within the budget (a probe that could draft
            # nothing would teach nothing); each live request has its state (round)
            chosen = chooser.choose_round([reqs[i].adaptive for i in live],
                                          [draft_len[i] for i in live], span)
            for i, d in zip(live, chosen, strict=True):
                draft_len[i] = d
        draft = Draft.empty(batch)
        if self.proposer is not None and any(draft_len):
            draft = self.proposer.propose([r.prompt + r.output for r in reqs], draft_len,
                                          [r.params for r in reqs], [r.generator for r in reqs])
        n_draft = draft.num_draft.tolist()
        feed: list[list[int]] = [[] for _ in range(batch)]
        for b in live:
            feed[b] = [reqs[b].output[-1], *draft.token_ids[b, : n_draft[b]].tolist()]
        k = max(n_draft[b] for b in live)  # the round's widest draft
        if k and self.round_cost is not None:  # a wider call BLAS runs faster (the runner
            longest = feed[max(live, key=lambda b: n_draft[b])]  # pads every row to it)
            longest += longest[-1:] * (self.round_cost.width(span, k + 1) - k - 1)
        if beside is None:
            logits = self.target.score(feed)[:, : k + 1]  # [B, k + 1, V]
        else:
            logits, last = self.target.score_pair(  # type: ignore[attr-defined]
                feed, beside.row, beside.tokens, beside.last)
            logits, beside.logits = logits[:, : k + 1], last
        rows = torch.tensor(live)
        dev_rows = rows.to(logits.device)
        out = verify(rows_to_probs(logits[dev_rows], [reqs[b].params for b in live]),  # [L,K+1,V]
                     draft.token_ids[rows, :k],
                     None if draft.probs is None else draft.probs[dev_rows, :k],
                     draft.num_draft[rows], [reqs[b].generator for b in live],
                     torch.tensor([reqs[b].params.greedy for b in live]))
        return n_draft, out
