"""The gates a verdict must pass besides the speedup: TTFT and E2E tail regression, GPU
memory headroom and greedy identity. Each returns (fails, holds, caveats) lists of reasons
in words; :mod:`trtspec.decide` turns them into verdicts.

* A latency gate's statistic is percentile_q(spec) / percentile_q(base) − 1 with a paired-
  bootstrap 95 % CI that resamples the independent unit (request or turn, see
  :mod:`trtspec.stats`). The percentile follows the sample: p99 from ``P99_MIN`` paired
  requests, p90 from ``P90_MIN``, the median below that (a p99 of 8 requests is their
  maximum). It fails only when the CI's lower bound exceeds the limit.
* Greedy identity: a spec output that differs from its baseline is a numerical tie when the
  target's logit margin between the two tokens at the first difference is within the tie
  margin, a divergence otherwise.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from trtspec.recipe import Decide
from trtspec.stats import MIN_UNITS, cluster_replicates, units_to_resolve

P99_MIN, P90_MIN = 100, 20  # paired requests a gate needs before it may use p99 / p90
Pair = tuple[dict[str, Any], dict[str, Any]]


def unit_of(r: dict[str, Any]) -> Any:
    """A record's independent unit: its turn (``block``, shared by the requests that ran
    together), or the request itself for records written before turns were recorded."""
    return r["block"] if r.get("block") is not None else ("request", r["request_id"])


def gate_percentile(n: int) -> int:
    """The percentile a latency gate can estimate from n paired requests."""
    return 99 if n >= P99_MIN else 90 if n >= P90_MIN else 50


def paired_regression(base: np.ndarray, spec: np.ndarray, q: float, resamples: int = 2000,
                      seed: int = 0, units: Sequence[Any] | None = None
                      ) -> tuple[float, tuple[float, float]]:
    """percentile_q(spec) / percentile_q(base) − 1 and its 95 % paired-bootstrap CI,
    resampling ``units`` (default: each request its own)."""
    def stat(b: np.ndarray, s: np.ndarray) -> np.ndarray:
        return np.percentile(s, q, axis=-1) / np.percentile(b, q, axis=-1) - 1

    units = list(range(len(base))) if units is None else units
    point = float(stat(base, spec))
    reps = cluster_replicates(base, spec, units, stat, resamples, seed)
    g = len(set(units))
    if g > 1:  # as for the speedup: a bootstrap of g units sees (g − 1)/g of their variance
        reps = point + (reps - point) * math.sqrt(g / (g - 1))
    low, high = np.percentile(reps, [2.5, 97.5])
    return point, (float(low), float(high))


def latency_gates(matched: list[Pair], criteria: Decide,
                   seed: int) -> tuple[list[str], list[str], list[str]]:
    """TTFT and E2E regression gates: (fails, holds, caveats). A CI above the limit fails; a
    CI that straddles it holds the verdict at INCONCLUSIVE when the estimate itself is over the
    limit, and is a caveat when the estimate is within it."""
    fails, holds, caveats = [], [], []
    for name, limit in (("ttft_s", criteria.max_ttft_p99_regression),
                        ("e2e_s", criteria.max_e2e_p99_regression)):
        both = [(b[name], s[name], unit_of(b)) for b, s in matched
                if b.get(name) is not None and s.get(name) is not None and b[name] > 0]
        if len(both) < 2:
            continue
        q = gate_percentile(len(both))
        stat = f"{name.removesuffix('_s').upper()} {'median' if q == 50 else f'p{q}'}"
        base, spec = np.array([x[0] for x in both]), np.array([x[1] for x in both])
        point, (low, high) = paired_regression(base, spec, q, seed=seed,
                                               units=[x[2] for x in both])
        span = f"95 % CI {100 * low:+.0f} … {100 * high:+.0f} %, limit {100 * limit:.0f} %"
        count = len({x[2] for x in both})
        if count < MIN_UNITS:  # a bootstrap of a few turns has no spread: nothing is shown
            if point > limit:
                holds.append(f"{stat} regression of {100 * point:+.0f} % measured on {count} "
                             f"independent turn(s) (< {MIN_UNITS}): not judged; measure more "
                             "turns")
            continue
        if low > limit:
            fails.append(f"{stat} regressed {100 * point:.0f} % ({span}, {len(both)} requests)")
            continue
        if high <= limit:
            continue
        n = units_to_resolve(len(both), point, (low, high), limit)
        more = f"about {n} paired requests would resolve it" if n else \
            "the estimate sits on the limit"
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
