"""The adaptive draft length: the chooser on hand-computed cases, probes and back-off, costs
from a curve; exactness with D varying per round (with a power check); rounds, stats, the
scheduler and serve under an adaptive D; the cost curve in the manifest. (An eval with an
adaptive condition, through decide, the report and serve --policy: tests/eval/test_run.py.)"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from broken_verifiers import naive_resample_verify
from exactness import ALPHA, PROMPT, continuation_pvalue

import trtspec.spec.executor
from trtspec.analysis.cost_model import recommend_d
from trtspec.runtime.toy import MarkovLM, ToyRunner
from trtspec.serve.scheduler import Scheduler
from trtspec.serve.slots import DraftPolicy
from trtspec.spec.adaptive import (
    ADAPTIVE,
    AdaptiveDraft,
    AdaptiveState,
    relative_costs,
)
from trtspec.spec.cost_curve import CostCurve, chooser, fallback, measure
from trtspec.spec.counters import SpecStats
from trtspec.spec.executor import SpecExecutor
from trtspec.spec.propose.draft_model import DraftModelProposer
from trtspec.spec.propose.ngram import NgramProposer
from trtspec.spec.round_cost import RoundCost
from trtspec.spec.sample.probs import SamplingParams

FLAT = [1.0] * 9  # t(T) = t(1): scoring more tokens is free


def state(*accept: float) -> AdaptiveState:
    return AdaptiveState(list(accept), known=len(accept))


# ---- the chooser, by hand ------------------------------------------------------------------

def test_high_acceptance_and_a_flat_cost_draft_the_cap() -> None:
    chooser_ = AdaptiveDraft(4, FLAT)
    # E[emitted | D] = 1 + 0.9 + 0.81 + …: 1.9, 2.71, 3.439, 4.0951 over time 1
    assert chooser_.rates(state(0.9, 0.9, 0.9, 0.9), 4) == pytest.approx(
        [1.0, 1.9, 2.71, 3.439, 4.0951])
    assert chooser_.choose(state(0.9, 0.9, 0.9, 0.9), 4) == 4
    assert chooser_.choose(state(0.9, 0.9, 0.9, 0.9), 2) == 2  # a cap from the schedule


def test_a_gain_below_five_percent_decodes_plainly() -> None:
    """The default threshold: a D that promises 1.03× plain decoding (acceptance 0.03, scoring
    free) is not drafted, alone or batch-aware; at min_gain 1.02 it is."""
    flat = RoundCost.linear(0.0, 2, 3)  # t(B, W) = t(1, 1)
    for gain, want in ((None, 0), (1.02, 1)):
        extra = {} if gain is None else {"min_gain": gain}
        alone = AdaptiveDraft(1, [1.0, 1.0], probe_after=99, **extra)
        assert alone.rates(state(0.03), 1)[1] == pytest.approx(1.03)
        assert alone.choose(state(0.03), 1) == want
        aware = AdaptiveDraft(1, [1.0, 1.0], probe_after=99, round_cost=flat, **extra)
        assert aware.round_rates([state(0.03)] * 2, [1, 1], 2)[1] == pytest.approx(1.03)
        assert aware.choose_round([state(0.03)] * 2, [1, 1], 2) == [want] * 2


def test_low_acceptance_decodes_plainly() -> None:
    # t(T) = 1 + 0.05 (T − 1): D = 1 gives 1.01 / 1.05 = 0.96 < 1.05
    chooser_ = AdaptiveDraft(4, [1 + 0.05 * t for t in range(5)])
    assert chooser_.rates(state(0.01), 1)[1] == pytest.approx(1.01 / 1.05)
    assert chooser_.choose(state(0.01, 0.01, 0.01, 0.01), 4) == 0


def test_a_draft_step_s_cost_gives_leviathan_s_best_d() -> None:
    """a = 0.9 everywhere, t_draft = 0.5: (1.9/1.5, 2.71/2, 3.439/2.5, 4.0951/3) → D = 3, as
    Leviathan's formula says at α = 0.9, c = 0.5; and so for other α, c."""
    assert AdaptiveDraft(6, FLAT, 0.5).rates(state(*[0.9] * 4), 4)[1:] == pytest.approx(
        [1.9 / 1.5, 2.71 / 2, 3.439 / 2.5, 4.0951 / 3])
    for alpha in (0.3, 0.6, 0.8, 0.95):
        for c in (0.05, 0.2, 0.5):
            got = AdaptiveDraft(16, [1.0] * 17, c, min_gain=1.0).choose(state(*[alpha] * 16), 16)
            assert got == recommend_d(alpha, c), (alpha, c)


def test_a_step_in_the_cost_curve_stops_d_below_it() -> None:
    """Scoring 5 tokens costs twice 4 (a new tile, say): D = 3 (3.439 / 1) beats D = 4
    (4.0951 / 2), although acceptance is high."""
    curve = CostCurve(target={1: 10.0, 2: 10.0, 3: 10.0, 4: 10.0, 5: 20.0, 6: 20.0})
    costs, step = curve.relative("ngram")
    assert step == 0.0 and costs == [1.0, 1.0, 1.0, 1.0, 2.0, 2.0]
    assert AdaptiveDraft(5, costs, step).choose(state(*[0.9] * 5), 5) == 3


def test_probes_fire_back_off_and_reset_when_one_pays() -> None:
    chooser_ = AdaptiveDraft(4, [1 + 0.05 * t for t in range(5)], probe_after=3, max_wait=12)
    s = state(0.01)
    assert [chooser_.choose(s, 4) for _ in range(4)] == [0, 0, 0, 1]  # 3 plain, then a probe
    chooser_.update(s, 1, 0)  # rejected: the probe did not pay
    assert [chooser_.choose(s, 4) for _ in range(7)] == [0] * 6 + [1] and chooser_.wait == 6
    chooser_.update(s, 1, 0)
    other = state(0.01)  # the back-off is process-wide: another request waits as long
    assert [chooser_.choose(other, 4) for _ in range(13)] == [0] * 12 + [1]
    chooser_.update(other, 1, 0)
    assert chooser_.wait == 12  # capped at max_wait
    assert [chooser_.choose(s, 4) for _ in range(13)] == [0] * 12 + [1]
    chooser_.update(s, 1, 1)  # accepted: a₁ = 0.3 + 0.7·a₁ ≈ 0.30, so D = 2 pays:
    # (1 + 0.30 + 0.30²) / 1.10 ≈ 1.27 (position 2 is unobserved: it follows position 1)
    assert chooser_.wait == 3 and chooser_.choose(s, 4) == 2
    for _ in range(5):  # acceptance collapses (a₁ ≈ 0.05): plain again, a probe after 3
        chooser_.update(s, 2, 0)
    assert [chooser_.choose(s, 4) for _ in range(4)] == [0, 0, 0, 1]


