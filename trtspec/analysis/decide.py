"""Go / no-go per condition, from paired records, with confidence intervals and a cost model.

The verdict comes from time per token, not acceptance: a setting that is accepted often but
costs more per round is a NO-GO. For each condition (method × D × concurrency), and for each
category within it:

* **speedup** of the recipe's ``decide.primary_metric``: ``tpot``, the geometric mean over
  requests of each request's baseline TPOT / spec TPOT (paired: a request's own length and
  context cancel, so a workload of unlike requests needs far fewer of them); ``tpot_p50``,
  ``e2e_p50`` and ``e2e_per_token_p50``, baseline / spec median of TPOT, E2E or E2E per output token
  (two benchmark runs' medians compared); ``goodput``, spec / baseline requests per second
  that meet ``decide.slo`` (:mod:`trtspec.analysis.goodput`). With a 95 % CI from a *paired*
  bootstrap that resamples the independent unit (:mod:`trtspec.analysis.stats`): the request at
  c = 1, where the arms alternate request by request; the turn (the requests that ran together,
  ``block``) at c > 1 or with open-loop arrivals, where requests share batches and shocks. Each
  resampled unit brings its baseline and spec measurements together (same prompt, seed). Fewer than
  ``MIN_UNITS`` units give no interval (INCONCLUSIVE, with how many more requests are needed).
* **the speedup tests**: one-sided p-values against ``min_speedup`` from the same replicates,
  judged over every cell of the report at once (Holm), so the chance of any wrong GO, and of
  any wrong NO-GO, stays ≤ α = 2.5 % (or the α of an eval's last look, ``--until-decided``).
* **gates** (:mod:`trtspec.analysis.gates`; each a statistic, never a single number):
  - TTFT and E2E regression = spec / baseline percentile − 1, with a paired-bootstrap 95 % CI.
    The percentile follows the sample: p99 from ``P99_MIN`` paired requests, p90 from
    ``P90_MIN``, the median below that (a p99 of 8 requests is their maximum). The gate fails
    only when the CI's lower bound exceeds the limit (a demonstrated regression). A CI that
    straddles the limit holds the verdict at INCONCLUSIVE when the estimate itself is over the
    limit, and leaves it standing with a caveat when the estimate is within it.
  - greedy identity (temperature 0): a spec output that differs from its baseline fails the
    gate unless, at the first difference, the target's logits of the two tokens are within the
    tie margin (a numerical near-tie; counted and reported apart); a difference whose margin
    was never measured holds the verdict at INCONCLUSIVE.
  - the method's exactness audit (``trtspec audit``) must pass; a weak audit (power below
    0.8 against its stated effect, few rejections seen, or no power stated) cannot support a
    GO.
  - on a GPU, peak memory must leave ``min_gpu_memory_headroom`` free.
  - a request that failed at an endpoint and was never measured again holds the verdict at
    INCONCLUSIVE (the failures may be the slowest requests).
* **verdict**: NO-GO when a gate fails or the speedup is shown below ``min_speedup``;
  GO when it is shown above and nothing holds; INCONCLUSIVE otherwise (a CI straddling
  ``min_speedup``, a CI that clears it but not at the family's level, too few requests or
  units, no audit where one is required). When the arms do not differ, noise moves a verdict
  between GO and INCONCLUSIVE, not to NO-GO.

The cost model (:mod:`trtspec.analysis.cost_model`) estimates a, the per-token acceptance
probability of Leviathan et al. (their α; a here, so it is not confused with the tests' significance
level α): accepted / (accepted + rejected rounds), the i.i.d. maximum-likelihood estimate, not the
acceptance *rate* accepted / proposed; and c, the cost of one drafted token in target steps
from round times; and predicts the speedup from the drafts as proposed (= (1 − a^(D+1)) /
((1 − a)(D·c + 1)) when every round drafts D) next to the measured one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from trtspec.analysis.extract import metric_values, pairs, statistic_for
from trtspec.analysis.gates import greedy_gate, latency_gates, memory_gate
from trtspec.analysis.records import unanswered
from trtspec.analysis.stats import (
    ALPHA,
    MIN_UNITS,
    RESAMPLES,
    Interval,
    bootstrap_floor,
    holm,
    holm_threshold,
    resamples_for,
    speedup_interval,
    units_at_level,
    units_for_floor,
    units_to_resolve,
)
from trtspec.analysis.units import independent_units
from trtspec.build.recipe import Decide

GO, NO_GO, INCONCLUSIVE = "GO", "NO-GO", "INCONCLUSIVE"


@dataclass
class Verdict:
    condition: str
    category: str  # "all" or a category
    verdict: str
    speedup: float
    ci: tuple[float, float]
    requests: int
    reasons: list[str] = field(default_factory=list)  # why not GO
    caveats: list[str] = field(default_factory=list)  # what a reviewer should know anyway
    greedy: dict[str, int] | None = None  # identical / ties / diverged, at temperature 0
    unit: str = "request"  # what the CI resampled: requests, or turns that ran together
    units: int = 0  # independent units behind the CI
    p_go: float = float("nan")  # one-sided p of H₀: speedup ≤ min_speedup
    p_no_go: float = float("nan")  # one-sided p of H₀: speedup ≥ min_speedup
    p: float = float("nan")  # the p of the side the estimate is on (p_go above, p_no_go below)
    level: float = float("nan")  # what p was compared with: α / (m − rank), Holm
    alpha: float = float("nan")  # the family-wise error per direction of its family
    family: int = 0  # cells judged together (Holm)
    requests_needed: int | None = None  # paired requests that would show it at ``level``

    @property
    def speedup_text(self) -> str:
        return "—" if self.speedup != self.speedup else f"{self.speedup:.2f}×"  # NaN: no pairs


def ci_text(v: Verdict | dict[str, Any], criteria: Decide | None = None) -> str:
    """A cell's 95 % CI, or "none: " and why it has none (a report never prints nan–nan).
    ``v``: a Verdict or its decision.json form."""
    low, high = v["ci"] if isinstance(v, dict) else v.ci
    if low == low and high == high:
        return f"{low:.2f}–{high:.2f}×"
    return f"none: {no_interval_why(v, criteria)}"


def ci_phrase(v: Verdict, criteria: Decide | None = None, name: str = "95 % CI") -> str:
    """"95 % CI 1.20–1.40×", or "no 95 % CI: " and why, for a sentence."""
    text = ci_text(v, criteria)
    return f"no {name}: {text.removeprefix('none: ')}" if text.startswith("none: ") else \
        f"{name} {text}"


def no_interval_why(v: Verdict | dict[str, Any], criteria: Decide | None = None) -> str:
    """Why a cell has no CI, from what decide found: no pairs, fewer than min_requests, no
    speedup to bound (goodput with a baseline that met the SLO nowhere), or fewer independent
    units than an interval needs."""
    get = v.get if isinstance(v, dict) else lambda name: getattr(v, name)
    n, speedup, units, unit = get("requests"), get("speedup"), get("units") or 0, get("unit")
    least = criteria.min_requests if criteria else None
    if not n:
        return "no paired requests"
    if least and n < least:
        return f"{n} paired requests < min_requests {least}"
    if speedup != speedup or speedup is None:
        return ("the baseline met the SLO in no request, so there is no ratio to bound"
                if criteria and criteria.primary_metric == "goodput" else
                "no speedup to bound" if least else
                "no speedup to bound (too few paired requests, or no ratio)")
    if units < MIN_UNITS:
        return f"{units} independent {unit or 'unit'}s < {MIN_UNITS}"
    return "the interval could not be computed"


@dataclass
class _Cell:
    """A cell before the family's speedup tests: its verdict so far and what it found."""

    verdict: Verdict
    interval: Interval | None
    fails: list[str]
    holds: list[str]
    per_unit: float  # paired requests per independent unit


