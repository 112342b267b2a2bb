"""What a round costs: the build's table (padding to a cheaper width, rows interpolated and
extended, bad tables refused) and the round clock (a cell's first rounds, the EMA with spikes
clipped, ratios observed or the table's scaled, stale baselines, forgetting), by hand."""

from __future__ import annotations

import pytest

from trtspec.spec.round_cost import RoundClock, RoundCost

TOY_ROUNDS = {1: {1: 1.0, 2: 1.1, 3: 1.5, 4: 1.2, 5: 1.6},
              2: {1: 1.2, 2: 2.0, 3: 2.2, 4: 2.4, 5: 2.6}}


def test_round_cost_pads_to_a_cheaper_width_and_interpolates_rows() -> None:
    cost = RoundCost({b: {w: 10 * t for w, t in ws.items()} for b, ws in TOY_ROUNDS.items()})
    assert [cost.width(1, w) for w in range(1, 6)] == [1, 2, 4, 4, 5]  # 1.2 ≤ 0.95 · 1.5
    assert cost.time(1, 3) == pytest.approx(1.2) and cost.time(2, 3) == pytest.approx(2.2)
    assert cost.time(2, 6) == pytest.approx(2.95)  # past the table: the row's mean slope,
    # (2.6 − 1.2) / 4 a token
    assert RoundCost({1: {1: 1.0, 2: 0.5}}).width(1, 1) == 1  # plain decoding: never padded
    assert cost.time(4, 1) == pytest.approx(2.4)  # past the rows: in proportion (2 × 1.2)
    mid = RoundCost({1: {1: 1.0}, 3: {1: 2.0}})
    assert mid.time(2, 1) == pytest.approx(1.5)
    with pytest.raises(ValueError, match="t\\(1 row, 1 token\\)"):
        RoundCost({2: {1: 1.0}})
    with pytest.raises(ValueError, match="round cost for 1 rows: give widths 1 … n"):
        RoundCost({1: {1: 1.0, 2: 1.1, 4: 1.3}})


def test_the_round_clock_by_hand() -> None:
    """A cell counts from its third round (the median of three), then an EMA with spikes
    clipped; observed ratios where both were timed; else the table's ratio scaled by how far
    the widths timed at those rows (else the nearest rows) were off it; plain rounds are due
    where they do not count yet or after ``refresh`` speculative ones; old cells forgotten."""
    def model(b: int, w: int) -> float:  # the table: a width costs 10 % a token, any B
        return 1 + 0.1 * (w - 1)

    def times(clock: RoundClock, rows: int, width: int, *seconds: float) -> None:
        for t in seconds:
            clock.observe(rows, width, t)

    clock = RoundClock(rate=0.5, refresh=3)
    assert clock.relative(4, 3, model) == pytest.approx(1.2) and not clock.stale(4)
    times(clock, 4, 1, 0.5, 0.10, 0.12)  # a cold first round: the median of three is 0.12
    assert clock.seconds[4, 1] == pytest.approx(0.12) and not clock.stale(4)
    times(clock, 4, 1, 0.10)  # EMA: 0.12 + 0.5 · (0.10 − 0.12)
    assert clock.get(4, 1) == pytest.approx(0.11)
    assert clock.relative(4, 3, model) == pytest.approx(1.2)  # no width timed: the table's
    times(clock, 4, 3, 0.165, 0.165)
    assert clock.get(4, 3) is None  # two rounds do not count yet
    assert clock.relative(4, 3, model) == pytest.approx(1.2)
    times(clock, 4, 3, 0.165)  # 1.5 × plain where the table said 1.2: off by 1.25
    assert clock.relative(4, 3, model) == pytest.approx(1.5)
    assert clock.relative(4, 5, model) == pytest.approx(1.4 * 1.25)
    assert clock.relative(2, 5, model) == pytest.approx(1.4 * 1.25)  # the nearest rows' scale
    assert clock.relative(4, 1, model) == 1.0
    assert clock.stale(4)  # three speculative rounds since the last plain one (refresh 3)
    assert clock.stale(2)  # 2 rows: no plain round counts there yet
    times(clock, 4, 1, 0.11)
    assert not clock.stale(4)
    times(clock, 4, 3, 10.0)  # a pause: counts as 2 × the EMA (0.165 → 0.165 + 0.5 · 0.165)
    assert clock.get(4, 3) == pytest.approx(0.2475)
    short = RoundClock(forget=4)
    times(short, 1, 1, 0.1, 0.1, 0.1)
    times(short, 1, 3, 0.3, 0.3, 0.3)
    assert short.relative(1, 3, model) == pytest.approx(3.0)
    times(short, 1, 1, 0.1, 0.1, 0.1, 0.1)  # width 3 not timed in the last 4 rounds: forgotten
    assert short.get(1, 3) is None and short.relative(1, 3, model) == pytest.approx(1.2)
    times(short, 1, 3, 0.2, 0.2)  # and starts again: three rounds before it counts
    assert short.get(1, 3) is None
    times(short, 1, 3, 0.2)
    assert short.relative(1, 3, model) == pytest.approx(2.0)
    misses = RoundClock()  # width 0: rounds asked for drafts that got none, apart from
    times(misses, 4, 1, 0.1, 0.1, 0.1)  # plain ones (their lookups cost), never scaled
    assert misses.relative(4, 0, lambda b, w: 1.0) == 1.0  # not timed yet: a plain round
    times(misses, 4, 0, 0.13, 0.13, 0.13)
    assert misses.relative(4, 0, lambda b, w: 1.0) == pytest.approx(1.3)
    assert misses.relative(4, 3, model) == pytest.approx(1.2)  # the table's: width 0 scales
    # nothing
