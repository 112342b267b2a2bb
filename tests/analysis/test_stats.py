"""stats: the cluster bootstrap's coverage under shared shocks, Holm and alpha spending by hand,
and the p-values at the levels they are judged at."""

from __future__ import annotations

import numpy as np
import pytest

from trtspec.analysis.stats import (
    cluster_replicates,
    holm,
    holm_threshold,
    look_alphas,
    percentile_interval,
    speedup_interval,
    spent,
)


def shocked(seed: int, turns: int = 24, size: int = 8, speedup: float = 1.2
            ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """TPOTs of turns that ran together: each arm's turn shares one shock (load on a shared
    machine), and each request adds its own noise. The spec arm is ``speedup`` faster, so the
    true ratio of the population medians is ``speedup``."""
    rng = np.random.default_rng(seed)
    turn = np.repeat(np.arange(turns), size)
    base = 0.05 * np.exp(rng.normal(0, 0.25, turns)[turn] + rng.normal(0, 0.1, turns * size))
    spec = 0.05 / speedup * np.exp(rng.normal(0, 0.25, turns)[turn]
                                   + rng.normal(0, 0.1, turns * size))
    return base, spec, turn


def test_turn_bootstrap_covers_the_true_speedup_where_the_request_bootstrap_does_not() -> None:
    covered = {"turn": 0, "request": 0}
    for seed in range(200):
        base, spec, turn = shocked(seed)
        for unit, units in (("turn", turn), ("request", np.arange(len(base)))):
            ci = speedup_interval(base, spec, units, 1.05, resamples=1000, seed=seed).ci
            covered[unit] += ci[0] <= 1.2 <= ci[1]
    print(f"95 % CI coverage over 200 replicates: turns {covered['turn'] / 200:.3f}, "
          f"requests one by one {covered['request'] / 200:.3f}")
    assert covered["turn"] >= 0.93 * 200
    assert covered["request"] < 0.80 * 200  # the naive CI is far too narrow here


def test_interval_and_p_values_by_hand() -> None:
    # every pair is exactly 2× faster: each resample's ratio of medians is 2, no spread
    iv = speedup_interval(np.array([2.0, 4, 6, 8]), np.array([1.0, 2, 3, 4]), [0, 0, 1, 1],
                          1.05, resamples=999)
    assert iv.point == 2.0 and iv.ci == pytest.approx((2.0, 2.0)) and iv.units == 2
    assert iv.p_go == 0.0 and iv.p_no_go == 1.0


def test_holm_by_hand() -> None:
    p = [0.01, 0.04, 0.03, 0.005]
    # sorted 0.005 ≤ 0.05/4, 0.01 ≤ 0.05/3, 0.03 > 0.05/2: stop; 0.04 is not tested
    assert holm(p, 0.05) == [True, False, False, True]
    assert [holm_threshold(p, i, 0.05) for i in range(4)] == pytest.approx(
        [0.05 / 3, 0.05, 0.05 / 2, 0.05 / 4])
    assert holm([0.02], 0.025) == [True] and holm([0.03], 0.025) == [False]


def test_alpha_spending_by_hand() -> None:
    assert spent(0.0) == 0 and spent(1.0) == pytest.approx(0.025)
    # Hwang–Shih–DeCani, γ = −2: α(e^{2t} − 1)/(e² − 1); e = 2.71828, e² − 1 = 6.38906
    assert spent(0.5) == pytest.approx(0.025 * 1.71828 / 6.38906, rel=1e-5)
    looks = look_alphas([8, 16, 24], 24)
    assert sum(looks) == pytest.approx(0.025)
    assert looks[0] == pytest.approx(0.025 * 0.947734 / 6.38906, rel=1e-5)  # e^{2/3} = 1.947734
    assert 0 < looks[0] < looks[1] < looks[2]  # most of α is spent late


def test_the_geomean_p_value_by_hand() -> None:
    """Three units (one pair each) whose log ratios are 0.1, 0.2, 0.6, against a threshold of
    1.0 (log 0): θ = 0.3, s = √(0.14 / 2) = 0.26458, se = s / √3 = 0.15275, T = 1.9640.
    Student's t with 2 degrees of freedom has a closed form, P(t₂ > T) = ½(1 − T / √(T² + 2))
    = 0.09425. The bootstrap-t's p is enumerated exactly over the 10 multisets of 3 draws
    (probability 3!/∏kᵢ! / 27 each), a multiset with no spread counting on both sides; the
    method's p is the larger of the two, and its Monte Carlo bootstrap-t is within 3 SE."""
    from itertools import combinations_with_replacement
    from math import factorial

    from trtspec.analysis.stats import geomean_of_ratios, mean_log_interval, ratio_se

    logs = np.array([0.1, 0.2, 0.6])
    theta, se = ratio_se(logs, np.ones(3))
    assert (theta, se) == pytest.approx((0.3, np.sqrt(0.07 / 3)))
    t_obs = theta / se
    p_t = 0.5 * (1 - t_obs / np.sqrt(t_obs ** 2 + 2))
    assert p_t == pytest.approx(0.09425, abs=1e-5)
    exact = 0.0
    for draw in combinations_with_replacement(range(3), 3):
        counts = [draw.count(i) for i in range(3)]
        prob = factorial(3) / np.prod([factorial(k) for k in counts]) / 27
        x = logs[list(draw)]
        if np.ptp(x) == 0:
            exact += prob  # no spread: supports neither side
        elif (x.mean() - theta) / (x.std(ddof=1) / np.sqrt(3)) >= t_obs:
            exact += prob
    _, _, _, p_go, _ = mean_log_interval(logs, np.ones(3), 1.0, resamples=40000)
    assert p_go >= p_t
    assert p_go == pytest.approx(max(p_t, exact), abs=3 * np.sqrt(exact * (1 - exact) / 40000))
    iv = speedup_interval(np.exp(logs), np.ones(3), [0, 1, 2], 1.0,
                          statistic=geomean_of_ratios, resamples=40000)
    assert iv.point == pytest.approx(np.exp(0.3)) and iv.p_go == pytest.approx(p_go, abs=0.01)
    assert iv.method == "t ∧ bootstrap-t" and iv.se == pytest.approx(se)


def test_unequal_units_by_hand() -> None:
    """Units of 2 and 1 pairs: θ = Σy / Σn = (0.1 + 0.3 + 0.5) / 3 = 0.3; residuals
    y − θn = 0.4 − 0.6 = −0.2 and 0.5 − 0.3 = 0.2; se = √(2 · 0.08) / 3 = 0.13333."""
    from trtspec.analysis.stats import ratio_se, unit_sums

    y, n = unit_sums(np.array([0.1, 0.3, 0.5]), ["a", "a", "b"])
    assert list(y) == pytest.approx([0.4, 0.5]) and list(n) == [2, 1]
    assert ratio_se(y, n) == pytest.approx((0.3, np.sqrt(0.16) / 3))


def test_the_new_p_value_holds_at_holm_s_first_level_where_the_old_one_does_not() -> None:
    """The power check of the calibration: at the boundary null (true speedup 1.05), 12 units
    with normal log ratios (sd 0.2), 4000 simulated cells, level 2.5e-3 (Holm's first over 10
    cells at 2.5 %): today's percentile bootstrap says GO several times too often (expected
    10; it gives ~47), the new p-value does not."""
    from trtspec.analysis.stats import geomean_of_ratios

    rng = np.random.default_rng(0)
    wrong = {"t ∧ bootstrap-t": 0, "percentile bootstrap": 0}
    for _ in range(4000):
        logs = np.log(1.05) + 0.2 * rng.standard_normal(12)
        base, spec = np.exp(logs), np.ones(12)
        wrong["t ∧ bootstrap-t"] += speedup_interval(
            base, spec, range(12), 1.05, statistic=geomean_of_ratios, resamples=2000).p_go \
            <= 2.5e-3
        reps = cluster_replicates(base, spec, range(12), geomean_of_ratios, 2000)
        wrong["percentile bootstrap"] += percentile_interval(
            float(np.exp(logs.mean())), reps, 12, "request", 1.05).p_go <= 2.5e-3
    print(f"wrong GO in 4000 at 2.5e-3 (10 expected): {wrong}")
    assert wrong["t ∧ bootstrap-t"] <= 1.5 * 10 + 2 * np.sqrt(15)
    assert wrong["percentile bootstrap"] >= 25
