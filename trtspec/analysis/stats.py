"""The statistics a verdict rests on: a paired speedup over independent units with p-values
that hold at the small levels they are compared with, Holm's step-down over the cells a
report judges, and alpha spending over repeated looks. (The chi-square goodness of fit that
samplers are judged by is :mod:`trtspec.analysis.gof`.)

Terms:

* **pair** — one request measured in both arms (same prompt, seed, sampling), a (baseline,
  spec) value of the primary metric.
* **unit** — the smallest group of pairs that is independent of the others. At c = 1 the arms
  alternate request by request and a request shares nothing with the next: the unit is the
  request. At c > 1 (or with open-loop arrivals) a turn's requests share batches, a machine's
  passing load and each other's timing, so the unit is the turn (``block`` in a record): a
  shock shared by a turn moves all of its requests at once, and resampling them one by one
  would count it many times as if it were independent evidence (a CI that is too narrow).
  Copies of one prompt (``--repeat``) share what makes the prompt fast or slow, so turns that
  share a prompt are one unit (:func:`trtspec.analysis.units.independent_units`).
* **speedup** — over the pairs, the geometric mean of each request's baseline / spec (the
  paired per-request speedup, primary metric ``tpot``), or median(baseline) / median(spec)
  (``tpot_p50``, ``e2e_p50``, ``e2e_per_token_p50``), or goodput's ratio.
* **p-values** — one-sided, against a threshold m: ``p_go`` tests H₀: speedup ≤ m against
  speedup > m (small: a GO is shown), ``p_no_go`` tests H₀: speedup ≥ m (small: a NO-GO is
  shown). They are compared with small levels (Holm's first level over a report's cells, an
  early look's spent α: 1e-3 and below), so they must be calibrated in the far tail with
  few units, where a percentile bootstrap of a mean behaves like a normal tail and is too
  liberal (13× nominal at 2.5e-4 with 12 units):

  - the geometric mean (``tpot``): θ = log speedup = Σy / Σn over G units, y a unit's sum of
    log(base / spec) and n its pairs; se = √(G/(G − 1) · Σ(y − θn)²) / Σn (cluster-robust;
    the plain standard error of the unit means when units are equal). Each p is the
    **larger** of two: Student's t, T = (θ − log m) / se against t with G − 1 degrees of
    freedom (exact for normal unit means, conservative for heavy symmetric tails), and the
    **bootstrap-t**, the share of cluster-bootstrap samples whose own (θ* − θ) / se* is as
    far out as T (second-order correct under skew, where Student's t is liberal: a
    long-tailed unit on the wrong side). Each covers the other's weak case; taking the larger
    keeps the level where either holds. The CI is the union of the two intervals, so it
    excludes m exactly when both p-values are below the level. No test of a mean is exact
    for every shape at G = 8: ``benchmarks/bench_calibration.py`` measures where this one
    holds.
  - any other statistic: Student's t with G − 1 degrees of freedom on log(statistic) and its
    cluster-bootstrap standard error (widened by √(G/(G − 1)): a bootstrap of G units sees
    (G − 1)/G of their variance). A statistic of 0 or a replicate of 0 (a spec arm that met
    an SLO nowhere) has no log: the percentile bootstrap then.
* **floor** — a bootstrap-t p cannot go below 1/(R + 1) for R resamples, nor below g·g⁻ᵍ with
  g units (:func:`bootstrap_floor`: 5·10⁻⁷ at 8 units, 1.6·10⁻² at 4); ``trtspec decide`` draws
  as many resamples as the smallest level it can compare with asks (:func:`resamples_for`),
  and a cell whose units cannot reach its level says how many would.
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
from typing import Any

import numpy as np

ALPHA = 0.025  # one-sided, per direction: a 95 % two-sided CI
RESAMPLES = 20000  # at least: p resolves to 5e-5 (more where a level asks, resamples_for)
SE_RESAMPLES = 5000  # a cluster-bootstrap standard error's
MAX_RESAMPLES = 1_000_000  # a million draws of a cell's units: seconds, not minutes
MIN_UNITS = 8  # fewer independent units: no interval (a bootstrap of 3 turns is not one)


@dataclass(frozen=True)
class Interval:
    """A paired speedup over independent units, with its CI and one-sided p-values."""

    point: float
    ci: tuple[float, float]
    units: int  # independent units behind it
    unit: str  # "request", "turn", "prompt" or "turn group"
    p_go: float  # H₀: speedup ≤ threshold
    p_no_go: float  # H₀: speedup ≥ threshold
    se: float = math.nan  # standard error of log(point) over units (nan: none)
    method: str = ""  # how p and the CI were made (module docstring)
    p_floor: float = 0.0  # the smallest p the method can give (its resamples' resolution)


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


def unit_sums(values: np.ndarray, units: Sequence[Hashable]) -> tuple[np.ndarray, np.ndarray]:
    """(y, n) [G]: each unit's sum of ``values`` and its number of pairs."""
    members = cluster_members(units)
    return (np.array([values[m].sum() for m in members]),
            np.array([len(m) for m in members], dtype=float))