# ---- the batch-aware chooser, by hand -------------------------------------------------------

# t(B, W) / t(1, 1) for B = 1, 2 and W = 1 … 5: one row widens cheaply, except that 3 tokens
# cost more than 4 (a BLAS shape); two rows pay for every extra token
TOY_ROUNDS = {1: {1: 1.0, 2: 1.1, 3: 1.5, 4: 1.2, 5: 1.6},
              2: {1: 1.2, 2: 2.0, 3: 2.2, 4: 2.4, 5: 2.6}}


def test_the_batch_aware_chooser_by_hand() -> None:
    """Row A accepts half its drafts, row B none (a, b below).
    Alone, A would draft: rates 1.5/1.1 = 1.36, 1.75/1.2 = 1.46 (W = 2, scored as 4 tokens at
    1.2), 1.875/1.2 = 1.56, 1.9375/1.6 = 1.21 → D = 3.
    Together (2 rows, plain rate 2/1.2): W = 1: (1.5 + 1)/2.0 ÷ (2/1.2) = 0.75, W = 2: 2.75/2.2
    → 0.75, W = 3: 2.875/2.4 → 0.72, W = 4: 2.9375/2.6 → 0.68 → plain decoding, where each
    request choosing alone drafts D = 3 for A and loses 28 %."""
    a, b = state(0.5, 0.5, 0.5, 0.5), state(0.0, 0.0, 0.0, 0.0)
    batch_aware = AdaptiveDraft(4, FLAT, round_cost=RoundCost(TOY_ROUNDS))
    assert batch_aware.round_rates([a], [4], 1) == pytest.approx(
        [1, 1.5 / 1.1, 1.75 / 1.2, 1.875 / 1.2, 1.9375 / 1.6])
    assert batch_aware.choose_round([a], [4], 1) == [3]
    assert batch_aware.round_rates([a, b], [4, 4], 2) == pytest.approx(
        [1, 2.5 / 2.0 * 0.6, 2.75 / 2.2 * 0.6, 2.875 / 2.4 * 0.6, 2.9375 / 2.6 * 0.6])
    assert batch_aware.choose_round([a, b], [4, 4], 2) == [0, 0]
    alone = AdaptiveDraft(4, [1.0, 1.1, 1.2, 1.2, 1.6])  # today's: each row on its own curve
    assert alone.choose_round([a, b], [4, 4], 2) == [3, 0]
    # both rows good: W = 4 ((4.0951 · 2) / 2.6 ÷ (2/1.2) = 1.89); a budget caps a row
    good = state(0.9, 0.9, 0.9, 0.9)
    assert batch_aware.choose_round([good, good], [4, 1], 2) == [4, 1]
    # a draft step of 0.5 t(1, 1) · t(B, 1) per drafted token: 4 steps at 2 rows cost 2.4 more
    dear = AdaptiveDraft(4, FLAT, 0.5, round_cost=RoundCost(TOY_ROUNDS))
    rates = dear.round_rates([good, good], [4, 4], 2)
    assert rates[4] == pytest.approx(2 * 4.0951 / (2.6 + 4 * 0.5 * 1.2) / (2 / 1.2))


def test_a_miss_lowers_the_supply_and_a_round_that_gets_nothing_costs_plain() -> None:
    """(asked, proposed, accepted) by hand, at rate 0.5: asked 4 and got nothing: s₁ = 1 −
    0.5 = 0.5, acceptance untouched. Asked 4, got 2, kept 1: s = (0.75, 1, 0.5) (positions 2
    and 3 start from 1: a match mostly goes on), a = (0.75, 0.25, 0.5, 0.5). E[emitted | D] =
    1 + s₁a₁ + s₁a₁·s₂a₂ + … = 1, 1.5625, 1.703125, 1.73828125. One row at t(T) = 1 + 0.1 (T −
    1): r = P(≥ k drafts) = (1, 0.75, 0.75, 0.375), so E[time | D] = Σ_k (r_k − r_{k+1})·t(k +
    1) = 1, 1.075, 1.15, 1.1875 (the round that got no draft costs a plain one)."""
    chooser_ = AdaptiveDraft(4, [1 + 0.1 * t for t in range(5)], rate=0.5)
    s = state(0.5, 0.5, 0.5, 0.5)
    chooser_.update(s, 0, 0, asked=4)
    assert s.supply == [0.5] and s.accept == [0.5] * 4
    assert s.supply_at(2) == 1.0  # past s₁ and nothing observed there: a match goes on
    chooser_.update(s, 2, 1, asked=4)
    assert s.supply == [0.75, 1.0, 0.5] and s.accept == [0.75, 0.25, 0.5, 0.5]
    assert s.reach(3) == [1.0, 0.75, 0.75, 0.375]
    emitted = [1, 1.5625, 1.703125, 1.73828125]
    assert chooser_.emitted(s, 3) == pytest.approx(emitted)
    assert chooser_.rates(s, 3) == pytest.approx(
        [e / t for e, t in zip(emitted, [1, 1.075, 1.15, 1.1875], strict=True)])
    chooser_.update(s, 3, 3, asked=3)  # all asked were proposed: nothing short to learn
    assert s.supply == pytest.approx([0.875, 1.0, 0.75]) and s.supplied == 3
    # two rows asked for drafts, one whose lookups never come up (s₁ = 0) and one that gets
    # them half the time: P₀ = 1 · 0.5, so a round costs 0.5 · 1 + 0.5 · t(2, W + 1)/t(2, 1)
    batch = AdaptiveDraft(4, FLAT, round_cost=RoundCost(TOY_ROUNDS))
    half, never = state(0.9), state(0.9)
    half.supply, never.supply = [0.5], [0.0]
    rates = batch.round_rates([half, never], [4, 4], 2)
    assert rates[1] == pytest.approx((2 + 0.45) / 2 / (0.5 + 0.5 * 2.0 / 1.2))
    assert batch.round_rates([never, never], [4, 4], 2) == pytest.approx([1.0] * 5)


