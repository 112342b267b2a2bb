"""The cost model against hand-computed cases."""

from __future__ import annotations

import pytest
from test_decide import record

from trtspec.analysis.cost_model import (
    alpha_from_al,
    cost_model,
    expected_emitted,
    leviathan,
    recommend_d,
)


def geometric_records(condition: str = "draft_model/D4/c1", c: float = 0.1, t: float = 0.040,
                      with_rejections: bool = True, n: int = 20) -> list[dict]:
    """Requests whose rounds follow i.i.d. acceptance a = 0.8 at D = 4 exactly: of 3125
    rounds, 625/500/400/320 accept 0/1/2/3 drafts and 1280 accept all 4 (3125·0.8^k·0.2 and
    3125·0.8^4). accepted = 7380, rejected rounds = 1845, proposed = 12500."""
    rounds, accepted, rejected, proposed = 3125, 7380, 1845, 12500
    emitted = accepted + rounds  # 10505: every round emits its accepted drafts + one token
    spec_tpot = rounds * (4 * c + 1) * t / emitted  # a round lasts D·c + 1 target steps
    out = []
    for i in range(n):
        spec = record(condition, "spec", f"r{i}", spec_tpot, n=emitted + 1, rounds=rounds,
                      proposed=proposed, accepted=accepted)
        if with_rejections:
            spec["rejected_rounds"] = rejected
        out += [record(condition, "baseline", f"r{i}", t, n=emitted + 1), spec]
    return out


def test_cost_model_a_is_the_per_token_acceptance_probability() -> None:
    """Hand-computed: a = 7380 / (7380 + 1845) = 0.8, while accepted / proposed = 0.5904;
    predicted = (1 − 0.8⁵) / (0.2 · (4·0.1 + 1)) = 3.3616 / 1.4 = 2.4011; the best D at
    c = 0.1 is 6 (2.4696 vs 2.4595 at D = 5 and 2.4477 at D = 7)."""
    model = cost_model(geometric_records(), "draft_model/D4/c1")
    assert model["alpha"] == pytest.approx(0.8)
    assert model["c"] == pytest.approx(0.1)
    assert model["predicted_speedup"] == pytest.approx(2.4011, abs=1e-4)
    assert model["measured_speedup"] == pytest.approx(2.4011, abs=1e-3)
    assert model["prediction_within_ci"]
    assert model["recommended_d"] == 6
    assert leviathan(0.8, 4, 0.0) == pytest.approx(3.3616)
    assert leviathan(0.5904, 4, 0.0) == pytest.approx(2.2663, abs=1e-4)  # the old, wrong one
    # records without rejected_rounds: a solved from AL = 10505 / 3125 = 3.3616
    old = cost_model(geometric_records(with_rejections=False), "draft_model/D4/c1")
    assert old["alpha"] == pytest.approx(0.8, abs=1e-6)
    assert alpha_from_al(3.3616, 4) == pytest.approx(0.8, abs=1e-6)
    for a, cc in ((0.7, 0.2), (0.9, 0.05), (0.5, 0.5), (0.95, 0.0)):
        best = recommend_d(a, cc)
        assert all(leviathan(a, best, cc) >= leviathan(a, k, cc) for k in range(1, 17))
    assert recommend_d(0.9, 0.05) > recommend_d(0.5, 0.5)
    assert recommend_d(0.1, 1.0) == 0  # (1 + 0.1) / 2 < 1: do not speculate
    # rounds that draft less: half of 2 rounds draft 4, the other none → 1 + ½·2.3616
    assert expected_emitted(0.8, [1, 1, 1, 1], 2) == pytest.approx(2.1808)
    assert expected_emitted(0.8, [5, 5, 5, 5], 5) == pytest.approx(leviathan(0.8, 4, 0.0))


def test_the_prediction_is_tested_against_the_verdict_s_figure_when_given() -> None:
    """decide passes the verdict's TPOT speedup and CI: the model tests its prediction (2.4011)
    against that one interval instead of computing a second one for the same figure; no
    interval (too few units) leaves the test undone (None), never a comparison with NaN."""
    records = geometric_records()
    inside = cost_model(records, "draft_model/D4/c1", measured=(2.30, (2.20, 2.45)))
    assert inside["measured_speedup"] == 2.30 and inside["measured_ci"] == [2.20, 2.45]
    assert inside["measured_from"] == "verdict" and inside["prediction_within_ci"] is True
    outside = cost_model(records, "draft_model/D4/c1", measured=(2.30, (2.20, 2.35)))
    assert outside["prediction_within_ci"] is False
    assert outside["alpha"] == pytest.approx(0.8) and outside["recommended_d"] == 6
    nan = float("nan")
    untested = cost_model(records, "draft_model/D4/c1", measured=(2.30, (nan, nan)))
    assert untested["prediction_within_ci"] is None
    few = cost_model(geometric_records(n=5), "draft_model/D4/c1")  # its own figure: 5 units
    assert few["measured_from"] == "tpot" and few["measured_units"] == 5
    assert few["measured_speedup"] == pytest.approx(2.4011, abs=1e-3)
    assert few["measured_ci"][0] != few["measured_ci"][0] and few["prediction_within_ci"] is None
