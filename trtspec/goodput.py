"""Goodput at an SLO: requests per second that meet it, and the speedup it gives a verdict.

Terms:

* **meets the SLO** — a request whose TTFT ≤ ``slo.ttft_ms`` and whose TPOT ≤ ``slo.tpot_ms``
  (:class:`trtspec.recipe_decide.Slo`; a limit left out is not checked, a one-token output has
  no TPOT and meets that part). TTFT and TPOT by the one definition,
  :class:`trtspec.metrics.RequestTiming`.
* **turn span** — the wall time one arm spent on one turn (``block``: the requests that ran
  together): the length of the union of the turn's request intervals [send, end] in that arm.
  The arms alternate turn by turn, so an arm's measured wall time is the sum of its turns'
  spans. At c = 1 a turn is one request and its span is its E2E; with c closed-loop clients
  the union runs from the first send to the last end. A union, not last end − first send: a
  turn resumed after an interruption has records from two runs, hours apart, and the gap
  between them is not time the arm spent.
* **goodput** of an arm — requests that met the SLO / the sum of its turns' spans (requests
  per second). With c closed-loop clients a faster arm finishes its turn sooner, so goodput
  counts both speed and the SLO; with open-loop arrivals the turn's arrivals are the same in
  both arms and goodput mostly counts the requests that met the SLO.
* **goodput speedup** — spec goodput / baseline goodput (> 1: speculation serves more requests
  within the SLO). Its CI is the same cluster bootstrap as every speedup
  (:mod:`trtspec.stats`): turns are resampled whole, so each carries its own span.

How a turn's span rides through a bootstrap that resamples per-pair values: each request
carries its share of its turn's span (span / requests in the turn, per arm), signed: positive
when it met the SLO, negative when it missed. A resampled set of whole turns then has
Σ|share| = the sum of their spans, and the count of positive shares = the requests that met.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from trtspec.gates import unit_of
from trtspec.metrics import RequestTiming
from trtspec.recipe_decide import Slo

Pair = tuple[dict[str, Any], dict[str, Any]]


def meets_slo(r: dict[str, Any], slo: Slo) -> bool:
    """Whether one record's request met ``slo`` (see the module docstring)."""
    t = RequestTiming.from_record(r)
    if slo.ttft_ms is not None and (t.ttft is None or t.ttft * 1e3 > slo.ttft_ms):
        return False
    return slo.tpot_ms is None or t.tpot is None or t.tpot * 1e3 <= slo.tpot_ms


def turn_spans(records: Sequence[dict[str, Any]]) -> dict[Any, tuple[float, int]]:
    """unit → (span in seconds, requests) of one arm's records, by :func:`unit_of`: the length
    of the union of the turn's request intervals (module docstring)."""
    intervals: dict[Any, list[tuple[float, float]]] = {}
    for r in records:
        t = RequestTiming.from_record(r)
        intervals.setdefault(unit_of(r), []).append((t.start, t.end))
    spans = {}
    for u, pieces in intervals.items():
        covered, reach = 0.0, -math.inf
        for start, end in sorted(pieces):
            if end > reach:
                covered += end - max(start, reach)
                reach = end
        spans[u] = (covered, len(pieces))
    return spans


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
             "the sum of its turns' spans (the time its requests ran: the union of their "
             "send-to-end intervals).", "",
             "| condition | pairs | baseline met | spec met | baseline req/s | spec req/s | "
             "spec / baseline |", "|---|---:|---:|---:|---:|---:|---:|"]
    for condition, t in table.items():
        ratio = t["spec_rps"] / t["baseline_rps"] if t["baseline_rps"] else float("nan")
        lines.append(f"| {condition} | {t['requests']} | {t['baseline_met']:.0%} | "
                     f"{t['spec_met']:.0%} | {t['baseline_rps']:.2f} | {t['spec_rps']:.2f} | "
                     f"{ratio:.2f}× |")
    return lines