def test_a_round_costs_the_drafts_its_rows_get() -> None:
    """Two rows asked for 2 drafts: A gets one at all half the time and then both (s = 0.5,
    1), B always one and the second half the time (s = 1, 0.5). P(widest ≤ 0) = 0.5 · 0 = 0,
    P(widest ≤ 1) = (1 − 0.5)(1 − 0.5) = 0.25: E[time] = 0.25 · t(2, 2)/t(2, 1) + 0.75 ·
    t(2, 3)/t(2, 1) = (0.5 + 1.65)/1.2, not t(2, 3)/t(2, 1) as if both got what they asked.
    A probe's expected cost counts the rounds that get nothing as plain."""
    chooser_ = AdaptiveDraft(4, FLAT, round_cost=RoundCost(TOY_ROUNDS))
    a, b = state(0.5), state(0.5)
    a.supply, b.supply = [0.5, 1.0], [1.0, 0.5]
    assert chooser_.expected_time([a, b], [2, 2], 2) == pytest.approx((0.5 + 1.65) / 1.2)
    assert chooser_.expected_time([a, b], [0, 0], 2) == 1.0
    never = state(0.5)
    never.supply = [0.0]
    assert chooser_.expected_time([a, never], [1, 1], 2) == pytest.approx(0.5 + 0.5 * 2 / 1.2)


def test_a_probe_that_misses_is_judged_and_costs_what_its_misses_cost() -> None:
    """Batch-aware, told what was asked: a probe whose lookups found nothing lowered s₁, so
    the next choice judges it (still plain: the wait doubles). Rows whose lookups never match
    (s₁ = 0) make a probe a plain round, so it waits only for the back-off, not the ~34
    rounds that 2 % of a 2-row round's extra 0.67 would take."""
    a, b = state(0.5, 0.5, 0.5, 0.5), state(0.0, 0.0, 0.0, 0.0)
    chooser_ = AdaptiveDraft(4, FLAT, round_cost=RoundCost(TOY_ROUNDS), probe_after=2,
                             max_wait=8, probe_budget=1.0)
    assert [chooser_.choose_round([a, b], [4, 4], 2) for _ in range(3)] == [
        [0, 0], [0, 0], [1, 1]]
    chooser_.update(a, 0, 0, asked=1)
    chooser_.update(b, 0, 0, asked=1)
    assert chooser_.choose_round([a, b], [4, 4], 2) == [0, 0] and chooser_.wait == 4
    dry = AdaptiveDraft(4, FLAT, round_cost=RoundCost(TOY_ROUNDS), probe_after=2)
    rows = [state(0.9), state(0.9)]
    for r in rows:
        r.supply = [0.0]
    assert [dry.choose_round(rows, [4, 4], 2) for _ in range(3)] == [[0, 0], [0, 0], [1, 1]]


def test_lookups_that_mostly_miss_decode_plainly() -> None:
    """A lookup that proposes 4 drafts in one round of 10 (its first kept, its second
    rejected), else nothing. Learnt without the misses (as if every ask were proposed), a₁ = 1
    and 4 rows draft one token a round: 2 / (t(4, 2)/t(4, 1) = 1.65/1.15) = 1.39. Learnt from
    what was asked, s₁ swings between 0.01 after nine misses and 0.31 just after a hit; a
    round asking one draft a row emits 1 + s₁ a row and costs P₀ + (1 − P₀)·1.43 with P₀ =
    (1 − s₁)⁴, so its rate (1 + s₁)/(P₀ + (1 − P₀)·1.43) is below 1 for s₁ under about 0.36
    (0.95 … 0.99 over these rounds, W = 1 the best each time): it never drafts."""
    rounds = RoundCost({b: {w: 1 + 0.05 * (b - 1) + 0.5 * b * (w - 1) / 4 for w in range(1, 6)}
                        for b in range(1, 5)})
    aware, blind = (AdaptiveDraft(4, FLAT, round_cost=rounds) for _ in range(2))
    rows_aware = [aware.start() for _ in range(4)]
    rows_blind = [blind.start() for _ in range(4)]
    best = []
    for i in range(400):
        got = 4 if i % 10 == 0 else 0
        for r in rows_aware:
            aware.update(r, got, min(got, 1), asked=4)
        for r in rows_blind:
            blind.update(r, got, min(got, 1))
        if i >= 100:
            best.append(max(aware.round_rates(rows_aware, [4] * 4, 4)[1:]))
    assert max(best) < aware.min_gain and min(best) > 0.9
    assert blind.choose_round(rows_blind, [4] * 4, 4) == [1] * 4
    assert aware.choose_round(rows_aware, [4] * 4, 4) == [0] * 4


def test_batch_aware_probes_are_rounds_judged_by_the_next_choice() -> None:
    a, b = state(0.5, 0.5, 0.5, 0.5), state(0.0, 0.0, 0.0, 0.0)
    # a 2-row probe costs 2.0/1.2 − 1 = 0.67 of a round: at 2 % of the time, one per 34 rounds
    dear = AdaptiveDraft(4, FLAT, round_cost=RoundCost(TOY_ROUNDS), probe_after=2)
    assert [dear.choose_round([a, b], [4, 4], 2) for _ in range(35)] == [[0, 0]] * 34 + [[1, 1]]
    assert AdaptiveDraft(4, FLAT, round_cost=RoundCost(TOY_ROUNDS), probe_after=2
                         ).choose_round([a], [4], 1) == [3]  # one row: no wait to speculate
    chooser_ = AdaptiveDraft(4, FLAT, round_cost=RoundCost(TOY_ROUNDS), probe_after=2,
                             max_wait=8, probe_budget=1.0)  # below: the back-off alone
    picks = [chooser_.choose_round([a, b], [4, 4], 2) for _ in range(3)]
    assert picks == [[0, 0], [0, 0], [1, 1]]  # two plain rounds, then a probe of every row
    chooser_.update(a, 0, 0)  # not told what was asked: the probe told nothing, the wait
    assert [chooser_.choose_round([a, b], [4, 4], 2) for _ in range(3)] == [  # stays
        [0, 0], [0, 0], [1, 1]] and chooser_.wait == 2
    chooser_.update(b, 1, 0)  # the next probe sees a rejection: still plain, the wait doubles
    assert chooser_.choose_round([a, b], [4, 4], 2) == [0, 0] and chooser_.wait == 4
    assert [chooser_.choose_round([a, b], [4, 4], 2) for _ in range(4)] == [[0, 0]] * 3 + [
        [1, 1]]  # 4 plain rounds (counting the one above), then a probe, after which
    chooser_.update(b, 1, 1)
    b.accept[:] = [0.9] * 4  # B accepts well: speculation is back, the wait reset
    assert chooser_.choose_round([a, b], [4, 4], 2) == [4, 4] and chooser_.wait == 2