def ratio_se(y: np.ndarray, n: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """θ = Σy / Σn over the G units of the last axis of y [..., G] (n [G] their pairs) and its
    cluster-robust standard error √(G/(G − 1) · Σ(y − θn)²) / Σn (the standard error of the
    mean of unit means when units are equal). Leading axes are independent samples (the
    calibration benchmark's simulated evals)."""
    g, total = y.shape[-1], n.sum()
    theta = y.sum(-1) / total
    resid = y - theta[..., None] * n
    return theta, np.sqrt(g / (g - 1) * np.sum(resid ** 2, -1)) / total


def bootstrap_t(y: np.ndarray, n: np.ndarray, resamples: int = RESAMPLES, seed: int = 0
                ) -> np.ndarray:
    """t* [R, ...] = (θ* − θ) / se* over ``resamples`` cluster-bootstrap samples of the units
    (multinomial counts w [R, G]), each with its own standard error (:func:`ratio_se`); NaN
    where a sample has no spread (every draw the same unit). Residuals e = y − θn are
    resampled rather than y, so a sample's Σw(y − θ*n)² = Σwe² − 2δΣwen + δ²Σwn² with
    δ = θ* − θ = Σwe / Σwn needs no difference of large numbers."""
    g = y.shape[-1]
    theta, _ = ratio_se(y, n)
    e = (y - theta[..., None] * n).reshape(-1, g)  # [S, G]
    scale = np.abs(e).max(-1) + 1e-300  # [S]: "no spread" is relative to the residuals
    rng = np.random.default_rng(seed)
    out = np.empty((resamples, len(e)))
    step = max(1, 4_000_000 // (g * len(e)))
    for i in range(0, resamples, step):
        r = min(step, resamples - i)  # multinomial counts [r, G] of r × G uniform draws
        draws = rng.integers(0, g, size=(r, g)) + g * np.arange(r)[:, None]
        w = np.bincount(draws.ravel(), minlength=r * g).reshape(r, g).astype(float)
        wn = (w @ n)[:, None]  # [r, 1]
        delta = (w @ e.T) / wn  # [r, S]
        q = w @ (e * e).T - 2 * delta * (w @ (e * n).T) + delta ** 2 * (w @ (n * n))[:, None]
        se = np.sqrt(np.maximum(q, 0.0) * g / (g - 1)) / wn
        with np.errstate(divide="ignore", invalid="ignore"):
            out[i:i + r] = np.where(se > 1e-12 * scale / wn, delta / se, np.nan)
    return out.reshape(resamples, *y.shape[:-1])


def mean_log_interval(y: np.ndarray, n: np.ndarray, threshold: float, level: float = 0.95,
                      resamples: int = RESAMPLES, seed: int = 0, interval: bool = True
                      ) -> tuple[Any, ...]:
    """(θ, (low, high), se, p_go, p_no_go) of the mean log ratio θ = Σy/Σn against log
    ``threshold``, over the last axis of y [..., G] (each leading index a sample of its own):
    each p is the larger of Student's t with G − 1 degrees of freedom and the bootstrap-t's,
    and the CI the union of theirs (module docstring: why both). A bootstrap-t replicate with
    no spread counts on both sides (it supports neither) and lies beyond either quantile.
    ``interval=False``: p-values only (the CI's quantiles cost most of the time in a batch)."""
    from scipy.stats import t as student

    g = y.shape[-1]
    theta, se = ratio_se(y, n)
    m = math.log(threshold)
    tail = (1 - level) / 2
    flat = se <= 1e-12 * np.maximum(np.abs(theta), 1)  # every unit the same (but rounding)
    with np.errstate(divide="ignore", invalid="ignore"):
        t_obs = np.where(flat, np.sign(theta - m) * np.inf, (theta - m) / se)
    t_star = bootstrap_t(y, n, resamples, seed)  # [R, ...]
    lost = np.isnan(t_star).sum(0)
    b_go = (1 + np.sum(t_star >= t_obs, 0) + lost) / (1 + resamples)
    b_no = (1 + np.sum(t_star <= t_obs, 0) + lost) / (1 + resamples)
    p_go = np.where(flat, (theta <= m) * 1.0, np.maximum(student.sf(t_obs, g - 1), b_go))
    p_no = np.where(flat, (theta >= m) * 1.0, np.maximum(student.cdf(t_obs, g - 1), b_no))
    if not interval:
        return theta, (np.nan, np.nan), se, p_go, p_no
    q = float(student.ppf(1 - tail, g - 1))
    hi_q = np.quantile(np.nan_to_num(t_star, nan=np.inf), 1 - tail, axis=0, method="higher")
    lo_q = np.quantile(np.nan_to_num(t_star, nan=-np.inf), tail, axis=0, method="lower")
    with np.errstate(invalid="ignore"):  # a flat sample: se 0 times an infinite quantile
        low = np.where(flat, theta, np.minimum(theta - q * se, theta - hi_q * se))
        high = np.where(flat, theta, np.maximum(theta + q * se, theta - lo_q * se))
    return theta, (low, high), se, p_go, p_no


def speedup_interval(base: np.ndarray, spec: np.ndarray, units: Sequence[Hashable],
                     threshold: float, unit: str = "request", level: float = 0.95,
                     resamples: int = RESAMPLES, seed: int = 0,
                     statistic: Callable[[np.ndarray, np.ndarray], np.ndarray] = ratio_of_medians
                     ) -> Interval:
    """``statistic(base, spec)`` (the ratio of medians unless given), its CI at ``level`` and
    its one-sided p-values against ``threshold``, over the independent ``units`` (module
    docstring: the geometric mean by Student's t and the bootstrap-t on unit sums of log
    ratios, any other statistic by Student's t on a cluster-bootstrap standard error)."""
    from scipy.stats import t as student

    g = len(set(units))
    point = float(statistic(base, spec))
    floor = max(1 / (1 + resamples), bootstrap_floor(g))
    if statistic is geomean_of_ratios and g > 1:
        y, n = unit_sums(np.log(base) - np.log(spec), units)
        # Most cells' p is far above any resolution: RESAMPLES give their p and CI, and only
        # a p within 20 resamples of that floor is drawn again at the resolution asked for
        first = min(resamples, RESAMPLES)
        theta, (lo, hi), se, p_go, p_no = mean_log_interval(y, n, threshold, level, first,
                                                            seed)
        if resamples > first and min(p_go, p_no) <= 20 / (first + 1):
            theta, (lo, hi), se, p_go, p_no = mean_log_interval(y, n, threshold, level,
                                                                resamples, seed)
        else:
            floor = max(1 / (1 + first), bootstrap_floor(g))
        return Interval(math.exp(theta), (math.exp(lo), math.exp(hi)), g, unit, float(p_go),
                        float(p_no), float(se), "t ∧ bootstrap-t", floor)
    # a standard error needs far fewer resamples than a tail count (its Monte Carlo error is
    # 1/√(2R): 1 % at SE_RESAMPLES); only the percentile fallback counts a tail
    reps = cluster_replicates(base, spec, units, statistic, SE_RESAMPLES, seed)
    if g > 1 and 0 < point < math.inf and np.all(reps > 0) and np.all(np.isfinite(reps)):
        logs = np.log(reps)
        se = float(np.std(logs, ddof=1) * math.sqrt(g / (g - 1)))
        q = float(student.ppf(1 - (1 - level) / 2, g - 1))
        lp = math.log(point)
        if se <= 1e-12:  # no spread (but for rounding)
            se, p_go, p_no = 0.0, float(point <= threshold), float(point >= threshold)
        else:
            t_obs = (lp - math.log(threshold)) / se
            p_go, p_no = float(student.sf(t_obs, g - 1)), float(student.cdf(t_obs, g - 1))
        return Interval(point, (math.exp(lp - q * se), math.exp(lp + q * se)), g, unit,
                        p_go, p_no, se, "t on a bootstrap standard error", 0.0)
    reps = cluster_replicates(base, spec, units, statistic, min(resamples, RESAMPLES), seed)
    return percentile_interval(point, reps, g, unit, threshold, level)


def percentile_interval(point: float, reps: np.ndarray, g: int, unit: str, threshold: float,
                        level: float = 0.95) -> Interval:
    """The percentile bootstrap (replicates widened by √(G/(G − 1)) on a log scale): kept for
    a statistic that is 0 or has replicates of 0 (a spec arm that met the SLO nowhere, where
    a log has no meaning), and as the method the calibration benchmark compares with."""
    resamples = len(reps)
    if g > 1 and 0 < point < math.inf:
        with np.errstate(divide="ignore"):  # (0 stays 0)
            reps = point * np.exp(np.log(reps / point) * math.sqrt(g / (g - 1)))
    reps = np.where(np.isfinite(reps), reps, np.nan)
    if np.isnan(reps).any():  # a replicate with no value (a zero median) supports neither side
        reps = np.nan_to_num(reps, nan=threshold)
    tail = (1 - level) / 2
    low, high = np.quantile(reps, [tail, 1 - tail])
    p_go = (1 + int(np.sum(reps <= threshold))) / (1 + resamples)
    p_no_go = (1 + int(np.sum(reps >= threshold))) / (1 + resamples)
    return Interval(point, (float(low), float(high)), g, unit, p_go, p_no_go, math.nan,
                    "percentile bootstrap", 1 / (1 + resamples))


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
    on the limit. (The latency gates' 95 % CIs; a speedup judged at a level of its own is
    sized by :func:`units_at_level`.)"""
    near = point - ci[0] if point > limit else ci[1] - point  # the side that crosses
    margin = abs(point - limit)
    if margin <= 0.01 * max(abs(limit), 1e-9):
        return None
    return max(units + 1, int(min(1e6, units * (near / margin) ** 2)) + 1)


def units_at_level(iv: Interval, limit: float, level: float, p: float | None = None
                   ) -> int | None:
    """Independent units at which a speedup measured as ``iv`` would be shown on its side of
    ``limit`` at one-sided ``level`` (the level the cell is judged at: Holm's, a look's): the
    smallest G' with t_{G'−1}(1 − level) · s / √G' ≤ |log point − log limit|, s = se·√G the
    per-unit spread, assuming both stay as measured. ``p``: the cell's p on that side, when a
    larger p than Student's t ruled (the bootstrap-t under skew): s is then the spread that
    Student's t would need to give that p, so the answer is sized by the p that decides.
    None when there is no spread or the estimate sits on the limit."""
    from scipy.stats import t as student

    margin = abs(math.log(iv.point) - math.log(limit)) if iv.point > 0 else math.inf
    if not (iv.se == iv.se and iv.se > 0) or margin <= 0.01 * max(abs(math.log(limit)), 0.01):
        return None
    s = iv.se * math.sqrt(iv.units)
    if p is not None and 0 < p < 0.5:  # the spread the deciding p implies
        s = max(s, margin * math.sqrt(iv.units) / float(student.isf(p, iv.units - 1)))

    def enough(g: int) -> bool:
        return float(student.ppf(1 - level, g - 1)) * s / math.sqrt(g) <= margin

    low, high = max(iv.units, 2), max(iv.units + 1, 3)
    while not enough(high):
        low, high = high, high * 2
        if high > 10**6:
            return None
    while high - low > 1:  # the smallest that is enough
        mid = (low + high) // 2
        low, high = (low, mid) if enough(mid) else (mid, high)
    return max(high, iv.units + 1)


def bootstrap_floor(g: int) -> float:
    """The least a bootstrap-t p can be with g units, however many resamples: a resample that
    draws one unit g times (probability g·g⁻ᵍ) has no spread and counts on both sides."""
    return math.exp((1 - g) * math.log(g)) if g > 1 else 1.0


def units_for_floor(level: float) -> int:
    """The fewest units whose bootstrap-t floor (:func:`bootstrap_floor`) is below ``level``."""
    g = 2
    while bootstrap_floor(g) > level:
        g += 1
    return g


def resamples_for(level: float) -> int:
    """Bootstrap resamples whose resolution 1/(R + 1) is a twentieth of ``level`` or finer, so
    a p-value's floor never stands between a cell and the level it is judged at (at most
    ``MAX_RESAMPLES``: a level below 2·10⁻⁵ is said to be out of reach instead)."""
    return min(MAX_RESAMPLES, max(RESAMPLES, math.ceil(20 / max(level, 1e-12))))
