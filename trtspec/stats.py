"""The statistics a verdict rests on: a paired bootstrap that resamples the independent unit,
Holm's step-down over the cells a report judges, and alpha spending over repeated looks; and the
chi-square goodness of fit that the exactness audit and tests judge samplers by.

Terms:

* **pair** — one request measured in both arms (same prompt, seed, sampling), a (baseline,
  spec) value of the primary metric.
* **unit** — the smallest group of pairs that is independent of the others. At c = 1 the arms
  alternate request by request and a request shares nothing with the next: the unit is the
  request. At c > 1 (or with open-loop arrivals) a turn's requests share batches, a machine's
  passing load and each other's timing, so the unit is the turn (``block`` in a record): a
  shock shared by a turn moves all of its requests at once, and resampling them one by one
  would count it many times as if it were independent evidence (a CI that is too narrow).
* **speedup** — over the pairs, the geometric mean of each request's baseline / spec (the
  paired per-request speedup, primary metric ``tpot``), or median(baseline) / median(spec)
  (``tpot_p50``, ``e2e_p50``, ``throughput``); its CI resamples units with
  replacement, each bringing all of its pairs (a cluster bootstrap, percentile interval), with
  the replicates' log-distance from the estimate widened by √(G/(G − 1)) for G units (a
  bootstrap of G units sees (G − 1)/G of their variance; it matters at small G).
* **p-values** — one-sided, from the same replicates: ``p_go`` tests H₀: speedup ≤ m against
  speedup > m (small: a GO is shown), ``p_no_go`` tests H₀: speedup ≥ m (small: a NO-GO is
  shown), p = (1 + replicates on the wrong side) / (1 + replicates). A percentile CI at level
  1 − 2a has its lower bound above m when p_go < a, up to one replicate (the +1 and the
  quantile's interpolation), so the two agree but for a p within 1/R of the level.
* **Holm** — over the m cells of a report (conditions × categories), the family-wise error
  (the chance that any GO, or any NO-GO, is wrong) stays ≤ α: sort p ascending and reject while
  p₍ᵢ₎ ≤ α / (m − i + 1).
* **alpha spending** — an eval that looks at its data after each round of new requests and
  stops when decided spends α over the looks: with information fraction t = n / N (paired
  requests per condition now, over the budget N), the cumulative α is α·(e^{2t} − 1)/(e² − 1)
  (the Hwang–Shih–DeCani function, γ = −2) and each look tests at its increment.
  Testing each look at its increment (a Bonferroni bound over looks) is conservative and needs
  no assumption about how the looks correlate.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

import numpy as np

ALPHA = 0.025  # one-sided, per direction: a 95 % two-sided CI
RESAMPLES = 20000  # p resolves to 5e-5: Holm over ~12 cells at an early look's α ≈ 2.5e-3
MIN_UNITS = 8  # fewer independent units: no interval (a bootstrap of 3 turns is not one)


@dataclass(frozen=True)
class Interval:
    """A paired speedup over independent units, with its CI and one-sided p-values."""

    point: float
    ci: tuple[float, float]
    units: int  # independent units resampled
    unit: str  # "request" or "turn"
    p_go: float  # H₀: speedup ≤ threshold
    p_no_go: float  # H₀: speedup ≥ threshold


def cluster_members(units: Sequence[Hashable]) -> list[np.ndarray]:
    """Indices of the pairs in each unit, in first-seen order."""
    groups: dict[Hashable, list[int]] = {}
    for i, u in enumerate(units):
        groups.setdefault(u, []).append(i)
    return [np.array(v) for v in groups.values()]


def cluster_replicates(base: np.ndarray, spec: np.ndarray, units: Sequence[Hashable],
                       statistic, resamples: int = RESAMPLES, seed: int = 0) -> np.ndarray:
    """statistic(base, spec) over ``resamples`` cluster-bootstrap samples: units drawn with
    replacement, each with all of its pairs. ``statistic`` reduces the last axis of [n] arrays."""
    members = cluster_members(units)
    rng = np.random.default_rng(seed)
    draws = rng.integers(0, len(members), size=(resamples, len(members)))  # [R, G]
    sizes = {len(m) for m in members}
    if len(sizes) == 1:  # equal units (every request its own, or full turns): gathers of
        table = np.stack(members)  # [G, k]    at most ~4M values, however many requests
        step = max(1, 4_000_000 // table.size)
        return np.concatenate([np.asarray(statistic(base[idx], spec[idx])) for idx in (
            table[draws[i:i + step]].reshape(len(draws[i:i + step]), -1)  # [r, G·k]
            for i in range(0, resamples, step))])
    out = np.empty(resamples)
    for r in range(resamples):
        idx = np.concatenate([members[g] for g in draws[r]])
        out[r] = statistic(base[idx], spec[idx])
    return out


def ratio_of_medians(b: np.ndarray, s: np.ndarray) -> np.ndarray:
    """median(base) / median(spec): how two benchmark runs' medians compare."""
    return np.median(b, axis=-1) / np.median(s, axis=-1)


def geomean_of_ratios(b: np.ndarray, s: np.ndarray) -> np.ndarray:
    """exp(mean(log(base / spec))): the typical request's own speedup. Paired request by
    request, so what makes one request slow in both arms (its context length, its category)
    cancels; the ratio of medians keeps it, and needs several times the requests for the same
    interval on a workload whose requests differ."""
    return np.exp(np.mean(np.log(b) - np.log(s), axis=-1))