def test_a_stale_clock_wants_a_timing_only_where_the_chooser_would_draft() -> None:
    """The clock's plain baseline at B rows is stale until three plain rounds there are
    timed (or after ``refresh`` speculative ones), and every round is then plain; the
    scheduler gives such a round a call of its own (a prompt's chunk riding in it would
    leave it untimed) only where the timing could change a choice: at the round cost's
    prices, which the clock never goes below, the round would draft or probe. Rows that
    accept nothing, their probe not due (the 2-row probe waits 34 rounds, 2 % of its
    0.67-round cost), want no timing, and their stale rounds count toward the probe, whose
    turn then wants one; rows that accept well want one, even where the stale clock, having
    timed wide rounds dear, prices them out."""
    dull = [state(0.0, 0.0, 0.0, 0.0), state(0.0, 0.0, 0.0, 0.0)]
    keen = [state(0.9, 0.9, 0.9, 0.9), state(0.9, 0.9, 0.9, 0.9)]
    chooser_ = AdaptiveDraft(4, FLAT, round_cost=RoundCost(TOY_ROUNDS), timed=True,
                             probe_after=2)
    assert chooser_.clock is not None
    chooser_.observe_round(3, 1, 0.1)  # a clock that has timed something: B = 2 is stale
    assert chooser_.clock.stale(2) and chooser_.wants_timing(2)  # nothing chosen yet
    assert chooser_.choose_round(dull, [4, 4], 2) == [0, 0]
    assert not chooser_.wants_timing(2) and chooser_.idle == 1  # a plain round waited
    assert chooser_.choose_round(keen, [4, 4], 2) == [0, 0] and chooser_.wants_timing(2)
    for _ in range(3):
        chooser_.observe_round(2, 1, 0.1)
    assert not chooser_.clock.stale(2) and not chooser_.wants_timing(2)
    assert chooser_.choose_round(keen, [4, 4], 2) == [4, 4]  # timed: it drafts
    assert chooser_.would_draft and not chooser_.wants_timing(2)  # (not stale)
    assert chooser_.choose_round(dull, [4, 4], 2) == [0, 0] and not chooser_.would_draft
    chooser_.idle = 40  # a probe is due: stale again, it would probe, so it wants a timing
    assert chooser_.choose_round(dull, [4, 4], 3) == [0, 0] and chooser_.wants_timing(3)
    for width in range(2, 6):  # wide rounds at B = 2 timed 10× plain: the clock says plain
        for _ in range(3):
            chooser_.observe_round(2, width, 1.0)
    assert max(chooser_.round_rates(keen, [4, 4], 2)[1:]) < chooser_.min_gain
    chooser_.clock.refresh = 3  # … and its baseline is stale (12 speculative rounds since)
    assert chooser_.clock.stale(2)
    assert chooser_.choose_round(keen, [4, 4], 2) == [0, 0] and chooser_.wants_timing(2)
    assert not AdaptiveDraft(4, FLAT, round_cost=RoundCost(TOY_ROUNDS)).wants_timing(2)  # no
    # clock (untimed): nothing to time


def test_a_round_that_fails_puts_the_chooser_s_probe_bookkeeping_back() -> None:
    """A batch-aware round that raises before committing (here: the target's scoring) leaves
    the chooser's probe bookkeeping as it found it, though choosing that round had moved it
    (a plain round waited, then a probe started): the round run again chooses anew instead
    of counting twice, or of leaving a probe whose verdict never comes."""
    from trtspec.spec.executor import RoundFailed

    runner = ToyRunner(MarkovLM(vocab_size=16, order=2, seed=5))
    chooser_ = AdaptiveDraft(4, FLAT, round_cost=RoundCost(TOY_ROUNDS), probe_after=2,
                             max_wait=8, probe_budget=1.0, min_gain=100.0)  # never pays
    ex = SpecExecutor(runner, NgramProposer(), 4, adaptive=chooser_)
    reqs = [ex.request([1, 2, 3, 1, 2], SamplingParams(max_tokens=40, ignore_eos=True))
            for _ in range(2)]
    ex.first_tokens(reqs, [0, 1], runner.prefill([r.prompt for r in reqs]))
    ex.proposer.start([r.prompt for r in reqs])
    for r in reqs:
        r.adaptive = chooser_.start()
    score, moved = runner.score, []

    def failing(tokens, last_only=False):
        moved.append(chooser_.mark([r.adaptive for r in reqs]))  # after choosing
        raise RuntimeError("scoring failed")

    def bookkeeping() -> tuple:
        mark = chooser_.mark([r.adaptive for r in reqs])
        return mark.idle, mark.wait, mark.probed, mark.probe_saw, \
            [p for _, p in mark.probing]

    for _ in range(4):  # plain, plain, a probe, then plain again: each fails once first
        before = bookkeeping()
        runner.score = failing
        with pytest.raises(RoundFailed):
            ex.round(reqs, [0, 1])
        assert bookkeeping() == before
        m = moved[-1]
        assert (m.idle, m.wait, m.probed, m.probe_saw) != before[:4]  # it had moved
        runner.score = score
        ex.round(reqs, [0, 1])  # the same round, run again
    # per request (no round cost): a new request's first round is a probe that fails; its
    # state, made for that round, is left as no probe
    alone = AdaptiveDraft(4, FLAT, probe_after=0, min_gain=100.0)
    ex = SpecExecutor(runner, NgramProposer(), 4, adaptive=alone)
    reqs = [ex.request([1, 2, 3, 1, 2], SamplingParams(max_tokens=40, ignore_eos=True))]
    ex.first_tokens(reqs, [0], runner.prefill([reqs[0].prompt]))
    ex.proposer.start([reqs[0].prompt])
    probing = []

    def probed(tokens, last_only=False):
        probing.append(reqs[0].adaptive.probing)
        raise RuntimeError("scoring failed")

    runner.score = probed
    with pytest.raises(RoundFailed):
        ex.round(reqs, [0])
    assert probing == [True] and not reqs[0].adaptive.probing and alone.idle == 0


def test_a_round_whose_lookups_all_missed_costs_a_plain_round_at_least() -> None:
    """Misses timed cheaper than plain rounds (noise) still price width 0 at a plain round."""
    chooser_ = AdaptiveDraft(4, FLAT, round_cost=RoundCost(TOY_ROUNDS), timed=True)
    for width, t in ((1, 0.1), (0, 0.09)):  # misses timed cheaper than plain (noise): still
        for _ in range(3):  # a plain round's cost at least
            chooser_.observe_round(2, width, t)
    assert chooser_.round_time(2, 0) == 1.0