def judge(records: Sequence[dict[str, Any]], condition: str, criteria: Decide,
          greedy: bool, category: str | None = None, seed: int = 0,
          audit: dict[str, Any] | None = None, needs_audit: bool = False,
          divergences: dict[tuple[str, str], dict[str, Any]] | None = None,
          alpha: float = ALPHA) -> Verdict:
    """One cell judged alone (a family of one): see :func:`decide`."""
    return _settle([_assess(records, condition, criteria, greedy, category, seed, audit,
                            needs_audit, divergences or {}, resamples_for(alpha))],
                   criteria, alpha)[0]


def _assess(records: Sequence[dict[str, Any]], condition: str, criteria: Decide,
            greedy: bool, category: str | None, seed: int, audit: dict[str, Any] | None,
            needs_audit: bool, divergences: dict[tuple[str, str], dict[str, Any]],
            resamples: int = RESAMPLES, interim: bool = False) -> _Cell:
    """Everything but the speedup test. ``audit`` is audit.json (None: not run);
    ``needs_audit``: no GO without it; ``divergences``: (condition, request id) → the eval's
    divergences.jsonl entry; ``interim``: a look of an ``--until-decided`` eval, which leaves
    the latency gates to the verdict taken at its end (tested once).

    Three kinds of finding: ``fails`` (a demonstrated problem: NO-GO), ``holds`` (not shown
    either way: INCONCLUSIVE at best) and ``caveats`` (the verdict stands; say it)."""
    matched = pairs(records, condition, category)
    metric = criteria.primary_metric
    kept = metric_values(matched, criteria)
    label = category or "all"
    lost = len(unanswered([r for r in records if r["condition"] == condition
                           and (category is None or r["category"] == category)]))
    holds = [f"{lost} request(s) failed at the endpoint and have no measurement (a failure "
             "can hide the slowest requests): resume the eval to measure them"] if lost else []
    nan = float("nan")
    if len(kept) < criteria.min_requests:
        return _Cell(Verdict(condition, label, INCONCLUSIVE, nan, (nan, nan), len(kept)),
                     None, [], [f"{len(kept)} paired requests < min_requests "
                                f"{criteria.min_requests}", *holds], 1.0)
    units, unit = independent_units([b for b, *_ in kept])
    base = np.array([k[2] for k in kept])
    spec = np.array([k[3] for k in kept])
    count = len(set(units))
    per_unit = len(kept) / count
    caveats = []
    if unit == "request" and any(b.get("block") is None for b, *_ in kept) \
            and int(condition.rsplit("/c", 1)[-1] or 1) > 1:
        caveats.append("these records name no turn (an older eval): the CI resamples requests "
                       "one by one and is too narrow if requests that ran together shared "
                       "shocks")
    statistic = statistic_for(metric)
    point = float(statistic(base, spec))
    if not np.isfinite(point):  # goodput: the baseline met the SLO in no request
        holds.insert(0, "the baseline met the SLO in no request: no goodput ratio (loosen "
                        "decide.slo or compare another metric)")
        point = float("nan")
    interval = speedup_interval(base, spec, units, criteria.min_speedup, unit, seed=seed,
                                statistic=statistic, resamples=resamples) \
        if count >= MIN_UNITS and point == point else None
    fails, gate_holds, gate_caveats = ([], [], []) if interim else \
        latency_gates(matched, criteria, seed)
    holds += gate_holds
    caveats += gate_caveats
    fails += memory_gate(matched, criteria)
    counts = None
    if greedy:
        counts, why, pending, note = greedy_gate(matched, criteria, divergences)
        fails += why
        holds += pending
        caveats += note
    method = condition.split("/")[0]
    audited = (audit or {}).get("methods", {}).get(method)
    if audited and not audited["passed"]:
        fails.append(f"exactness audit failed (p = {audited['p_value']:.2g} < "
                     f"{audited['threshold']:.2g}): the output distribution is not the "
                     "target's")
    if needs_audit and not audited:
        how = "--eval <eval dir>` (its servers, against each other)" if \
            method == "endpoint" else "<eval dir>`"
        holds.append(f"{method} has no exactness audit: run `trtspec audit {how} (or set "
                     "decide.require_audit: false)")
    if audited and audited.get("weak") and (audit or {}).get("kind") == "endpoint":
        holds.append(f"the endpoint's exactness audit is weak (power {audited['power']:.2f} "
                     f"against a total variation of {audited['effect']}, "
                     f"{audited.get('rejections', '?')} samples after a rejection): re-run "
                     "`trtspec audit --endpoint` with more --samples")
    elif audited and audited.get("weak"):
        why = (f"power {audited['power']:.2f} against a post-rejection total variation of "
               f"{audited['effect']} as the bins see it, {audited['recovered_samples']} "
               "samples with a recovered "
               "token" if "power" in audited else "too few rejections seen to test the "
               "residual")
        holds.append(f"the exactness audit of {method} is weak ({why}): re-run `trtspec "
                     "audit` with more --samples or a --prompt where drafts are rejected")
    elif audited and audited["passed"] and "power" not in audited:
        holds.append(f"the exactness audit of {method} was written by an earlier trtspec and "
                     "states no power: re-run `trtspec audit <eval dir>`")
    if count < MIN_UNITS:
        more = int(np.ceil((MIN_UNITS - count) * per_unit))
        holds.insert(0, f"{count} independent {unit}s (of {per_unit:.0f} request(s) each) are "
                        f"too few for an interval (< {MIN_UNITS}): measure about {more} more "
                        "paired requests")
    ci = interval.ci if interval else (nan, nan)
    verdict = Verdict(condition, label, INCONCLUSIVE, point, ci, len(kept), [], caveats, counts,
                      unit=unit, units=count,
                      p_go=interval.p_go if interval else nan,
                      p_no_go=interval.p_no_go if interval else nan)
    return _Cell(verdict, interval, fails, holds, per_unit)


