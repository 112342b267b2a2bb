"""stats: the cluster bootstrap's coverage under shared shocks, Holm and alpha spending by hand,
and the chi-square goodness of fit's pooling."""

from __future__ import annotations

import numpy as np
import pytest

from trtspec.stats import (
    chi_square_gof,
    holm,
    holm_threshold,
    look_alphas,
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
    # every pair is exactly 2× faster: each resample's ratio of medians is 2
    iv = speedup_interval(np.array([2.0, 4, 6, 8]), np.array([1.0, 2, 3, 4]), [0, 0, 1, 1],
                          1.05, resamples=999)
    assert iv.point == 2.0 and iv.ci == (2.0, 2.0) and iv.units == 2
    assert iv.p_go == pytest.approx(1 / 1000) and iv.p_no_go == 1.0  # (1 + 0) / (1 + 999)


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


def test_chi_square_pools_small_bins_and_flags_impossible_outcomes() -> None:
    _, dof, p = chi_square_gof([500, 300, 195, 4, 1], [0.5, 0.3, 0.197, 0.002, 0.001])
    assert dof == 2 and p > 0.5  # tail (3 expected) joins the smallest regular bin
    assert chi_square_gof([500, 300, 191, 5, 4], [0.5, 0.3, 0.191, 0.005, 0.004])[1] == 3
    assert chi_square_gof([10, 1], [1.0, 0.0])[2] == 0.0
    assert chi_square_gof([600, 400], [0.5, 0.5])[2] < 1e-9
    with pytest.raises(ValueError):
        chi_square_gof([1, 2], [1.0])