def test_a_timed_chooser_stops_drafting_where_rounds_cost_more_than_the_table_says() -> None:
    """2 rows accepting 0.9: by the table (TOY_ROUNDS) W = 1 … 4 cost 2.0/1.2 … 2.6/1.2 of
    a plain round, so the chooser drafts W = 4 (4.0951 tokens a row for 2.17: 1.89×); once
    rounds of W = 4 are timed at 5× a plain round (a proposer and a verify the table never
    saw), W = 4 gives 4.0951/5 = 0.82× and the widths not timed are scaled alike (5/2.17), so
    it decodes plainly. The first round it times at a B it has no plain timing for is plain."""
    good = state(0.9, 0.9, 0.9, 0.9)
    timed = AdaptiveDraft(4, FLAT, round_cost=RoundCost(TOY_ROUNDS), timed=True, probe_after=2)
    untimed = AdaptiveDraft(4, FLAT, round_cost=RoundCost(TOY_ROUNDS), probe_after=2)
    assert timed.choose_round([good, good], [4, 4], 2) == [4, 4]  # nothing timed yet
    for _ in range(3):
        timed.observe_round(2, 5, 0.5)
    assert timed.choose_round([good, good], [4, 4], 2) == [0, 0]  # the baseline is timed first
    for _ in range(3):
        timed.observe_round(2, 1, 0.1)
    assert timed.round_time(2, 5) == pytest.approx(5.0)
    assert timed.round_time(2, 2) == pytest.approx(2.0 / 1.2 * 5.0 / (2.6 / 1.2))
    assert timed.choose_round([good, good], [4, 4], 2) == [0, 0]
    for _ in range(3):  # a chooser not timed ignores what rounds took
        untimed.observe_round(2, 5, 0.5)
    assert untimed.choose_round([good, good], [4, 4], 2) == [4, 4]
    # and the other way: rounds that cost what plain ones do make drafting pay again, at the
    # table's price: a reading cheaper than the table is taken as drift, never below it
    for _ in range(12):
        timed.observe_round(2, 5, 0.1)  # (each at most halves: 0.5 → 0.1 is no spike)
    timed.observe_round(2, 1, 0.1)
    assert timed.clock is not None
    assert timed.clock.relative(2, 5, lambda b, w: 1.0) == pytest.approx(1 + 4 * 0.8 ** 12)
    assert timed.round_time(2, 5) == pytest.approx(2.6 / 1.2)  # the EMA forgot; the floor
    assert timed.round_time(2, 2) == pytest.approx(2.0 / 1.2)  # a width scaled below: too
    assert timed.choose_round([good, good], [4, 4], 2) == [4, 4]


class AlwaysClocked(AdaptiveDraft):
    """The batch-aware choice as it was before the round cost's prices were tried first:
    every round priced by the clock, the table's times worked out anew each time and a
    probe's cost asked every round (the reference the shortcuts must match)."""

    def _round_times(self, rows, widest, clocked=True):  # type: ignore[no-untyped-def]
        return [self.round_time(rows, k + 1 if k else 0, clocked) for k in range(widest + 1)]

    def _probe_due(self, states, caps, rows, clocked=True):  # type: ignore[no-untyped-def]
        extra = self.expected_time(states, [min(1, c) for c in caps], rows, clocked) - 1
        return self.idle >= max(self.wait, extra / self.probe_budget)

    def choose_round(self, states, caps, rows):  # type: ignore[no-untyped-def]
        if self.clock is not None and self.clock.stale(rows):
            return super().choose_round(states, caps, rows)  # (unchanged: the table's)
        self.would_draft = False
        rates = self.round_rates(states, caps, rows) if states else [1.0]
        if len(rates) == 1:
            return [0] * len(caps)
        best = max(range(1, len(rates)), key=rates.__getitem__)
        if self.probed and self.probe_saw:
            self.probed = False
            self.wait = self.probe_after if rates[best] >= self.min_gain else min(
                2 * self.wait, self.max_wait)
        if rates[best] < self.min_gain:
            if not self._probe_due(states, caps, rows):
                self.idle += 1
                return [0] * len(caps)
            self.idle, self.probed, self.probe_saw = 0, True, False
            best = 1
        self.would_draft = True
        return [max(0, min(best, c)) for c in caps]


def test_pricing_by_the_round_cost_first_chooses_what_the_clock_alone_would() -> None:
    """choose_round prices a round by the round cost's table first and asks the clock only
    where that table would draft (the clock never prices a width below the table, so its
    rates are at most the table's), works the table's times out once, and asks what a probe
    costs only once its wait is over. Over a seeded walk of acceptances, supplies, caps, rows
    and clock readings (some above the table, some below it, rounds whose lookups all
    missed, widths never timed), the choices and the probe bookkeeping are the reference's,
    round for round; the clocked rates are at most the table's at every width; and the walk
    reaches the cases a wrong shortcut would get wrong (the table drafting where the clock
    does not, the two preferring different widths, probes and their verdicts, stale rounds)."""
    import random

    rng = random.Random(7)
    table = {b: {w: 1.0 + 0.12 * (b - 1) + 0.2 * (w - 1) * b ** 0.5 for w in range(1, 6)}
             for b in range(1, 5)}
    table[3][2] = table[3][1] * 0.96  # a noisy build: one width cheaper than plain
    fast = AdaptiveDraft(4, FLAT, round_cost=RoundCost(table), timed=True, probe_after=4)
    slow = AlwaysClocked(4, FLAT, round_cost=RoundCost(table), timed=True, probe_after=4)
    assert fast.clock is not None and slow.clock is not None
    seen = dict.fromkeys(("drafted", "plain", "table only", "other best", "probe",
                          "verdict", "stale", "missed"), 0)
    for _ in range(3000):
        rows = rng.randint(1, 4)
        level = rng.choice([0.02, 0.1, 0.3, 0.6, 0.9])
        rows_state = [([min(1.0, level * rng.uniform(0.5, 1.5)) for _ in range(3)],
                       rng.uniform(0.2, 1.0)) for _ in range(rows)]
        states = {c: [AdaptiveState(list(a), known=3, supply=[s], supplied=1)
                      for a, s in rows_state] for c in ("fast", "slow")}
        caps = [rng.randint(0, 4) for _ in range(rows)]
        stale = fast.clock.stale(rows)
        if not stale:
            cheap = fast.round_rates(states["fast"], caps, rows, clocked=False)
            dear = fast.round_rates(states["fast"], caps, rows)
            assert all(d <= c for d, c in zip(dear[1:], cheap[1:], strict=True))
            if len(cheap) > 1:
                seen["table only"] += max(cheap[1:]) >= fast.min_gain > max(dear[1:])
                seen["other best"] += cheap.index(max(cheap[1:])) != dear.index(max(dear[1:]))
        verdict = fast.probed and fast.probe_saw
        chosen = fast.choose_round(states["fast"], caps, rows)
        assert chosen == slow.choose_round(states["slow"], caps, rows)
        assert (fast.idle, fast.wait, fast.probed, fast.probe_saw, fast.would_draft) == \
            (slow.idle, slow.wait, slow.probed, slow.probe_saw, slow.would_draft)
        seen["stale"] += stale
        seen["verdict"] += verdict and not stale
        seen["probe"] += fast.probed and not verdict and any(chosen)
        missed = any(chosen) and rng.random() < 0.3  # every row's lookup came up empty
        seen["missed"] += missed
        width = 0 if missed else max(chosen) + 1 if any(chosen) else 1
        seconds = 0.04 * table[rows][min(max(width, 1), 5)] * rng.uniform(0.8, 1.4)
        outcomes = [(d, 0 if missed else d, rng.randint(0, d)) for d in chosen]
        for c in (fast, slow):
            c.observe_round(rows, width, seconds)
            for st, (asked, got, hits) in zip(states["fast" if c is fast else "slow"],
                                              outcomes, strict=True):
                if asked:
                    c.update(st, got, min(hits, got), asked)
        seen["drafted" if any(chosen) else "plain"] += 1
    assert fast.prior == slow.prior and fast.supply_prior == slow.supply_prior
    assert seen["drafted"] > 300 and seen["plain"] > 300, seen
    assert all(n > 0 for n in seen.values()), seen  # every case a shortcut could get wrong