def speedup_interval(base: np.ndarray, spec: np.ndarray, units: Sequence[Hashable],
                     threshold: float, unit: str = "request", level: float = 0.95,
                     resamples: int = RESAMPLES, seed: int = 0,
                     statistic: Callable[[np.ndarray, np.ndarray], np.ndarray] = ratio_of_medians
                     ) -> Interval:
    """``statistic(base, spec)`` (the ratio of medians unless given), its cluster-bootstrap CI
    at ``level`` and its one-sided p-values against ``threshold``."""
    point = float(statistic(base, spec))
    reps = cluster_replicates(base, spec, units, statistic, resamples, seed)
    g = len(set(units))
    if g > 1 and 0 < point < math.inf:  # a bootstrap of g units has (g − 1)/g of their
        with np.errstate(divide="ignore"):  # variance: widen (on a log scale; 0 stays 0)
            reps = point * np.exp(np.log(reps / point) * math.sqrt(g / (g - 1)))
    reps = np.where(np.isfinite(reps), reps, np.nan)
    if np.isnan(reps).any():  # a replicate with no value (a zero median) supports neither side
        reps = np.nan_to_num(reps, nan=threshold)
    tail = (1 - level) / 2
    low, high = np.quantile(reps, [tail, 1 - tail])
    p_go = (1 + int(np.sum(reps <= threshold))) / (1 + resamples)
    p_no_go = (1 + int(np.sum(reps >= threshold))) / (1 + resamples)
    return Interval(point, (float(low), float(high)), len(set(units)), unit, p_go, p_no_go)


def holm(p_values: Sequence[float], alpha: float = ALPHA, m: int | None = None) -> list[bool]:
    """Which hypotheses Holm's step-down rejects at family-wise error ``alpha``; ``m`` counts
    the family as larger than the p-values given (the rest as never rejected: conservative)."""
    m = max(m or 0, len(p_values))
    order = sorted(range(len(p_values)), key=lambda i: p_values[i])
    rejected = [False] * len(p_values)
    for rank, i in enumerate(order):
        if p_values[i] > alpha / (m - rank):
            break
        rejected[i] = True
    return rejected


def holm_threshold(p_values: Sequence[float], i: int, alpha: float = ALPHA,
                   m: int | None = None) -> float:
    """The level hypothesis ``i`` is compared with in Holm's step-down (α / (m − rank))."""
    rank = sorted(range(len(p_values)), key=lambda j: p_values[j]).index(i)
    return alpha / (max(m or 0, len(p_values)) - rank)


def spent(t: float, alpha: float = ALPHA) -> float:
    """Cumulative α spent at information fraction t ∈ [0, 1]: the Hwang–Shih–DeCani function
    with γ = −2, α·(e^{2t} − 1)/(e² − 1). Why this shape: it spends little at early looks and
    most of α late (73 % of it after half the budget), so an eval that runs to its budget loses
    little power against a fixed-size one, yet an early look still has an α a bootstrap can
    reach (O'Brien–Fleming-type spends ≈ 1e-5 at a quarter of the budget: split over a report's
    cells, below any p of RESAMPLES replicates)."""
    t = min(max(t, 0.0), 1.0)
    return alpha * math.expm1(2 * t) / math.expm1(2)


def look_alphas(sizes: Sequence[int], budget: int, alpha: float = ALPHA) -> list[float]:
    """The α each look tests at: the increment of :func:`spent` from the previous look's
    paired requests per condition to this one's, with ``budget`` the most there can be."""
    out, before = [], 0.0
    for n in sizes:
        now = spent(n / budget, alpha)
        out.append(now - before)
        before = now
    return out


def units_to_resolve(units: int, point: float, ci: tuple[float, float], limit: float
                     ) -> int | None:
    """Independent units that would narrow a CI straddling ``limit`` until it excludes it,
    assuming the side that crosses the limit shrinks as 1/√units; None when the estimate sits
    on the limit."""
    near = point - ci[0] if point > limit else ci[1] - point  # the side that crosses
    margin = abs(point - limit)
    if margin <= 0.01 * max(abs(limit), 1e-9):
        return None
    return max(units + 1, int(min(1e6, units * (near / margin) ** 2)) + 1)


def chi_square_gof(counts: Sequence[float], probs: Sequence[float], min_expected: float = 5.0
                   ) -> tuple[float, int, float]:
    """Chi-square goodness of fit of observed counts against exact probabilities.

    Bins whose expected count is below ``min_expected`` are pooled into one tail bin (and joined
    to the smallest regular bin if the tail alone is still too small). A count in a bin of
    probability 0 is an impossible outcome: the p-value is 0. Returns (statistic, dof, p-value).
    """
    from scipy.stats import chi2

    obs = np.asarray(counts, dtype=float)
    p = np.asarray(probs, dtype=float)
    if obs.shape != p.shape:
        raise ValueError("counts and probs must have the same shape")
    if np.any(obs[p <= 0] > 0):
        return float("inf"), 0, 0.0
    n = obs.sum()
    exp = p / p.sum() * n
    big = exp >= min_expected
    o, e = list(obs[big]), list(exp[big])
    tail_o, tail_e = obs[~big & (p > 0)].sum(), exp[~big & (p > 0)].sum()
    if tail_e > 0:
        if tail_e < min_expected and e:
            i = int(np.argmin(e))
            o[i] += tail_o
            e[i] += tail_e
        else:
            o.append(tail_o)
            e.append(tail_e)
    o_arr, e_arr = np.array(o), np.array(e)
    dof = len(o_arr) - 1
    if dof < 1:
        return 0.0, 0, 1.0
    stat = float(((o_arr - e_arr) ** 2 / e_arr).sum())
    return stat, dof, float(chi2.sf(stat, dof))
