"""Where speculation stops paying as more requests run at once: the concurrency crossover.

Speculation spends spare compute: at c = 1 the target's forward pass is memory-bound and
verifying D + 1 tokens costs about as much as one, but as the batch grows the pass becomes
compute-bound and the D drafted tokens per sequence cost real time. So the speedup falls with
concurrency, and a deployment wants the concurrency where it falls below ``min_speedup``.

Terms:

* **level**        a concurrency c the eval measured (closed-loop clients, ``c<c>`` in a
                   condition key ``method/D<d>/c<c>``)
* **speedup**      the verdict's speedup at a level (category "all", or a context bucket), with
                   its 95 % paired-bootstrap CI [lo, hi]
* **fit**          the weighted isotonic (non-increasing) regression of log speedup on the
                   levels, by pool-adjacent-violators (PAV). Weights are 1 / sd², where
                   sd = (log hi − log lo) / (2 · 1.96) is the standard error the CI implies in
                   log space. Non-increasing because more concurrent requests never leave more
                   spare compute for drafts; a measured rise is noise and is pooled away.
* **c\\***          the concurrency where the fitted speedup falls below ``min_speedup``:
                   linear interpolation in log c between the last level at or above it and the
                   first below; "above" the highest level when it never falls below, "below"
                   the lowest when it is below already at the first level.
* **c\\* CI**       95 % percentile interval of c* by parametric bootstrap: each level's log
                   speedup is redrawn from N(log speedup, sd²), refitted, c* recomputed; a
                   replicate that never falls below counts as +∞, one below at once as 0.
                   Widened to at least the two measured levels c* lies between: the
                   interpolation assumes the speedup is linear in log c inside that cell, and
                   nothing measured there says so.
* **schedule**     D per number of running requests, as ``trtspec serve`` runs it: at each
                   measured level the GO draft length with the highest CI lower bound (as
                   :func:`trtspec.analysis.policy.apply_where`), 0 where none is GO or the level is
                   above c* of that D.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from trtspec.analysis.records import condition_parts

Z95 = 1.959963984540054  # two-sided 95 % normal quantile
RESAMPLES = 1000  # parametric bootstrap replicates for the c* CI


@dataclass
class Curve:
    """Speedup against concurrency for one method, D and context bucket ("all": every
    request). ``levels`` are the measured levels with a speedup and a CI (others skipped);
    ``fitted`` the isotonic fit (speedup, not log); ``where`` is "between" (c* interpolated),
    "above" (never below min_speedup) or "below" (below already at the lowest level)."""

    method: str
    d: int | str
    bucket: str
    levels: list[int]
    speedup: list[float]
    ci: list[tuple[float, float]]
    fitted: list[float]
    where: str
    c_star: float | None
    c_star_ci: tuple[float | None, float | None]
    skipped: list[int] = field(default_factory=list)  # levels with no speedup or no CI

    @property
    def c_star_text(self) -> str:
        if self.where == "above":
            return f"above {self.levels[-1]} (the highest measured)"
        if self.where == "below":
            return f"below {self.levels[0]} (the lowest measured)"
        return f"{self.c_star:.1f}"

    @property
    def ci_text(self) -> str:
        low, high = self.c_star_ci
        if high is not None and high < self.levels[0]:  # every replicate below at once
            return f"< {self.levels[0]}"
        lo = f"{low:.1f}" if low is not None else f"< {self.levels[0]}"
        hi = f"{high:.1f}" if high is not None else f"> {self.levels[-1]}"
        return f"{lo} – {hi}"


@dataclass
class Schedule:
    """Per method: D per measured level (``(c, D)``, 0 = plain decoding) and the c* of the D
    it runs at its last speculating level (the crossover where speculation turns off)."""

    method: str
    schedule: list[tuple[int, int | str]]
    c_star: float | None
    c_star_ci: tuple[float | None, float | None]
    where: str | None  # as Curve.where; None: no curve for that D


def pava(y: Sequence[float], w: Sequence[float]) -> np.ndarray:
    """Weighted least-squares non-increasing fit of ``y`` (pool-adjacent-violators): adjacent
    blocks that violate the order are merged into their weighted mean until none does."""
    blocks: list[list[float]] = []  # [weighted mean, weight, count]
    for yi, wi in zip(y, w, strict=True):
        blocks.append([float(yi), float(wi), 1])
        while len(blocks) > 1 and blocks[-2][0] < blocks[-1][0]:  # a rise: pool
            m2, w2, n2 = blocks.pop()
            m1, w1, n1 = blocks.pop()
            blocks.append([(m1 * w1 + m2 * w2) / (w1 + w2), w1 + w2, n1 + n2])
    return np.concatenate([np.full(int(n), m) for m, _, n in blocks])


def crossing(levels: Sequence[int], fitted_log: Sequence[float], threshold: float
             ) -> tuple[str, float | None]:
    """("between", c*), ("above", None) or ("below", None) for a fitted log-speedup curve
    against log ``threshold`` (see the module docstring)."""
    limit = math.log(threshold)
    below = next((i for i, f in enumerate(fitted_log) if f < limit), None)
    if below is None:
        return "above", None
    if below == 0:
        return "below", None
    f0, f1 = fitted_log[below - 1], fitted_log[below]
    x0, x1 = math.log(levels[below - 1]), math.log(levels[below])
    t = (f0 - limit) / (f0 - f1)
    return "between", math.exp(x0 + t * (x1 - x0))


def fit_curve(method: str, d: int | str, bucket: str, points: Sequence[tuple[int, float,
              tuple[float, float]]], threshold: float, seed: int = 0,
              resamples: int = RESAMPLES) -> Curve | None:
    """The curve of (level, speedup, CI) points; None when fewer than 2 levels have a speedup
    and a CI (NaN speedups, missing CIs and zero-width CIs are skipped)."""
    kept, skipped = [], []
    for c, s, (lo, hi) in sorted(points, key=lambda p: p[0]):
        ok = all(x == x and x > 0 for x in (s, lo, hi)) and hi > lo
        (kept if ok else skipped).append((c, s, (lo, hi)) if ok else c)
    if len(kept) < 2:
        return None
    levels = [p[0] for p in kept]
    y = np.log([p[1] for p in kept])
    sd = np.array([(math.log(hi) - math.log(lo)) / (2 * Z95) for _, _, (lo, hi) in kept])
    w = 1 / sd ** 2
    fitted = pava(y, w)
    where, c_star = crossing(levels, fitted, threshold)
    rng = np.random.default_rng(seed)
    draws = []
    for _ in range(resamples):
        side, c = crossing(levels, pava(rng.normal(y, sd), w), threshold)
        draws.append(c if side == "between" else math.inf if side == "above" else 0.0)
    low, high = (float(np.quantile(draws, q, method="inverted_cdf")) for q in (0.025, 0.975))
    if where == "between":  # nothing was measured inside the cell c* lies in: the speedup may
        i = next(i for i, c in enumerate(levels) if c > c_star)  # bend anywhere in it
        low, high = min(low, levels[i - 1]), max(high, levels[i])
    ci = (low if low > 0 else None, high if math.isfinite(high) else None)
    return Curve(method, d, bucket, levels, [p[1] for p in kept], [p[2] for p in kept],
                 [float(math.exp(f)) for f in fitted], where, c_star, ci, skipped)


def curves(verdicts: Sequence[Any], threshold: float, seed: int = 0,
           bucketed: dict[str, list[tuple[str, tuple[float, float], float]]] | None = None
           ) -> list[Curve]:
    """A curve per method and D from the verdicts (category "all"; Verdict objects or
    decision.json dicts), plus one per context bucket from ``bucketed`` (condition → [(bucket,
    CI, speedup)], see :func:`bucket_speedups`)."""
    points: dict[tuple[str, int | str, str], list[tuple[int, float, tuple[float, float]]]] = {}
    for v in verdicts:
        v = v if isinstance(v, dict) else asdict(v)
        if v["category"] != "all":
            continue
        method, d, c = condition_parts(v["condition"])
        points.setdefault((method, d, "all"), []).append((c, v["speedup"], tuple(v["ci"])))
        for bucket, ci, s in (bucketed or {}).get(v["condition"], []):
            points.setdefault((method, d, bucket), []).append((c, s, ci))
    out = [fit_curve(m, d, b, p, threshold, seed) for (m, d, b), p in points.items()]
    return sorted((c for c in out if c), key=lambda c: (c.method, str(c.d), c.bucket != "all",
                                                        c.bucket))


def schedules(verdicts: Sequence[Any], fits: Sequence[Curve]) -> dict[str, Schedule]:
    """Per method, D per measured level: the GO D with the highest CI lower bound (as
    :func:`trtspec.analysis.policy.apply_where`), 0 where none is GO or the level is above c* of
    that D's curve ("all" bucket)."""
    from trtspec.analysis.decide import GO

    rows = [v if isinstance(v, dict) else asdict(v) for v in verdicts]
    rows = [v for v in rows if v["category"] == "all"]
    by_key = {(c.method, c.d): c for c in fits if c.bucket == "all"}
    out = {}
    for method in sorted({condition_parts(v["condition"])[0] for v in rows}):
        mine = [(condition_parts(v["condition"]), v) for v in rows
                if condition_parts(v["condition"])[0] == method]
        plan: list[tuple[int, int | str]] = []
        for level in sorted({p[2] for p, _ in mine}):
            go = [(p[1], v) for p, v in mine if p[2] == level and v["verdict"] == GO]
            best = max(go, key=lambda g: (_low(g[1]["ci"][0]), g[1]["speedup"]), default=None)
            d: int | str = 0
            if best is not None:
                curve = by_key.get((method, best[0]))
                if curve is None or curve.where == "above" or (
                        curve.where == "between" and level <= curve.c_star):
                    d = best[0]
            plan.append((level, d))
        last = next((d for _, d in reversed(plan) if d != 0), None)  # the D that turns off
        curve = by_key.get((method, last)) if last is not None else None
        out[method] = Schedule(method, plan, curve.c_star if curve else None,
                               curve.c_star_ci if curve else (None, None),
                               curve.where if curve else None)
    return out