def test_the_executor_times_its_rounds_into_a_timed_chooser() -> None:
    target = MarkovLM(vocab_size=16, order=2, seed=5)
    chooser_ = AdaptiveDraft(4, FLAT, round_cost=RoundCost(TOY_ROUNDS), timed=True)
    ex = SpecExecutor(ToyRunner(target), NgramProposer(), 4, adaptive=chooser_)
    ex.generate([[1, 2, 1, 2]] * 2, SamplingParams(max_tokens=20, ignore_eos=True))
    assert chooser_.clock is not None and (2, 1) in chooser_.clock.seconds
    assert all(t > 0 for t in chooser_.clock.seconds.values())
    missing = AdaptiveDraft(4, FLAT, round_cost=RoundCost(TOY_ROUNDS), timed=True, initial=1.0)
    SpecExecutor(ToyRunner(target), NgramProposer(3, 3), 4, adaptive=missing).generate(
        [[1, 2, 3, 4, 5]], SamplingParams(max_tokens=12, ignore_eos=True))  # no repeats:
    assert missing.clock is not None and (1, 0) in missing.clock.timed_at  # misses
    assert chooser(  # what a build's measured costs give: a timed chooser
        "ngram", 4, CostCurve(target={1: 1.0, 2: 1.1}, rounds=TOY_ROUNDS)).clock is not None


def test_the_ema_learns_only_what_a_round_observed() -> None:
    chooser_ = AdaptiveDraft(4, FLAT, rate=0.5)
    s = state(0.5, 0.5, 0.5, 0.5)
    chooser_.update(s, 3, 1)  # proposed 3, accepted 1: position 1 accepted, 2 rejected
    assert s.accept == [0.75, 0.25, 0.5, 0.5]
    chooser_.update(s, 2, 2)  # both accepted: nothing known about position 3
    assert s.accept == [0.875, 0.625, 0.5, 0.5]
    chooser_.update(s, 0, 0)  # asked 4, the n-gram found nothing: no observation
    chooser_.update(s, 1, 1)  # asked 4, proposed 1: only position 1 observed (accepted)
    assert s.accept == [0.9375, 0.625, 0.5, 0.5]


def test_new_requests_start_from_the_prior_and_unseen_positions_follow() -> None:
    chooser_ = AdaptiveDraft(4, [1.0, 1.01, 1.02, 1.03, 1.04], initial=0.6)
    assert chooser_.start().accept == [0.6]  # nothing observed: the initial guess everywhere
    first = chooser_.start()
    for _ in range(200):
        chooser_.update(first, 4, 1)  # position 1 always accepted, position 2 never
    assert first.known == 2 and first.accept[0] == pytest.approx(1.0)
    assert first.accept[1] == pytest.approx(0.0, abs=1e-6)
    fresh = chooser_.start()  # the process-wide prior learnt it too
    assert fresh.known == 2 and fresh.accept == pytest.approx([1.0, 0.0], abs=1e-3)
    assert chooser_.choose(fresh, 4) == 1
    late = AdaptiveDraft(4, FLAT, initial=0.6)
    one = late.start()
    late.update(one, 2, 2)  # positions 1, 2 accepted once: 3 and 4 follow position 2
    assert one.known == 2 and late.rates(one, 4) == pytest.approx(
        [1, 1.72, 1.72 + 0.72 ** 2, 1.72 + 0.72 ** 2 + 0.72 ** 3,
         1.72 + 0.72 ** 2 + 0.72 ** 3 + 0.72 ** 4])


def test_relative_costs_are_normalised_monotone_and_extended() -> None:
    assert relative_costs([20.0, 22.0, 21.0, 26.0], 6) == pytest.approx(
        [1.0, 1.1, 1.1, 1.3, 1.5, 1.7])
    assert relative_costs([5.0], 3) == pytest.approx([1.0, 1.02, 1.04])
    assert fallback(3, "ngram") == ([1.0, 1.02, 1.04], 0.0)
    assert fallback(2, "draft_model")[1] == 0.1


# ---- the executor: exact, with D varying per request and round -----------------------------

def adaptive_executor(target: MarkovLM, draft: MarkovLM, clip: bool = False, **knobs
                      ) -> SpecExecutor:
    """D ∈ 0 … 4 with a dear draft step (0.35 t(1)): a rejection sends a request's a₁ below
    what pays, acceptances bring D back up, so D varies with each request's own past (or, with
    a ``round_cost`` knob, each round's D with the batch's)."""
    knobs = {"initial": 0.7, "rate": 0.6, "probe_after": 1} | knobs
    return SpecExecutor(ToyRunner(target), DraftModelProposer(ToyRunner(draft)), 4,
                        clip_draft=clip, adaptive=AdaptiveDraft(4, FLAT, 0.35, **knobs))


def test_continuations_with_an_adaptive_d_match_the_target_exactly() -> None:
    target = MarkovLM(vocab_size=8, order=2, seed=41)
    executor = adaptive_executor(target, target.diverged(0.6, seed=42))
    assert continuation_pvalue(executor, target, 3, 20_000) > ALPHA
    # the chooser really varied D, per request, from round to round (a fresh prior)
    executor = adaptive_executor(target, target.diverged(0.6, seed=42))
    outs = executor.generate([PROMPT] * 200, [SamplingParams(max_tokens=4, seed=i)
                                              for i in range(200)])
    lens = [c.stats.draft_lens for c in outs]
    assert {d for ls in lens for d in ls} >= {0, 1, 2}
    assert sum(len(set(ls)) > 1 for ls in lens) > 50


