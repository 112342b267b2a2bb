"""The exactness audit's two halves: draw samples through the serving scheduler, and test them
against the target's exact distribution.

Terms, for one prompt:

* x₀ … x₃     the first four output tokens of a request (``TOKENS``): x₀ sampled at admission
              from the prompt's logits, x₁ … x₃ by verification rounds (accepted drafts, a
              recovered token after a rejection, or a bonus token)
* sample      one request through a :class:`~trtspec.serve.scheduler.Scheduler` with ``slots``
              slots, its own seed, ended once it holds x₀ … x₃ (the way a server ends a
              request at a stop string); a new one is sent when one ends (closed loop), so it
              is admitted between rounds beside requests at other stages
* warm request an untested request of the same prompt with a longer output. ``slots`` of
              them run first, so cross-request state (a suffix tree, the adaptive prior) is
              populated by earlier requests, as in a server that has been running; nothing is
              forgotten between samples. Then one at a time (the *companion*) keeps a slot
              busy beside the samples, so that each sample is admitted next to a request
              that is mid-decode
* speculated  the sample had a round with ≥ 1 draft among those that made x₁ … x₃
* recovered   a round rejected a draft and recovered one of x₁ … x₃ from the residual
              norm(max(0, p − q)): what a wrong residual shows on
* rejected    a round rejected a draft and recovered x₁ or x₂: x₃ (and maybe x₂) was then
              drawn by a later round, after the target's cache (and the draft's) rolled back:
              what a wrong rollback shows on
* staggered   the sample was admitted while another request in the batch was mid-decode
              (had run a round already)
* exact P     P(x₀ … x₃) = Π p(x_i | prompt, x_<i), each p from a target prefill through the
              same ``rows_to_probs`` the executor verifies with
* cells       the prefixes (x₀ … x_k) with expected count N·P ≥ ``MIN_EXPECTED`` are *kept*,
              found tree-wise (a prefix is only kept if its parent is). Each kept full
              sequence x₀ … x₃ is a cell; each kept prefix also has a *rest* cell: the
              sequences that start with it but leave the kept tree after it (the root's rest
              is every sequence whose x₀ is not kept)
* bins        each cell expected ≥ ``MIN_EXPECTED`` is a bin, the rest pool into one tail
              bin; where that makes more than ``MAX_BINS``, the most probable half of the
              bins hold one cell each and the other cells are packed into the other half,
              each bin expected ≥ ``MIN_EXPECTED`` (:func:`~trtspec.analysis.gof.gof_bins`). Cells
              and bins are fixed by the exact P before counting. A difference between cells of one
              bin is invisible to the test: the power is stated for what the bins see
* test        Pearson's chi-square of the counts per bin against N·P (dof = bins − 1); a
              sample whose token had probability 0 after a kept prefix is impossible: p = 0
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from trtspec.analysis.gof import chi_square_gof, gof_bins, least_favourable
from trtspec.runtime import Runner
from trtspec.runtime.trtllm_stream import LlmArm
from trtspec.serve.llmapi import make_scheduler
from trtspec.serve.slots import Ticket
from trtspec.spec.executor import Delta, SpecExecutor
from trtspec.spec.sample.probs import SamplingParams, rows_to_probs

TOKENS = 4  # x₀ … x₃
MIN_EXPECTED = 5.0
MAX_BINS = 30  # more bins add dof, and so cost power against the least favourable difference
WARM_ROUNDS = 3  # a warm request's output: enough for this many full rounds after x₃'s


@dataclass
class Drawn:
    """What the samples were (x₀ … x₃ each, in sample order) and how they were made."""

    sequences: list[tuple[int, ...]]
    speculated: int = 0
    recovered: int = 0
    rejected: int = 0
    staggered: int = 0


@dataclass
class _Track:
    tested: bool = False
    tokens: list[int] = field(default_factory=list)
    speculated: bool = False
    recovered: bool = False
    rejected: bool = False
    done: bool = False
    ticket: Ticket | None = None


def draw(executor: SpecExecutor | LlmArm, prompt: Sequence[int], params: SamplingParams,
         samples: int, slots: int, progress: Callable[[int], None] | None = None,
         keep_prompt: bool = False) -> Drawn:
    """``samples`` seeded requests (seeds ``params.seed`` + i) of ``prompt`` through a
    scheduler with ``slots`` slots at the executor's own D (fixed or adaptive).

    First ``slots`` warm requests run to the end. Then one warm request at a time keeps a slot
    busy (the *companion*: a new one starts when the last ends), and the samples take the
    other ``slots − 1``, a new one sent as soon as one ends (closed loop), so each sample is
    admitted between rounds while the companion, and usually other samples, are mid-decode
    (with one slot there is no companion). Each sample's budget leaves every round that makes
    x₁ … x₃ its full D; warm requests run ``WARM_ROUNDS`` full rounds further.
    ``keep_prompt``: a slot keeps the prompt's KV cache between requests (the scheduler's
    kept prompt), so a long prompt is prefilled once per slot, not once per sample."""
    if params.greedy:
        raise ValueError("the audit tests a distribution: use a temperature > 0")
    budget = TOKENS + executor.draft_len  # clip_draft keeps D ≤ remaining − 1
    warm_budget = budget + WARM_ROUNDS * (executor.draft_len + 1)
    base = params.seed or 0
    scheduler = make_scheduler(executor, slots, max_waiting=slots, keep_prompts=keep_prompt)
    drawn = Drawn([])
    live: list[_Track] = []  # submitted and not ended
    tested: list[_Track] = []
    warm_seeds = itertools.count(base + samples)  # after the samples' seeds

    def submit(seed: int, max_tokens: int, is_tested: bool) -> _Track:
        track = _Track(is_tested)

        def on_delta(delta: Delta) -> int | None:
            before = len(track.tokens)
            track.tokens += delta.token_ids
            if before == 0:  # admission: x₀
                drawn.staggered += is_tested and any(
                    len(t.tokens) >= 2 and not t.done for t in live if t is not track)
            elif is_tested and before < TOKENS:  # this round made some of x₁ … x₃
                track.speculated |= delta.num_draft > 0
                # a recovered token is at before + a: x₁ or x₂ means x₃ came after rollback
                if delta.num_accepted < delta.num_draft and before + delta.num_accepted < TOKENS:
                    track.recovered = True
                    track.rejected |= before + delta.num_accepted < TOKENS - 1
            if is_tested and len(track.tokens) >= TOKENS:
                track.done = True
                drawn.speculated += track.speculated
                drawn.recovered += track.recovered
                drawn.rejected += track.rejected
                if progress:
                    progress(1)
                return len(track.tokens)  # keep what the round emitted; the request ends
            track.done = delta.finish_reason is not None
            return None

        track.ticket = scheduler.submit(prompt, params.model_copy(update={
            "seed": seed, "max_tokens": max_tokens, "ignore_eos": True, "stop_token_ids": ()}),
            on_delta)
        live.append(track)
        return track

    for _ in range(slots):
        submit(next(warm_seeds), warm_budget, False)
    scheduler.run_until_idle()
    companion: _Track | None = None
    while len(tested) < samples or not all(t.done for t in tested):
        live[:] = [t for t in live if not t.done]
        if slots > 1 and len(tested) < samples and (companion is None or companion.done):
            companion = submit(next(warm_seeds), warm_budget, False)
        while len(tested) < samples and len(live) < slots:
            tested.append(submit(base + len(tested), budget, True))
        scheduler.step()
    for track in live:  # the last companion: not needed any more
        if not track.done:
            scheduler.cancel(track.ticket)
    scheduler.run_until_idle()
    drawn.sequences = [tuple(t.tokens[:TOKENS]) for t in tested]
    if any(len(s) < TOKENS for s in drawn.sequences):
        raise RuntimeError("a sampled request ended before its fourth token")
    return drawn


@dataclass
class Fit:
    """A chi-square test of the sampled x₀ … x₃ against their exact probabilities."""

    chi2: float
    dof: int
    p_value: float
    bins: int  # after pooling (module docstring)
    least_favourable: float  # L of the bins (:func:`~trtspec.analysis.gof.least_favourable`)
    impossible: int  # samples with a token of probability 0 after a kept prefix


def exact_fit(target: Runner, prompt: Sequence[int], params: SamplingParams,
              sequences: Sequence[tuple[int, ...]], rows: int) -> Fit:
    """Counts per cell (module docstring) against the exact P from ``target``: one prefill of
    ``prompt`` into ``rows`` rows, then each kept prefix scored on top of it (``rows`` at a
    time, rolled back after), so a prefix costs its own tokens only."""
    n = len(sequences)
    if n == 0:
        return Fit(0.0, 0, 1.0, 0, float("inf"), 0)
    need = MIN_EXPECTED / n  # the probability from which a prefix has a cell of its own
    prompt = list(prompt)
    logits = target.prefill([prompt] * rows)  # [rows, V]
    held = target.lengths()
    level: list[tuple[tuple[int, ...], float, np.ndarray]] = [
        ((), 1.0, _probs(logits[:1], params)[0])]  # (prefix, P(prefix), p(next | prefix))
    by_prefix: dict[tuple[int, ...], list[int]] = {(): list(range(n))}
    cells: list[float] = []  # probabilities, in cell order
    cell_of = np.full(n, -1)
    impossible = 0
    for depth in range(TOKENS):
        children: list[tuple[tuple[int, ...], float]] = []
        for prefix, prob, cond in level:
            members = by_prefix.pop(prefix, [])
            kept = np.flatnonzero(prob * cond >= need)
            rest = np.ones(cond.shape, dtype=bool)
            rest[kept] = False
            cells.append(prob * float(cond[rest].sum()))  # this prefix's rest cell
            kept_set = {int(t) for t in kept}
            for i in members:
                token = sequences[i][depth]
                impossible += cond[token] == 0
                if token in kept_set:
                    by_prefix.setdefault((*prefix, token), []).append(i)
                else:
                    cell_of[i] = len(cells) - 1
            children += [((*prefix, int(t)), prob * float(cond[t])) for t in kept]
        if depth == TOKENS - 1:  # the kept full sequences are cells
            for seq, prob in children:
                cells.append(prob)
                cell_of[np.array(by_prefix.pop(seq, []), dtype=int)] = len(cells) - 1
            break
        level = []
        for start in range(0, len(children), rows):
            chunk = children[start: start + rows]
            feed = [list(seq) for seq, _ in chunk] + [[] for _ in range(rows - len(chunk))]
            scored = target.score(feed, last_only=True)[: len(chunk), 0]  # [c, V]
            target.rollback(held)
            level += [(seq, prob, cond) for (seq, prob), cond in
                      zip(chunk, _probs(scored, params), strict=True)]
    counts = np.bincount(cell_of, minlength=len(cells)).astype(float)
    probs = np.asarray(cells)
    bins = gof_bins(probs / probs.sum() * n, MIN_EXPECTED, MAX_BINS)  # chi_square_gof's
    used = bins >= 0
    bin_probs = np.bincount(bins[used], probs[used])
    if impossible:
        return Fit(float("inf"), 0, 0.0, len(bin_probs), least_favourable(bin_probs),
                   impossible)
    stat, dof, p = chi_square_gof(counts, probs, MIN_EXPECTED, MAX_BINS)
    return Fit(stat, dof, p, len(bin_probs), least_favourable(bin_probs), 0)


def _probs(logits, params: SamplingParams) -> np.ndarray:
    return rows_to_probs(logits, [params] * logits.shape[0]).double().cpu().numpy()
