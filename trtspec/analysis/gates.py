"""The gates a verdict must pass besides the speedup: TTFT and E2E tail regression, GPU
memory headroom and greedy identity. Each returns (fails, holds, caveats) lists of reasons
in words; :mod:`trtspec.analysis.decide` turns them into verdicts.

* A latency gate's statistic is percentile_q(spec) / percentile_q(base) − 1 with a 95 %
  interval from order-statistic bounds on each arm's percentile (:func:`quantile_regression`):
  distribution-free for independent requests (c = 1); for turns whose requests share shocks
  the ranks come from a binomial over the number of units, scaled to the sample, which
  treats a turn as one observation (conservative when its requests are less alike than
  that, an approximation when turns differ in size). The percentile is the highest the
  sample can bound from above: p99 from ``P99_MIN`` independent units, p90 from ``P90_MIN``,
  else the median (so a recipe's ``max_*_p99_regression`` judges the tail the data can show,
  and the reason names it). It fails only when the interval's lower bound exceeds the limit,
  and is tested once per verdict: the looks of ``--until-decided`` leave it out.
* Greedy identity: a spec output that differs from its baseline is a numerical tie when the
  target's logit margin between the two tokens at the first difference is within the tie
  margin, a divergence otherwise.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from trtspec.analysis.stats import MIN_UNITS, units_to_resolve
from trtspec.analysis.units import independent_units
from trtspec.build.recipe import Decide

Pair = tuple[dict[str, Any], dict[str, Any]]


GATE_LEVEL = 0.95  # two-sided coverage of a latency gate's interval
_MISS = (1 - GATE_LEVEL) / 4  # each of the four order-statistic bounds behind it
# independent observations a gate needs to bound p99 / p90 from above (1 − q^n ≥ 1 − miss)
P99_MIN, P90_MIN = (math.ceil(math.log(_MISS) / math.log(q)) for q in (0.99, 0.90))


def order_bounds(values: np.ndarray, q: float, miss: float, effective: int | None = None
                 ) -> tuple[float, float]:
    """Distribution-free bounds on the q-quantile of what ``values`` were drawn from: order
    statistics X₍ₖ₎ ≤ Q_q ≤ X₍ⱼ₎, each missing with probability ≤ ``miss``: P(X₍ₖ₎ > Q_q) =
    P(Bin(n, q) < k) and P(X₍ⱼ₎ < Q_q) = P(Bin(n, q) ≥ j). A side no order statistic reaches
    is 0 or ∞. ``effective``: the number of independent units behind the values (turns whose
    requests share shocks count as fewer observations): the ranks come from Bin(effective, q),
    scaled to the sample."""
    from scipy.stats import binom

    x = np.sort(np.asarray(values, dtype=float))
    n = len(x)
    m = effective or n
    k = int(binom.ppf(miss, m, q))  # the smallest k with P(Bin ≤ k) ≥ miss: P(Bin < k) < miss
    j = int(binom.ppf(1 - miss, m, q)) + 1  # the smallest j with P(Bin ≥ j) ≤ miss
    low = x[max(int(np.floor(k * n / m)) - 1, 0)] if k >= 1 else 0.0
    high = x[min(int(np.ceil(j * n / m)), n) - 1] if j <= m else math.inf
    return float(low), float(high)


def gate_percentile(n: int) -> int:
    """The percentile a latency gate can bound from n independent observations: the highest
    of p99 (from ``P99_MIN``), p90 (from ``P90_MIN``) and the median whose upper
    order-statistic bound exists."""
    return 99 if n >= P99_MIN else 90 if n >= P90_MIN else 50


def quantile_regression(base: np.ndarray, spec: np.ndarray, q: float,
                        effective: int | None = None) -> tuple[float, tuple[float, float]]:
    """percentile_q(spec) / percentile_q(base) − 1 and an interval that covers the true one
    with probability ≥ ``GATE_LEVEL``: each side from order-statistic bounds of the two arms'
    quantiles (:func:`order_bounds`), each bound missing with probability ≤ (1 − level)/4
    (Bonferroni over the two arms and the two sides). No resampling, no normal tail: a p99
    of n values is a statement about ~n/100 of them, which a bootstrap cannot widen."""
    point = float(np.percentile(spec, q) / np.percentile(base, q) - 1)
    s_low, s_high = order_bounds(spec, q / 100, _MISS, effective)
    b_low, b_high = order_bounds(base, q / 100, _MISS, effective)
    low = s_low / b_high - 1 if b_high > 0 else -1.0
    high = s_high / b_low - 1 if b_low > 0 else math.inf
    return point, (low, high)


def latency_gates(matched: list[Pair], criteria: Decide,
                   seed: int) -> tuple[list[str], list[str], list[str]]:
    """TTFT and E2E regression gates: (fails, holds, caveats). A CI above the limit fails; a
    CI that straddles it holds the verdict at INCONCLUSIVE when the estimate itself is over the
    limit, and is a caveat when the estimate is within it. Tested once, on the records there
    are when the verdict is taken (an ``--until-decided`` eval's looks leave them out: a gate
    tested at every look would spend its α again each time)."""
    fails, holds, caveats = [], [], []
    for name, limit in (("ttft_s", criteria.max_ttft_p99_regression),
                        ("e2e_s", criteria.max_e2e_p99_regression)):
        both = [(b[name], s[name], b) for b, s in matched
                if b.get(name) is not None and s.get(name) is not None and b[name] > 0]
        if len(both) < 2:
            continue
        units = independent_units([x[2] for x in both])[0]
        count = len(set(units))
        q = gate_percentile(count)
        stat = f"{name.removesuffix('_s').upper()} {'median' if q == 50 else f'p{q}'}"
        base, spec = np.array([x[0] for x in both]), np.array([x[1] for x in both])
        point, (low, high) = quantile_regression(base, spec, q, count)
        shown_high = "∞" if high == math.inf else f"{100 * high:+.0f}"
        span = (f"{100 * GATE_LEVEL:.0f} % order-statistic CI {100 * low:+.0f} … {shown_high} "
                f"%, limit {100 * limit:.0f} %")
        if count < MIN_UNITS:  # too few to bound anything: nothing is shown
            if point > limit:
                holds.append(f"{stat} regression of {100 * point:+.0f} % measured on {count} "
                             f"independent unit(s) (< {MIN_UNITS}): not judged; measure more")
            continue
        if low > limit:
            fails.append(f"{stat} regressed {100 * point:.0f} % ({span}, {len(both)} requests)")
            continue
        if high <= limit:
            continue
        n = None if high == math.inf else units_to_resolve(len(both), point, (low, high), limit)
        # the 1/√n scaling is a rough guide for order-statistic bounds: beyond a hundred times
        # the requests there are, it is no guide at all (the bounds are distribution-free, and
        # wide for a tail quantile of few units)
        more = f"about {n} paired requests would resolve it" if n and n <= 100 * len(both) \
            else "the estimate sits on the limit" if abs(point - limit) < 0.01 else \
            f"far more requests would bound the tail ({stat} from {count} independent units)"
        if point > limit:
            holds.append(f"{stat} regression of {100 * point:+.0f} % measured but not "
                         f"demonstrated ({span}); {more}")
        else:
            caveats.append(f"{stat} regression of {100 * limit:.0f} % not ruled out (measured "
                           f"{100 * point:+.0f} %, {span}); {more}")
    return fails, holds, caveats


def memory_gate(matched: list[Pair], criteria: Decide
                 ) -> list[str]:
    peaks = [(s["cuda_max_allocated_mb"], s["cuda_total_mb"]) for _, s in matched
             if s.get("cuda_max_allocated_mb") is not None and s.get("cuda_total_mb")]
    if peaks:
        used, total = max(peaks)
        if 1 - used / total < criteria.min_gpu_memory_headroom:
            return [f"GPU memory headroom {100 * (1 - used / total):.0f} % < "
                    f"{100 * criteria.min_gpu_memory_headroom:.0f} % (peak "
                    f"{used / 1024:.1f} of {total / 1024:.1f} GiB)"]
    return []


TIE_MARGINS = {"float32": 0.01, "float16": 0.1, "bfloat16": 0.5}  # logits, by runner dtype


def tie_margin(criteria: Decide, dtype: str | None) -> float:
    """The logit margin under which a greedy divergence is a numerical tie: the recipe's
    ``greedy_tie_margin``, else one by the dtype the margin was measured in (a few ulps of a
    logit of magnitude ~20, with room for rounding that builds up over the layers)."""
    if criteria.greedy_tie_margin is not None:
        return criteria.greedy_tie_margin
    return TIE_MARGINS.get(dtype or "", TIE_MARGINS["bfloat16"])


def greedy_gate(matched: list[Pair], criteria: Decide,
                 divergences: dict[tuple[str, str], dict[str, Any]]
                 ) -> tuple[dict[str, int], list[str], list[str], list[str]]:
    """(counts, fails, holds, caveats). A spec output that differs from its baseline is a
    numerical tie when the target's logit margin between the two tokens at the first
    difference is within the tie margin, a divergence when it is not (or when one output
    stopped where the other went on), and unmeasured when the eval recorded no margin."""
    differ = [s for b, s in matched if b.get("output_digest") != s.get("output_digest")]
    ties = unmeasured = 0
    margins = set()
    for s in differ:
        d = divergences.get((s["condition"], s["request_id"]))
        if d is None:
            unmeasured += 1
        elif d.get("margin") is not None and d["margin"] <= tie_margin(criteria, d.get("dtype")):
            ties += 1
            margins.add(tie_margin(criteria, d.get("dtype")))
    n, diverged = len(matched), len(differ) - ties - unmeasured
    counts = {"identical": n - len(differ), "ties": ties, "diverged": diverged,
              "unmeasured": unmeasured}
    tol = "/".join(f"{m:g}" for m in sorted(margins))
    tie_text = f"{ties} at a numerical tie (logit margin ≤ {tol})"
    fails = [f"greedy identity {100 * (n - len(differ)) / n:.1f} %: {diverged} of {n} spec "
             "outputs differ from the baseline beyond a numerical tie"
             + (f" (+{tie_text})" if ties else "")] if diverged else []
    holds = [f"greedy identity: {unmeasured} of {n} spec outputs differ from the baseline "
             "with no logit margin recorded (an endpoint eval, or an eval stopped before "
             "measuring them: `--resume` it)"] if unmeasured else []
    caveats = [f"greedy identity: {n - ties} of {n} outputs identical, {tie_text}"] \
        if ties and not fails else []
    return counts, fails, holds, caveats