def test_power_adaptive_d_with_a_broken_verifier_fails(monkeypatch: pytest.MonkeyPatch
                                                       ) -> None:
    monkeypatch.setattr(trtspec.spec.executor, "verify", naive_resample_verify)
    target = MarkovLM(vocab_size=8, order=2, seed=41)
    executor = adaptive_executor(target, target.diverged(0.6, seed=42))
    assert continuation_pvalue(executor, target, 3, 20_000) < ALPHA


class InChunks:
    """An executor run over a few prompts at a time (a batch-aware chooser then sees small
    batches whose estimates differ, so D varies from round to round and batch to batch); it
    keeps the widths the target scored."""

    def __init__(self, executor: SpecExecutor, size: int) -> None:
        self.executor, self.size, self.widths = executor, size, []
        score = executor.target.score

        def scored(tokens, last_only=False):
            if not last_only:  # a round, not a prefill
                self.widths.append(max(len(t) for t in tokens))
            return score(tokens, last_only)

        executor.target.score = scored

    def generate(self, prompts, params):
        return [c for i in range(0, len(prompts), self.size)
                for c in self.executor.generate(prompts[i: i + self.size],
                                                params[i: i + self.size])]


# one row: 3 tokens cost more than 4 (padded), more rows in proportion; dear draft steps
PADDED = {1: {1: 1.0, 2: 1.05, 3: 1.5, 4: 1.1, 5: 1.15}}


@pytest.mark.parametrize("broken", [False, True])
def test_continuations_with_the_batch_aware_chooser_match_the_target_exactly(
        broken: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """The chooser on (rounds of 3 requests, the width padded where the cost says), and its
    power check: the same run with a broken verifier fails."""
    if broken:
        monkeypatch.setattr(trtspec.spec.executor, "verify", naive_resample_verify)
    target = MarkovLM(vocab_size=8, order=2, seed=41)
    chooser_ = AdaptiveDraft(4, FLAT, 0.02, initial=0.7, rate=0.6, probe_after=1,
                             round_cost=RoundCost(PADDED))
    run = InChunks(SpecExecutor(ToyRunner(target), DraftModelProposer(
        ToyRunner(target.diverged(0.6, seed=42))), 4, clip_draft=False, adaptive=chooser_), 3)
    pvalue = continuation_pvalue(run, target, 3, 12_000)
    assert (pvalue < ALPHA) if broken else (pvalue > ALPHA)
    if not broken:  # rounds chose several D (their widths: D + 1, 3 scored 4 wide)
        assert 4 in run.widths and 3 not in run.widths and len(set(run.widths)) >= 3


def test_a_fixed_d_scored_wider_gives_plain_decoding_s_greedy_output() -> None:
    target = MarkovLM(vocab_size=16, order=2, seed=5, eos_token_id=15)
    prompts = [[1], [2, 3], [4, 5, 6]]
    params = SamplingParams(temperature=0, max_tokens=30)
    plain = [c.token_ids for c in SpecExecutor(ToyRunner(target)).generate(prompts, params)]
    run = InChunks(SpecExecutor(ToyRunner(target), DraftModelProposer(
        ToyRunner(target.diverged(0.5, seed=6))), 2, round_cost=RoundCost(PADDED)), 1)
    assert [c.token_ids for c in run.generate(prompts, [params] * 3)] == plain
    assert 4 in run.widths and 3 not in run.widths


def test_the_chooser_sees_every_live_request_and_the_rows_the_target_scores() -> None:
    """Rows 0, 2 and 4 finish first; then the live rows are 1 and 3, and the target scores
    the contiguous range 1 … 3: B = 3."""
    seen: list[tuple[int, int]] = []

    class Spy(AdaptiveDraft):
        def choose_round(self, states, caps, rows):
            seen.append((len(states), rows))
            return super().choose_round(states, caps, rows)

    target = MarkovLM(vocab_size=16, order=2, seed=5)
    ex = SpecExecutor(ToyRunner(target), NgramProposer(), 4,
                      adaptive=Spy(4, FLAT, round_cost=RoundCost(TOY_ROUNDS)))
    ex.generate([[1, 2]] * 5, [SamplingParams(max_tokens=n, ignore_eos=True)
                                for n in (2, 12, 2, 12, 2)])
    assert seen[0] == (5, 5) and (2, 3) in seen


@pytest.mark.parametrize("divergence", [0.0, 0.5, 1.0])
def test_greedy_output_with_an_adaptive_d_is_plain_decoding_s(divergence: float) -> None:
    target = MarkovLM(vocab_size=16, order=2, seed=5, eos_token_id=15)
    prompts = [[1], [2, 3], [4, 5, 6], [7, 8, 9, 10], [11, 12]]
    params = SamplingParams(temperature=0, max_tokens=40)
    plain = [c.token_ids for c in SpecExecutor(ToyRunner(target)).generate(prompts, params)]
    for clip in (True, False):
        ex = adaptive_executor(target, target.diverged(divergence, seed=6), clip)
        assert [c.token_ids for c in ex.generate(prompts, params)] == plain


def test_rounds_record_the_d_asked_and_what_was_proposed() -> None:
    """Prompt lookup on a prompt with no repeats proposes nothing when asked: the round's D
    is recorded, the proposer's 0 too, and the chooser learns the miss (the supply at
    position 1 falls), not a rejection."""
    target = MarkovLM(vocab_size=16, order=2, seed=5)
    chooser_ = AdaptiveDraft(4, FLAT, initial=0.9)
    ex = SpecExecutor(ToyRunner(target), NgramProposer(3, 3), 4, adaptive=chooser_)
    out = ex.generate([[1, 2, 3, 4, 5]], SamplingParams(temperature=0, max_tokens=4))[0]
    stats = out.stats
    asked = sum(1 for d in stats.draft_lens if d)
    assert asked and chooser_.supply_observed[0] == asked  # each ask observes position 1
    assert chooser_.observed[0] == sum(1 for p in stats.proposed_lens if p)
    if stats.proposed_lens.count(0) > stats.draft_lens.count(0):  # a miss
        assert chooser_.supply_prior[0] < 1
    assert stats.draft_lens[0] == 2  # the first round: D = 4, clipped to the budget (2)
    assert len(stats.draft_lens) == len(stats.proposed_lens) == stats.verification_rounds
    assert sum(stats.proposed_lens) == stats.proposed_tokens
    assert all(p <= d for p, d in zip(stats.proposed_lens, stats.draft_lens, strict=True))
    assert sum(stats.rounds_per_draft_len) == stats.verification_rounds
    fixed = SpecExecutor(ToyRunner(target), NgramProposer(), 3)  # fixed D: recorded as well
    assert fixed.generate([[1, 2]], SamplingParams(max_tokens=9, ignore_eos=True)
                          )[0].stats.draft_lens[0] == 3


def test_stats_merge_keeps_the_histogram_and_summarise_the_d_chosen() -> None:
    a, b = SpecStats(), SpecStats()
    for d in (0, 0, 4, 2):
        a.record_round(d, 0, 1, d)
    b.record_round(1, 1, 2, 4)  # asked 4, proposed 1
    total = SpecStats.merge([a, b])
    assert total.rounds_per_draft_len == [2, 0, 1, 0, 2] and total.draft_lens == []
    assert total.draft_len_share == {0: 0.4, 2: 0.2, 4: 0.4}
    assert total.draft_len_mean == pytest.approx(2.0) == total.summary()["draft_len_mean"]
    assert b.draft_lens == [4] and b.proposed_lens == [1]


# ---- the scheduler and serve ----------------------------------------------------------------

def test_policies_and_the_scheduler_run_an_adaptive_d() -> None:
    policy = DraftPolicy.parse("1:adaptive,4:2,8:0")
    assert [policy.for_running(n) for n in (1, 3, 8, 9)] == [ADAPTIVE, 2, 0, 0]
    assert policy.adaptive and not DraftPolicy.parse("1:4").adaptive
    with pytest.raises(ValueError, match="draft length schedule"):
        DraftPolicy.parse("1:adaptiv")
    target = MarkovLM(vocab_size=16, order=2, seed=5, eos_token_id=15)
    params = SamplingParams(temperature=0, max_tokens=30)
    prompts = [[1, 2], [3], [4, 5, 6]]
    plain = [c.token_ids for c in SpecExecutor(ToyRunner(target)).generate(prompts, params)]
    scheduler = Scheduler(adaptive_executor(target, target.diverged(0.2, seed=6)), slots=2)
    assert scheduler.policy.draft_len == ADAPTIVE  # an executor with a chooser: adaptive
    tickets = [scheduler.submit(p, params) for p in prompts]
    scheduler.run_until_idle()
    assert [t.token_ids for t in tickets] == plain
    assert sum(scheduler.totals.rounds_per_draft_len[1:]) > 0
    fixed = Scheduler(adaptive_executor(target, target.diverged(0.2, seed=6)), slots=2,
                      policy=DraftPolicy.parse("8:3"))  # a fixed D from the policy wins
    ticket = fixed.submit([1, 2], params.model_copy(update={"ignore_eos": True}))
    fixed.run_until_idle()
    assert set(ticket.stats.draft_lens[:-2]) == {3}
    with pytest.raises(ValueError, match="needs an executor built with an AdaptiveDraft"):
        SpecExecutor(ToyRunner(target), NgramProposer(), 4).round(
            [dataclasses.replace(tickets[0].request, finish_reason=None)], [0], ADAPTIVE)


def test_serve_toy_backend_with_an_adaptive_d(capsys) -> None:
    import click

    from trtspec.cli.serve import DraftLen, describe_policy, toy_engine

    assert DraftLen().convert("adaptive", None, None) == ADAPTIVE
    assert DraftLen().convert("3", None, None) == 3
    with pytest.raises(click.BadParameter, match="0 … 64 or adaptive"):
        DraftLen().convert("65", None, None)
    engine = toy_engine("draft_model", ADAPTIVE, 2, 8, "toy")
    assert describe_policy(engine) == "draft_model, adaptive D ≤ 8"
    assert engine.scheduler.policy.adaptive
    ticket = engine.scheduler.submit([1, 2, 3], SamplingParams(max_tokens=20, seed=1))
    engine.scheduler.run_until_idle()
    assert ticket.finish_reason is not None and ticket.stats.draft_lens
    toy_engine("ngram", ADAPTIVE, 2, 8, "toy")  # the fallback is said once per process
    said = capsys.readouterr().out
    assert said.count("no cost curve for these models") <= 1


# ---- the cost curve -------------------------------------------------------------------------

def test_the_cost_curve_is_measured_on_a_runner_and_round_trips_in_a_manifest(tmp_path: Path
                                                                             ) -> None:
    from trtspec.build.manifest import Artifact, Manifest, load_manifest

    target = MarkovLM(vocab_size=16, order=2, seed=1)
    curve = measure(ToyRunner(target), 5, {"draft_model": ToyRunner(target)}, context=8)
    assert sorted(curve.target) == [1, 2, 3, 4, 5] and min(curve.target.values()) > 0
    assert set(curve.draft) == {"draft_model"}
    costs, step = curve.relative("draft_model")
    assert costs[0] == 1.0 and step == curve.draft["draft_model"] / curve.target[1]
    assert curve.relative("layer_skip")[1] is None  # not measured
    manifest = Manifest(recipe="r", recipe_digest="d", backend="torch", versions={},
                        draft_lengths=[2], artifacts=[Artifact(name="target", role="target",
                                                               source="s", path="p")],
                        cost_curve=curve)
    manifest.save(tmp_path / "new")
    again = load_manifest(tmp_path / "new")
    assert again.cost_curve == curve and isinstance(next(iter(again.cost_curve.target)), int)
    old = json.loads((tmp_path / "new" / "manifest.json").read_text())
    del old["cost_curve"]  # written before the cost curve existed
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "manifest.json").write_text(json.dumps(old))
    assert load_manifest(tmp_path / "old").cost_curve is None