def _low(x: float) -> float:
    return x if x == x else float("-inf")


BUCKET_EDGES = (256, 1024, 4096, 16384)  # context tokens: < 256, 256–1023, …


def bucket_of(tokens: int | None) -> str | None:
    """A context-length bucket name for a prompt of ``tokens`` tokens (None: unknown)."""
    if tokens is None:
        return None
    low = 0
    for edge in BUCKET_EDGES:
        if tokens < edge:
            return f"context {low}–{edge - 1}"
        low = edge
    return f"context ≥ {BUCKET_EDGES[-1]}"


def bucket_speedups(records: Sequence[dict[str, Any]], criteria: Any, seed: int = 0
                    ) -> dict[str, list[tuple[str, tuple[float, float], float]]]:
    """Per condition and context bucket (by each request's ``context_tokens``): the paired
    speedup of the primary metric and its 95 % CI, with decide's values, statistic and unit
    (only buckets with ≥ ``criteria.min_requests`` pairs; nothing when every request falls in
    one bucket)."""
    from trtspec.analysis.extract import metric_values, paired_speedup, pairs, statistic_for
    from trtspec.analysis.stats import MIN_UNITS
    from trtspec.analysis.units import independent_units

    if len({bucket_of(r.get("context_tokens")) for r in records} - {None}) < 2:
        return {}
    out: dict[str, list[tuple[str, tuple[float, float], float]]] = {}
    for condition in sorted({r["condition"] for r in records}):
        groups: dict[str, list[tuple[dict[str, Any], dict[str, Any]]]] = {}
        for b, s in pairs(records, condition):
            if name := bucket_of(b.get("context_tokens")):
                groups.setdefault(name, []).append((b, s))
        for name, matched in sorted(groups.items()):
            rows = metric_values(matched, criteria)
            units = independent_units([r[0] for r in rows])[0]
            if len(rows) >= criteria.min_requests and len(set(units)) >= MIN_UNITS:  # as decide
                point, ci = paired_speedup(np.array([r[2] for r in rows]),
                                           np.array([r[3] for r in rows]), seed=seed,
                                           units=units,
                                           statistic=statistic_for(criteria.primary_metric))
                out.setdefault(condition, []).append((name, ci, point))
    if len({name for cells in out.values() for name, _, _ in cells}) < 2:
        return {}  # one bucket with enough requests: its curve is the overall one again
    return out


