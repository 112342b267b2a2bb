"""gof: the chi-square goodness of fit's pooling and bins, and the least favourable difference
and power, by hand."""

from __future__ import annotations

import numpy as np
import pytest

from trtspec.analysis.gof import chi_square_gof, chi_square_power, gof_bins, least_favourable


def test_chi_square_pools_small_bins_and_flags_impossible_outcomes() -> None:
    _, dof, p = chi_square_gof([500, 300, 195, 4, 1], [0.5, 0.3, 0.197, 0.002, 0.001])
    assert dof == 2 and p > 0.5  # tail (3 expected) joins the smallest regular bin
    assert chi_square_gof([500, 300, 191, 5, 4], [0.5, 0.3, 0.191, 0.005, 0.004])[1] == 3
    assert chi_square_gof([10, 1], [1.0, 0.0])[2] == 0.0
    assert chi_square_gof([600, 400], [0.5, 0.5])[2] < 1e-9
    with pytest.raises(ValueError):
        chi_square_gof([1, 2], [1.0])


def test_bins_are_packed_under_the_cap_and_fixed_by_the_expected_counts() -> None:
    expected = [40, 10, 30, 6, 20, 2, 0]
    assert gof_bins(expected).tolist() == [0, 3, 1, 4, 2, 4, -1]  # 2 joins the smallest bin
    # at most 3 bins: the most probable keeps one (half the bins, rounded down), the others
    # are packed most probable first into the bin holding least (ties: the first):
    # 40 | 30 + 6 (36) | 20 + 10 + 2 (32): no mass is left in a tail
    assert gof_bins(expected, max_bins=3).tolist() == [0, 2, 1, 1, 2, 2, -1]
    stat, dof, _ = chi_square_gof([45, 9, 25, 7, 19, 3, 0], [e / 108 for e in expected],
                                  max_bins=3)
    assert dof == 2 and stat == pytest.approx(5**2 / 40 + 4**2 / 36 + 1**2 / 32)
    assert gof_bins([3, 3, 3], max_bins=20).tolist() == [0, 0, 0]  # 9 expected: one bin
    # a peaked target: a few large cells and many tiny ones. Pooling makes 6 bins, under the
    # cap: no bin of 0.5 expected (Pearson's statistic would then reject a right sampler
    # far more often than α)
    peaked = [300] * 4 + [680] + [0.5] * 40
    bins = gof_bins(peaked, max_bins=30)
    assert bins.max() == 5 and np.bincount(bins, peaked).min() == 20
    # over the cap (41 bins): 15 of their own, the other 25 cells of 50 and the 40 of 1 packed
    # into 15 bins, none of them under 5
    many = [50] * 40 + [1.0] * 40
    bins = gof_bins(many, max_bins=30)
    totals = np.bincount(bins, many)
    assert bins.max() == 29 and totals.min() >= 50 and totals[15:].max() <= 100


def test_least_favourable_difference_and_power_by_hand() -> None:
    # the split nearest ½: {0.5} gives 4; {0.3, 0.2} vs {0.5} the same; [0.6, 0.25, 0.15]:
    # best S = {0.6} or {0.25, 0.15} (0.4): 1/0.4 + 1/0.6
    assert least_favourable([0.5, 0.3, 0.2]) == pytest.approx(4.0)
    assert least_favourable([6, 2.5, 1.5]) == pytest.approx(1 / 0.4 + 1 / 0.6)
    assert least_favourable([1.0]) == float("inf")
    # 1 dof: power = Φ(√λ − z_{α/2}) + Φ(−√λ − z_{α/2}); at √λ = 1.96 + 0.8416, α 0.05: 0.80
    assert chi_square_power(1, (1.959964 + 0.841621) ** 2, 0.05) == pytest.approx(0.8, abs=1e-4)
    assert chi_square_power(5, 0.0, 1e-3) == pytest.approx(1e-3)