def test_the_chooser_takes_the_manifest_s_curve_else_measures_else_falls_back() -> None:
    said: list[str] = []
    curve = CostCurve(target={1: 10.0, 2: 11.0}, draft={"layer_skip": 4.0})
    from_manifest = chooser("layer_skip", 4, curve, say=said.append)
    assert from_manifest.cost[:3] == pytest.approx([1.0, 1.1, 1.2])
    assert from_manifest.draft_cost == pytest.approx(0.4)
    assert from_manifest.round_cost is None and "no round-cost table" in said.pop()
    with_rounds = chooser("layer_skip", 4, curve.model_copy(update={"rounds": TOY_ROUNDS}),
                          say=said.append)
    assert with_rounds.round_cost.table == RoundCost(TOY_ROUNDS).table and not said
    target = MarkovLM(vocab_size=16, order=2, seed=1)
    runner = ToyRunner(target)
    measured = chooser("draft_model", 3, None, runner, ToyRunner(target), say=said.append)
    assert len(measured.cost) == 4 and measured.draft_cost > 0
    chooser("draft_model", 3, None, runner, say=said.append)  # once per process and model
    assert sum("timing the models now" in s for s in said) <= 1
    fallback_ = chooser("suffix", 3, None, say=lambda _: None)
    assert fallback_.cost == pytest.approx([1.0, 1.02, 1.04, 1.06])
    assert fallback_.draft_cost == 0.0
    assert torch.tensor(measured.cost).diff().min() >= 0