def _settle(cells: list[_Cell], criteria: Decide, alpha: float, least: int = 0
            ) -> list[Verdict]:
    """The speedup tests of a family of cells, by Holm at family-wise error ``alpha`` per
    direction, then each cell's verdict: NO-GO when a gate fails or the speedup is shown below
    ``min_speedup``; GO when it is shown above and nothing holds; INCONCLUSIVE otherwise."""
    tested = [c for c in cells if c.interval is not None]
    m = criteria.min_speedup
    p_go = [c.interval.p_go for c in tested]
    p_no = [c.interval.p_no_go for c in tested]
    m_family = max(len(tested), least)  # cells it is counted as (≥ those tested here)
    go, no_go = holm(p_go, alpha, m_family), holm(p_no, alpha, m_family)
    shown: set[int] = set()  # ids of the cells whose speedup is shown above min_speedup
    holm_note = f" (Holm over {m_family} cells)" if m_family > 1 else ""
    for i, c in enumerate(tested):
        v, iv = c.verdict, c.interval
        assert iv is not None
        v.family, v.alpha = m_family, alpha
        span = f"CI {iv.ci[0]:.2f}–{iv.ci[1]:.2f}×"
        # the side the estimate is on: its p and the level Holm compared it with
        below = no_go[i] or (not go[i] and iv.point < m)
        v.p, v.level = (iv.p_no_go, holm_threshold(p_no, i, alpha, m_family)) if below else \
            (iv.p_go, holm_threshold(p_go, i, alpha, m_family))
        if no_go[i]:
            c.fails.append(f"speedup {span} is below {m:.2f}×: p = {v.p:.2g} ≤ "
                           f"{v.level:.2g}{holm_note}")
            continue
        if go[i]:
            shown.add(id(c))
            continue
        short = bootstrap_floor(iv.units) > v.level  # no number of resamples reaches it
        if short or (v.level < iv.p_floor and v.p <= 2 * iv.p_floor):  # not the evidence
            fix = (f"about {units_for_floor(v.level)} independent {iv.unit}s would reach it"
                   if short else "judge fewer cells at once (narrow the methods or D)")
            c.holds.insert(0, f"speedup {span}: with {iv.units} {iv.unit}s its p = {v.p:.2g} "
                              f"cannot go below {iv.p_floor:.2g} ({iv.method}) and the level "
                              f"is {v.level:.2g}{holm_note}: {fix}")
            continue
        needed = units_at_level(iv, m, v.level, v.p) if iv.se == iv.se else \
            units_to_resolve(iv.units, iv.point, iv.ci, m)
        v.requests_needed = int(np.ceil(needed * c.per_unit)) if needed else None
        more = (f"about {v.requests_needed} paired requests in all would show "
                f"it at p ≤ {v.level:.2g}, the level it is judged at, if the spread stays as "
                "measured" if needed else "the estimate sits on the threshold")
        if iv.ci[0] > m or iv.ci[1] < m:  # the 95 % CI clears it, the family's level does not
            c.holds.insert(0, f"speedup {span} is {'below' if below else 'above'} {m:.2f}× but "
                              f"not at the family-wise level: p = {v.p:.2g} > {v.level:.2g}"
                              f"{holm_note}; {more}")
        else:
            c.holds.insert(0, f"speedup {span} straddles {m:.2f}×: measure more requests "
                              f"({more})")
    for c in cells:
        c.verdict.verdict = NO_GO if c.fails else \
            GO if id(c) in shown and not c.holds else INCONCLUSIVE
        c.verdict.reasons = c.fails or c.holds
    return [c.verdict for c in cells]


