"""Goodness of fit against exact probabilities, and the power to see a stated difference: the
chi-square tests behind every exactness claim (the sampler's tests, the audits).

* :func:`gof_bins`          bins fixed from the exact P before counting, each expected ≥ 5
* :func:`chi_square_gof`    Pearson's statistic and p-value of counts against P, in those bins
* :func:`least_favourable`  the smallest noncentrality per unit of squared total variation over
                            the ways a difference can fall on the bins
* :func:`chi_square_power`  the noncentral chi-square power at a level
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np


def gof_bins(expected: Sequence[float], min_expected: float = 5.0,
             max_bins: int | None = None) -> np.ndarray:
    """The bin of each cell of a chi-square test, from the expected counts alone (so the bins
    are fixed before the counts are read); −1 for a cell of probability 0. Every bin expects
    ≥ ``min_expected`` (when the cells expect that much in all).

    A cell expected ≥ ``min_expected`` is a bin of its own, the rest pool into one tail bin,
    joined to the smallest bin when the tail expects < ``min_expected`` itself. When that
    makes more than ``max_bins`` bins: the most probable cells keep a bin of their own (half
    the bins at most), and the others are packed into as many of the remaining bins as keep
    each ≥ ``min_expected`` (most probable first, each into the bin that holds least so far),
    rather than most of the mass in one tail bin, where a difference would be invisible: an
    error that moves a likely token shows in its own bin, one spread thinly over many shows
    in the packed ones. Why a cap: each bin more adds a degree of freedom, which costs power
    against the least favourable difference of a given size (:func:`least_favourable`)."""
    e = np.asarray(expected, dtype=float)
    positive = np.flatnonzero(e > 0)
    bins = np.full(e.shape, -1)
    order = positive[np.argsort(-e[positive], kind="stable")]
    big = order[e[order] >= min_expected]
    rest = order[e[order] < min_expected]
    tail_alone = len(rest) > 0 and (e[rest].sum() >= min_expected or len(big) == 0)
    if max_bins is None or len(big) + tail_alone <= max_bins:
        bins[big] = np.arange(len(big))
        if len(rest):
            bins[rest] = len(big) if tail_alone else len(big) - 1  # big: most probable first
        return bins
    own = max_bins // 2
    bins[big[:own]] = np.arange(own)
    packed = order[own:]
    left = float(e[packed].sum())
    for k in range(max(1, min(max_bins - own, int(left // min_expected))), 0, -1):
        totals = np.zeros(k)
        for i in packed:
            j = int(np.argmin(totals))
            bins[i] = own + j
            totals[j] += e[i]
        if totals.min() >= min_expected or k == 1:
            break
    if left < min_expected:  # too little for a bin of its own: with the smallest own bin
        bins[packed] = own - 1
    return bins


def chi_square_gof(counts: Sequence[float], probs: Sequence[float], min_expected: float = 5.0,
                   max_bins: int | None = None) -> tuple[float, int, float]:
    """Chi-square goodness of fit of observed counts against exact probabilities, in the bins
    :func:`gof_bins` makes of them. A count in a cell of probability 0 is an impossible
    outcome: the p-value is 0. Returns (statistic, dof, p-value)."""
    from scipy.stats import chi2

    obs = np.asarray(counts, dtype=float)
    p = np.asarray(probs, dtype=float)
    if obs.shape != p.shape:
        raise ValueError("counts and probs must have the same shape")
    if np.any(obs[p <= 0] > 0):
        return float("inf"), 0, 0.0
    exp = p / p.sum() * obs.sum()
    bins = gof_bins(exp, min_expected, max_bins)
    used = bins >= 0
    o = np.bincount(bins[used], obs[used])
    e = np.bincount(bins[used], exp[used])
    dof = len(o) - 1
    if dof < 1:
        return 0.0, 0, 1.0
    stat = float(((o - e) ** 2 / e).sum())
    return stat, dof, float(chi2.sf(stat, dof))


def least_favourable(weights: Sequence[float]) -> float:
    """min over sets S of bins of 1/P(S) + 1/(1 − P(S)), P the bins' ``weights`` normalised:
    Σ Δ²/P of the least favourable difference Δ of total variation 1 between two
    distributions on these bins (scale by ε²). That Δ is +P_i/P(S) on S and −P_i/(1 − P(S))
    off it; by Cauchy–Schwarz no difference of that total variation has a smaller Σ Δ²/P, so
    a chi-square test's noncentrality N·ε²·(this) holds for every difference of size ε.
    Exact up to 40 bins (every subset sum, the two halves met in the middle); beyond, 4 (the
    value at P(S) = ½, never more than the minimum: the power it gives is a lower bound).
    inf with fewer than 2 bins."""
    w = np.asarray(weights, dtype=float)
    w = w[w > 0]
    if len(w) < 2:
        return math.inf
    if len(w) > 40:
        return 4.0
    p = w / w.sum()

    def subset_sums(x: np.ndarray) -> np.ndarray:
        sums = np.zeros(1)
        for v in x:
            sums = np.concatenate([sums, sums + v])
        return sums

    half = len(p) // 2
    left = subset_sums(p[:half])
    right = np.sort(subset_sums(p[half:-1]))  # the last bin outside S: S and its complement
    # give the same value
    want = 0.5 - left  # for each left sum, the right sum that would make P(S) = ½
    i = np.clip(np.searchsorted(right, want), 1, len(right) - 1)
    near = np.where(np.abs(right[i - 1] - want) <= np.abs(right[i] - want), right[i - 1],
                    right[i]) if len(right) > 1 else np.full_like(want, right[0])
    sums = left + near
    sums = sums[(sums > 1e-12) & (sums < 1 - 1e-12)]
    if not len(sums):  # the empty set was nearest for every left sum: a bin alone
        sums = np.array([p.min()])
    best = float(sums[np.argmin(np.abs(sums - 0.5))])
    return 1 / best + 1 / (1 - best)


def chi_square_power(dof: int, noncentrality: float, alpha: float) -> float:
    """P(noncentral χ²(dof, λ) > the level-α critical value of χ²(dof)): the chance a
    chi-square test at level α rejects when the truth is λ away; 0 without a test."""
    from scipy.stats import chi2, ncx2

    if dof < 1:
        return 0.0
    return float(ncx2.sf(chi2.isf(alpha, dof), dof, noncentrality))
