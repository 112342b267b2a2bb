"""The cost model: what speculation should gain at the measured acceptance and draft cost.

Terms (Leviathan et al., who call the acceptance α; here it is **a**, so it is not confused
with the significance level α of the speedup tests):

* a — the per-token acceptance probability under i.i.d. acceptance, estimated as accepted /
  (accepted + rejected rounds) (the maximum-likelihood estimate; not the acceptance *rate*
  accepted / proposed, which at a = 0.8 and D = 4 is 0.59); stored under the key ``alpha``
  (decision.json, summary.json and MLflow read it by that name);
* c — the cost of one drafted token in target steps, from round times (a round with n drafts
  lasts 1 + n·c baseline steps);
* predicted speedup — expected tokens per round over its cost, (1 − a^(D+1)) / ((1 − a)(D·c + 1))
  when every round drafts D; rounds that draft less count as they were.

The report puts the prediction next to the measured TPOT speedup: the verdict's own figure and
95 % CI when the verdict judges TPOT (one figure, one interval), else a TPOT speedup and CI
computed here. A prediction inside that CI means the model explains the measurement, and its a
and c can plan other D; outside it, the model does not, and its recommended D is no guide.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from trtspec.analysis.extract import paired_speedup, pairs, tpot
from trtspec.analysis.records import condition_parts, failed
from trtspec.analysis.stats import MIN_UNITS, ratio_of_medians
from trtspec.analysis.units import independent_units


def leviathan(alpha: float, d: int, c: float) -> float:
    """Expected speedup with i.i.d. acceptance a (``alpha``), D drafts, draft/target step
    cost ratio c."""
    emitted = d + 1 if alpha >= 1.0 else (1 - alpha ** (d + 1)) / (1 - alpha)
    return emitted / (d * c + 1)


def recommend_d(alpha: float, c: float, max_d: int = 16) -> int:
    """The D that maximises the predicted speedup, or 0 (do not speculate) when none > 1."""
    best = max(range(1, max_d + 1), key=lambda d: leviathan(alpha, d, c))
    return best if leviathan(alpha, best, c) > 1.0 else 0


def alpha_from_al(al: float, d: int) -> float:
    """Solve AL = (1 − a^(D+1)) / (1 − a) for a (bisection; AL counts accepted + 1 per
    round). For records that lack rejected_rounds."""
    if d <= 0 or al <= 1.0:
        return 0.0
    if al >= d + 1:
        return 1.0
    low, high = 0.0, 1.0
    for _ in range(60):
        mid = (low + high) / 2
        if (1 - mid ** (d + 1)) / (1 - mid) < al:
            low = mid
        else:
            high = mid
    return (low + high) / 2


def expected_emitted(alpha: float, proposed_per_position: Sequence[int], rounds: int) -> float:
    """Tokens a round emits on average with i.i.d. acceptance a and the drafts as proposed:
    1 + Σᵢ P(a round drafts position i) · a^(i+1). With D drafts in every round this is
    Leviathan's (1 − a^(D+1)) / (1 − a); rounds that draft less (an n-gram with no match, a
    draft clipped by max_tokens) count as they were."""
    return 1 + sum(n / rounds * alpha ** (i + 1) for i, n in enumerate(proposed_per_position))


def cost_model(records: Sequence[dict[str, Any]], condition: str, seed: int = 0,
               statistic: Callable[[np.ndarray, np.ndarray], np.ndarray] = ratio_of_medians,
               measured: tuple[float, Sequence[float]] | None = None) -> dict[str, Any] | None:
    """a, c, and predicted vs measured TPOT speedup for one condition.

    a (key ``alpha``) is the per-token acceptance probability (SpecStats.alpha: accepted /
    (accepted + rejected rounds)); for older records without rejected_rounds it is solved from
    the pooled AL of the rounds, (accepted + rounds) / rounds. c is the cost of one drafted
    token in target steps, from time per round: a round with n drafts lasts 1 + n·c baseline
    steps, so c = (round / step − 1) / D̄ with D̄ the mean drafts per round. The prediction is
    :func:`expected_emitted` / (1 + D̄·c) (= Leviathan's formula when every round drafts D).
    An adaptive condition's ``draft_len`` is "adaptive" (its D̄ is ``mean_drafts``).

    ``measured``: (speedup, 95 % CI) of this condition's TPOT as its verdict has it; given, the
    prediction is tested against that interval (the report then shows one interval per figure),
    else a paired TPOT speedup and CI are computed here with ``statistic``.
    ``prediction_within_ci`` is None when there is no interval to test against. None when no
    pair can say.
    """
    from trtspec.spec.counters import SpecStats

    matched = pairs(records, condition)
    d = condition_parts(condition)[1]  # "adaptive": D varied per round (records say which)
    spec = [s for _, s in matched if s["verification_rounds"]]
    rounds = sum(s["verification_rounds"] for s in spec)
    accepted = sum(s["accepted_draft_tokens"] for s in spec)
    rejected = [s.get("rejected_rounds") for s in spec]
    positions: list[int] = []
    for s in spec:
        fixed = [s["verification_rounds"]] * d if isinstance(d, int) else []
        for i, n in enumerate(s.get("proposed_per_position") or fixed):
            positions += [0] * (i + 1 - len(positions))
            positions[i] += n
    if spec and None not in rejected:
        alpha = SpecStats(accepted_draft_tokens=accepted, rejected_rounds=sum(rejected)).alpha
        alpha = 0.0 if alpha != alpha else alpha  # nothing tried
    else:
        longest = d if isinstance(d, int) else len(positions)
        alpha = alpha_from_al((accepted + rounds) / rounds, longest) if rounds else 0.0
    both = [(b, s, tb, ts) for b, s in matched
            if s["verification_rounds"] and (tb := tpot(b)) is not None
            and (ts := tpot(s)) is not None]
    if not both:
        return None  # no paired request with speculation rounds and a TPOT
    mean_drafts = sum(positions) / rounds
    step = float(np.median([tb for *_, tb, _ in both]))
    round_time = float(np.median([(s["e2e_s"] - s["token_times_s"][0]) / s["verification_rounds"]
                                  for _, s, _, _ in both]))
    c = max(0.0, (round_time / step - 1) / mean_drafts) if mean_drafts else 0.0
    units = independent_units([b for b, *_ in both])[0]
    base, sped = np.array([tb for *_, tb, _ in both]), np.array([ts for *_, ts in both])
    if measured is not None:
        point, ci = measured
    elif len(set(units)) < MIN_UNITS:  # as decide: too few units for an interval
        point, ci = float(statistic(base, sped)), (float("nan"),) * 2
    else:
        point, ci = paired_speedup(base, sped, seed=seed, units=units, statistic=statistic)
    predicted = expected_emitted(alpha, positions, rounds) / (1 + mean_drafts * c)
    low, high = (float(x) for x in ci)
    within = None if low != low or high != high else \
        bool(low * (1 - 1e-6) <= predicted <= high * (1 + 1e-6))  # up to float rounding
    return {"alpha": alpha, "c": c, "draft_len": d, "mean_drafts": mean_drafts,
            "predicted_speedup": predicted, "measured_speedup": float(point),
            "measured_ci": [low, high], "measured_units": len(set(units)),
            "measured_from": "tpot" if measured is None else "verdict",
            "prediction_within_ci": within, "recommended_d": recommend_d(alpha, c)}


def cost_models(records: Sequence[dict[str, Any]], seed: int = 0,
                statistic: Callable[[np.ndarray, np.ndarray], np.ndarray] = ratio_of_medians,
                measured: dict[str, tuple[float, Sequence[float]]] | None = None
                ) -> dict[str, dict[str, Any]]:
    """:func:`cost_model` of every condition that speculated (D > 0, spec rounds recorded);
    ``measured``: condition → its verdict's (TPOT speedup, 95 % CI), when the verdicts judge
    TPOT."""
    models = {}
    for key in sorted({r["condition"] for r in records}):
        if not key.split("/")[1].endswith("D0") and any(
                r["condition"] == key and r["arm"] == "spec" and r["verification_rounds"]
                and not failed(r) for r in records):
            model = cost_model(records, key, seed, statistic, (measured or {}).get(key))
            if model is not None:
                models[key] = model
    return models