def decide(records: Sequence[dict[str, Any]], criteria: Decide, greedy: bool, seed: int = 0,
           audit: dict[str, Any] | None = None, needs_audit: bool = False,
           divergences: Sequence[dict[str, Any]] = (),
           alphas: dict[str, float] | None = None,
           families: dict[str, int] | None = None, interim: bool = False) -> list[Verdict]:
    """A verdict per condition (category 'all') and per category within it.

    The speedup tests of every cell a report judges form one family: Holm keeps the chance of
    any wrong GO (and of any wrong NO-GO) ≤ α. ``alphas`` (condition → α) comes from an eval
    that looked at its data more than once (``--until-decided``): each condition is judged at
    the α its last look spent, and the cells of one look form a family, counted at least as
    large as ``families`` (condition → the family size it was tested in at that look: Holm
    over a family that later looks shrank would be too lenient). ``interim``: a look of an
    ``--until-decided`` eval (the latency gates wait for the verdict at its end).

    Bootstrap resamples are as many as the smallest level a cell can be judged at needs
    (:func:`trtspec.analysis.stats.resamples_for`), so a p-value's resolution never holds a
    verdict."""
    by_pair = {(d["condition"], d["request_id"]): d for d in divergences}
    keys = [(condition, category) for condition in sorted({r["condition"] for r in records})
            for category in [None, *sorted({r["category"] for r in records
                                            if r["condition"] == condition})]]
    smallest = min([*(alphas or {}).values(), ALPHA]) / max(
        [len(keys), *(families or {}).values()])
    cells = [_assess(records, condition, criteria, greedy, category, seed, audit, needs_audit,
                     by_pair, resamples_for(smallest), interim)
             for condition, category in keys]
    by_alpha: dict[float, list[_Cell]] = {}
    for c in cells:
        by_alpha.setdefault((alphas or {}).get(c.verdict.condition, ALPHA), []).append(c)
    for alpha, family in by_alpha.items():
        least = max(((families or {}).get(c.verdict.condition, 0) for c in family), default=0)
        _settle(family, criteria, alpha, least)
    return [c.verdict for c in cells]
