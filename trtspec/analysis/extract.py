"""From records to the values a verdict compares: (baseline, spec) pairs of one request, each
pair's primary metric (TPOT, E2E, E2E per token, or goodput's signed shares), and the speedup
statistic over them with its paired-bootstrap CI.

Shared by ``decide`` and everything that re-reads records the way it does (the cost model, the
crossover, the report's plots), so a speedup means the same thing in each.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from trtspec.analysis.goodput import goodput_ratio, signed_shares
from trtspec.analysis.records import RequestTiming, failed
from trtspec.analysis.stats import geomean_of_ratios, ratio_of_medians, speedup_interval
from trtspec.build.recipe import Decide


def statistic_for(metric: str) -> Callable[[np.ndarray, np.ndarray], np.ndarray]:
    """The speedup statistic of a primary metric (see the module docstring)."""
    return {"tpot": geomean_of_ratios, "goodput": goodput_ratio}.get(metric, ratio_of_medians)


SPEEDUP_MEANS = {"tpot": "the geometric mean over requests of each one's baseline / spec TPOT",
                 "tpot_p50": "baseline / spec median TPOT",
                 "e2e_p50": "baseline / spec median E2E",
                 "e2e_per_token_p50": "baseline / spec median E2E per output token",
                 "goodput": "spec / baseline requests per second that meet decide.slo"}


def tpot(r: dict[str, Any]) -> float | None:
    """A record's TPOT, by the one definition in trtspec.analysis.records.RequestTiming."""
    return RequestTiming.from_record(r).tpot


def metric_of(r: dict[str, Any], name: str) -> float | None:
    """Per-request seconds (lower is better) the speedup compares: TPOT, E2E, or E2E per
    output token for ``e2e_per_token_p50`` (prefill included)."""
    if name == "e2e_p50":  # tpot and tpot_p50: TPOT (below)
        return r["e2e_s"]
    if name == "e2e_per_token_p50":
        return r["e2e_s"] / r["output_tokens"] if r["output_tokens"] else None
    return tpot(r)


def metric_values(matched: Sequence[tuple[dict[str, Any], dict[str, Any]]], criteria: Decide
                  ) -> list[tuple[dict[str, Any], dict[str, Any], float, float]]:
    """(baseline, spec, its value, spec's value) of the primary metric for the pairs that
    have one: seconds (TPOT, E2E, E2E per token), or goodput's signed shares of each turn's
    span (:mod:`trtspec.analysis.goodput`)."""
    if criteria.primary_metric == "goodput":
        return [(b, s, vb, vs) for (b, s), (vb, vs) in
                zip(matched, signed_shares(matched, criteria.slo), strict=True)]
    kept = [(b, s, metric_of(b, criteria.primary_metric), metric_of(s, criteria.primary_metric))
            for b, s in matched]
    return [k for k in kept if k[2] is not None and k[3] is not None and k[2] > 0 < k[3]]


def pairs(records: Sequence[dict[str, Any]], condition: str, category: str | None = None
          ) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(baseline, spec) records of the same request in one condition; a request that failed in
    either arm (an endpoint error) has no pair."""
    arms: dict[str, dict[str, dict[str, Any]]] = {"baseline": {}, "spec": {}}
    for r in records:
        if r["condition"] == condition and (category is None or r["category"] == category) \
                and not failed(r):
            arms[r["arm"]][r["request_id"]] = r
    return [(arms["baseline"][k], arms["spec"][k]) for k in sorted(arms["spec"])
            if k in arms["baseline"]]


def paired_speedup(base: np.ndarray, spec: np.ndarray, resamples: int = 2000, seed: int = 0,
                   units: Sequence[Any] | None = None, statistic: Callable[
                       [np.ndarray, np.ndarray], np.ndarray] = ratio_of_medians
                   ) -> tuple[float, tuple[float, float]]:
    """statistic(base, spec) (median(base) / median(spec) unless given) and its 95 %
    paired-bootstrap CI, resampling ``units`` (default: each request its own)."""
    units = list(range(len(base))) if units is None else units
    iv = speedup_interval(base, spec, units, 1.0, resamples=resamples, seed=seed,
                          statistic=statistic)
    return iv.point, iv.ci
