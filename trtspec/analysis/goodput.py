"""Goodput at an SLO: requests per second that meet it, and the speedup it gives a verdict.

Terms:

* **meets the SLO** — a request whose TTFT ≤ ``slo.ttft_ms`` and whose TPOT ≤ ``slo.tpot_ms``
  (:class:`trtspec.build.recipe.decide.Slo`; a limit left out is not checked, a one-token output has
  no TPOT and meets that part). TTFT and TPOT by the one definition,
  :class:`trtspec.analysis.records.RequestTiming`.
* **turn window** — the arrival window of one arm's turn (``block``: the requests that ran
  together): from its first send to its last end. The arms alternate turn by turn, so an
  arm's measured time is the sum of its turns' windows. At c = 1 a turn is one request and
  its window is its E2E. A turn cut by an interruption is measured again whole, in both arms
  (:func:`trtspec.eval.run.cut_turns`), so a window never spans two runs.
* **goodput** of an arm — requests that met the SLO / the sum of its turns' windows (requests
  per second). What it measures depends on how requests arrive:

  - *closed loop* (c clients, each sending its next request when the last one ends): a
    faster arm ends its turn sooner, so goodput is the **capacity** the arm serves within
    the SLO;
  - *open loop* (``--request-rate``: arrivals at the same seeded offsets in both arms): the
    window is the arrivals' own span plus the last request's latency, nearly the same in
    both arms, so goodput is the **attainment** at the offered rate (the requests per second
    that met the SLO out of those offered), not how fast the arm idles between arrivals. A
    busy-time denominator (the union of the request intervals) would call an arm that
    answers each request in half the time twice the goodput at the same offered load.
* **goodput speedup** — spec goodput / baseline goodput (> 1: speculation serves more requests
  within the SLO). Its CI is the same cluster bootstrap as every speedup
  (:mod:`trtspec.analysis.stats`): turns are resampled whole, so each carries its own span.

How a turn's span rides through a bootstrap that resamples per-pair values: each request
carries its share of its turn's span (span / requests in the turn, per arm), signed: positive
when it met the SLO, negative when it missed. A resampled set of whole turns then has
Σ|share| = the sum of their spans, and the count of positive shares = the requests that met.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from trtspec.analysis.records import RequestTiming
from trtspec.analysis.units import unit_of
from trtspec.build.recipe.decide import Slo

Pair = tuple[dict[str, Any], dict[str, Any]]


def meets_slo(r: dict[str, Any], slo: Slo) -> bool:
    """Whether one record's request met ``slo`` (see the module docstring)."""
    t = RequestTiming.from_record(r)
    if slo.ttft_ms is not None and (t.ttft is None or t.ttft * 1e3 > slo.ttft_ms):
        return False
    return slo.tpot_ms is None or t.tpot is None or t.tpot * 1e3 <= slo.tpot_ms


def turn_spans(records: Sequence[dict[str, Any]]) -> dict[Any, tuple[float, int]]:
    """turn → (window in seconds, requests) of one arm's records, by :func:`unit_of`: from
    the turn's first send to its last end (module docstring)."""
    intervals: dict[Any, list[tuple[float, float]]] = {}
    for r in records:
        t = RequestTiming.from_record(r)
        intervals.setdefault(unit_of(r), []).append((t.start, t.end))
    return {u: (max(e for _, e in pieces) - min(s for s, _ in pieces), len(pieces))
            for u, pieces in intervals.items()}


def signed_shares(matched: Sequence[Pair], slo: Slo) -> list[tuple[float, float]]:
    """Per pair, (baseline, spec) signed shares of their turn's span (module docstring).

    Only the pairs given count: a turn whose other requests failed in one arm is spanned by
    the requests that have pairs, so both arms are timed over the same requests."""
    spans = [turn_spans([pair[arm] for pair in matched]) for arm in (0, 1)]

    def share(r: dict[str, Any], arm: int) -> float:
        span, n = spans[arm][unit_of(r)]
        value = max(span, 1e-9) / n
        return value if meets_slo(r, slo) else -value

    return [(share(b, 0), share(s, 1)) for b, s in matched]


def goodput_of(shares: np.ndarray) -> np.ndarray:
    """Requests per second that met the SLO, over the last axis of signed shares."""
    return (shares > 0).sum(-1) / np.abs(shares).sum(-1)


def goodput_ratio(b: np.ndarray, s: np.ndarray) -> np.ndarray:
    """spec / baseline goodput, over the last axis of signed shares (:func:`signed_shares`).
    Infinite or NaN when the baseline met the SLO in no request."""
    with np.errstate(divide="ignore", invalid="ignore"):
        return goodput_of(s) / goodput_of(b)


def goodput_table(records: Sequence[dict[str, Any]], slo: Slo,
                  pairs_of: Any) -> dict[str, dict[str, float]]:
    """Per condition: each arm's goodput (requests/s) and the fraction of its requests that met
    the SLO, over the paired requests (``pairs_of(records, condition)``, decide's pairing)."""
    table = {}
    for condition in sorted({r["condition"] for r in records}):
        matched = pairs_of(records, condition)
        if not matched:
            continue
        shares = np.array(signed_shares(matched, slo))  # [n, 2]
        table[condition] = {
            "baseline_rps": float(goodput_of(shares[:, 0])),
            "spec_rps": float(goodput_of(shares[:, 1])),
            "baseline_met": float((shares[:, 0] > 0).mean()),
            "spec_met": float((shares[:, 1] > 0).mean()),
            "requests": len(matched)}
    return table


def markdown_lines(table: dict[str, dict[str, float]] | None, slo: Slo | None) -> list[str]:
    """The report's "Goodput at the SLO" section (only when the recipe sets ``decide.slo``)."""
    if not table or slo is None:
        return []
    limits = " and ".join(f"{name} ≤ {value:g} ms" for name, value in
                          (("TTFT", slo.ttft_ms), ("TPOT", slo.tpot_ms)) if value is not None)
    lines = ["## Goodput at the SLO", "",
             f"Requests per second meeting {limits}, over the paired requests; an arm's time is "
             "the sum of its turns' arrival windows (first send to last end). Closed-loop "
             "clients: the capacity each arm serves within the SLO; open-loop arrivals: the "
             "attainment at the offered rate.", "",
             "| condition | pairs | baseline met | spec met | baseline req/s | spec req/s | "
             "spec / baseline |", "|---|---:|---:|---:|---:|---:|---:|"]
    for condition, t in table.items():
        ratio = f"{t['spec_rps'] / t['baseline_rps']:.2f}×" if t["baseline_rps"] else \
            "none: the baseline met the SLO in no request"
        lines.append(f"| {condition} | {t['requests']} | {t['baseline_met']:.0%} | "
                     f"{t['spec_met']:.0%} | {t['baseline_rps']:.2f} | {t['spec_rps']:.2f} | "
                     f"{ratio} |")
    return lines