def crossover(verdicts: Sequence[Any], records: Sequence[dict[str, Any]], criteria: Any,
              seed: int = 0) -> dict[str, Any] | None:
    """decision["crossover"]: the curves and schedules (JSON-ready), or None when the eval
    measured fewer than 2 concurrency levels."""
    levels = sorted({condition_parts(v.condition if not isinstance(v, dict) else
                                     v["condition"])[2] for v in verdicts})
    if len(levels) < 2:
        return None
    bucketed = bucket_speedups(records, criteria, seed)
    fits = curves(verdicts, criteria.min_speedup, seed, bucketed)
    plans = schedules(verdicts, fits)
    return {"min_speedup": criteria.min_speedup, "levels": levels,
            "curves": [asdict(c) | {"c_star_text": c.c_star_text, "ci_text": c.ci_text}
                       for c in fits],
            "schedules": {m: asdict(s) for m, s in plans.items()}}


def markdown_lines(cross: dict[str, Any] | None) -> list[str]:
    """The report's "Concurrency crossover" section (nothing when it does not apply)."""
    if not cross:
        return []
    m = cross["min_speedup"]
    lines = ["## Concurrency crossover", "",
             f"Speedup per concurrency level c with its 95 % CI, the non-increasing fit "
             "(weighted isotonic regression of log speedup, weights from the CI widths) and "
             f"c* = where the fit falls below {m:.2f}× (interpolated in log c), with a 95 % "
             "parametric-bootstrap CI (each level redrawn within its CI, refitted).", ""]
    if not cross["curves"]:
        return lines + ["No curve: fewer than 2 levels of any condition have a speedup and a "
                        "CI (measure more requests per level)."]
    lines += ["| method | D | context | " + " | ".join(f"c={c}" for c in cross["levels"])
              + " | fitted | c* | c* 95 % CI |",
              "|---|---|---|" + "---:|" * len(cross["levels"]) + "---|---|---|"]
    for c in cross["curves"]:
        by_level = dict(zip(c["levels"], zip(c["speedup"], c["ci"], strict=True), strict=True))
        cells = [_cell(*by_level[level]) if level in by_level else "—"
                 for level in cross["levels"]]
        fitted = ", ".join(f"{f:.2f}" for f in c["fitted"])
        lines.append(f"| {c['method']} | {c['d']} | {c['bucket']} | " + " | ".join(cells)
                     + f" | {fitted} | {c['c_star_text']} | {c['ci_text']} |")
    lines += ["", "Schedule (D per number of running requests; 0 = plain decoding, and above "
              "the last level measured): the GO D with the highest CI lower bound at each "
              "level, 0 above that D's c*.", ""]
    for method, s in cross["schedules"].items():
        plan = ", ".join(f"{c}: {d}" for c, d in s["schedule"])
        lines.append(f"- **{method}**: {plan}")
    return lines


def _cell(speedup: float, ci: Sequence[float]) -> str:
    return f"{speedup:.2f}× ({ci[0]:.2f}–{ci[1]:.2f})"
