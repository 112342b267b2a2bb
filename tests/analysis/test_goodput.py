"""goodput: requests per second that meet an SLO, by hand, and the verdicts it gives."""

from __future__ import annotations

import numpy as np
import pytest
from pydantic import ValidationError

from trtspec.analysis.decide import GO, INCONCLUSIVE, decide, judge
from trtspec.analysis.extract import pairs
from trtspec.analysis.goodput import goodput_ratio, goodput_table, meets_slo, signed_shares
from trtspec.build.recipe import Decide, Slo

SLO = Slo(ttft_ms=100, tpot_ms=50)
CRITERIA = Decide(primary_metric="goodput", slo=SLO, min_requests=8, min_speedup=1.05)


def record(arm: str, rid: str, ttft: float, tpot: float, n: int = 11, start: float = 0.0,
           block: str | None = None, condition: str = "ngram/D4/c1") -> dict:
    times = [ttft + i * tpot for i in range(n)]
    return {"condition": condition, "arm": arm, "request_id": rid, "category": "c",
            "block": block, "start_s": start, "token_times_s": times, "output_tokens": n,
            "e2e_s": times[-1], "ttft_s": ttft, "output_digest": "x", "verification_rounds": 0}


def test_meets_slo_checks_each_limit_it_has() -> None:
    assert meets_slo(record("spec", "a", 0.09, 0.04), SLO)
    assert not meets_slo(record("spec", "a", 0.11, 0.04), SLO)  # TTFT 110 ms > 100
    assert not meets_slo(record("spec", "a", 0.09, 0.06), SLO)  # TPOT 60 ms > 50
    assert meets_slo(record("spec", "a", 0.09, 9.0, n=1), SLO)  # one token: no TPOT
    assert meets_slo(record("spec", "a", 5.0, 0.04), Slo(tpot_ms=50))
    with pytest.raises(ValidationError, match="ttft_ms, tpot_ms or both"):
        Slo()
    with pytest.raises(ValidationError, match=r"set decide\.slo"):
        Decide(primary_metric="goodput")


def test_goodput_by_hand_one_request_a_turn() -> None:
    """c = 1, four requests an arm. Baseline: TTFT 50 ms, TPOT 40 ms for r0, r1 (met) and 60 ms
    for r2, r3 (missed), 11 tokens → E2E 0.45 / 0.65 s; goodput 2 / (2·0.45 + 2·0.65) =
    2 / 2.2 = 0.909 rps. Spec: TPOT 20 ms for r0–r2 (met, E2E 0.25 s), r3 TTFT 150 ms
    (missed, E2E 0.35 s); goodput 3 / (3·0.25 + 0.35) = 3 / 1.1 = 2.727 rps; ratio 3.0."""
    recs = []
    for i, (bt, (st, sf)) in enumerate(zip([0.04, 0.04, 0.06, 0.06],
                                            [(0.02, 0.05)] * 3 + [(0.02, 0.15)], strict=True)):
        recs += [record("baseline", f"r{i}", 0.05, bt), record("spec", f"r{i}", sf, st)]
    matched = pairs(recs, "ngram/D4/c1")
    shares = np.array(signed_shares(matched, SLO))
    assert shares[:, 0] == pytest.approx([0.45, 0.45, -0.65, -0.65])
    assert shares[:, 1] == pytest.approx([0.25, 0.25, 0.25, -0.35])
    assert float(goodput_ratio(shares[:, 0], shares[:, 1])) == pytest.approx(3.0)
    row = goodput_table(recs, SLO, pairs)["ngram/D4/c1"]
    assert row["baseline_rps"] == pytest.approx(2 / 2.2) and row["spec_rps"] == pytest.approx(
        3 / 1.1)
    assert (row["baseline_met"], row["spec_met"]) == (0.5, 0.75)


def test_a_turn_is_timed_from_its_first_send_to_its_last_end() -> None:
    """Two requests in one turn at c = 2: baseline sent at 10.0 and 10.1, ending 10.45 and
    10.75 (span 0.75 s, 0.375 each); one met. Spec sent at 20.0 and 20.0, ending 20.25 and
    20.25 (span 0.25 s), both met. Goodput 1/0.75 vs 2/0.25: ratio 6."""
    recs = [record("baseline", "a", 0.05, 0.04, start=10.0, block="t0", condition="x/D2/c2"),
            record("baseline", "b", 0.05, 0.06, start=10.1, block="t0", condition="x/D2/c2"),
            record("spec", "a", 0.05, 0.02, start=20.0, block="t0", condition="x/D2/c2"),
            record("spec", "b", 0.05, 0.02, start=20.0, block="t0", condition="x/D2/c2")]
    shares = np.array(signed_shares(pairs(recs, "x/D2/c2"), SLO))
    assert shares[:, 0] == pytest.approx([0.375, -0.375])
    assert float(goodput_ratio(shares[:, 0], shares[:, 1])) == pytest.approx(6.0)


def test_goodput_verdicts_and_a_baseline_that_never_meets_the_slo() -> None:
    rng = np.random.default_rng(0)
    recs = []
    for i in range(30):  # baseline TPOT ~ 45 ms (most met), spec ~ 25 ms (all met): faster too
        recs += [record("baseline", f"r{i}", 0.05, 0.045 * (1 + 0.1 * rng.standard_normal())),
                 record("spec", f"r{i}", 0.05, 0.025 * (1 + 0.05 * rng.standard_normal()))]
    v = judge(recs, "ngram/D4/c1", CRITERIA, greedy=False, audit=None)
    assert v.verdict == GO and v.ci[0] > 1.05 and v.units == 30
    slow = [dict(r, token_times_s=[t * 3 for t in r["token_times_s"]], e2e_s=r["e2e_s"] * 3)
            if r["arm"] == "baseline" else r for r in recs]  # TTFT 150 ms: never met
    v = decide(slow, CRITERIA, greedy=False)[0]
    assert v.verdict == INCONCLUSIVE and v.speedup != v.speedup
    assert "baseline met the SLO in no request" in v.reasons[0]


def test_the_report_judges_goodput_and_shows_each_arm_s_rate(tmp_path) -> None:
    """An eval whose recipe asks for goodput: decision.json has the table, report.md the
    section, and the verdict's speedup is the goodput ratio (TPOT 45 → 25 ms: most baseline
    requests meet TPOT ≤ 50 ms, every spec one does, and spec turns are shorter)."""
    import json
    import shutil
    from pathlib import Path

    from trtspec.build.recipe import load_recipe
    from trtspec.report.decision import make_decision

    out = tmp_path / "e"
    out.mkdir()
    shutil.copyfile(Path(__file__).resolve().parents[2] / "recipes" / "cpu-smollm2.yaml",
                    out / "recipe.yaml")
    rng = np.random.default_rng(1)
    rows = []
    for i in range(24):
        rows += [record("baseline", f"r{i}", 0.05, 0.045 * (1 + 0.1 * rng.standard_normal())),
                 record("spec", f"r{i}", 0.05, 0.025)]
    (out / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    recipe = load_recipe(out / "recipe.yaml", ["decide.primary_metric=goodput",
                                               "decide.slo.tpot_ms=50",
                                               "decide.require_audit=false"])
    verdicts, decision = make_decision(out, recipe, rows)
    row = decision["goodput"]["ngram/D4/c1"]
    assert verdicts[0].speedup == pytest.approx(row["spec_rps"] / row["baseline_rps"])
    assert row["spec_met"] == 1.0 and verdicts[0].verdict == GO
    section = (out / "report.md").read_text().split("## Goodput at the SLO")[1].split("##")[0]
    assert "TPOT ≤ 50 ms" in section and "| ngram/D4/c1 | 24 |" in section


def test_a_spec_arm_that_never_meets_the_slo_is_shown_below() -> None:
    """Spec misses every request (TTFT 150 ms > 100), baseline meets them: goodput ratio 0,
    CI (0, 0), NO-GO, not a degenerate INCONCLUSIVE."""
    from trtspec.analysis.decide import NO_GO

    recs = []
    for i in range(20):
        recs += [record("baseline", f"r{i}", 0.05, 0.04), record("spec", f"r{i}", 0.15, 0.02)]
    v = judge(recs, "ngram/D4/c1", CRITERIA, greedy=False)
    assert v.verdict == NO_GO and v.speedup == 0 and v.ci == (0.0, 0.0)


def test_open_loop_goodput_is_attainment_at_the_offered_rate_not_busy_time() -> None:
    """Open-loop arrivals at 0.5 req/s, 8 requests a turn at the same offsets in both arms
    (sent at 0, 2, … 14 s), every request within the SLO: baseline E2E 0.4 s, spec 0.2 s. Both
    arms serve the offered 0.5 req/s at 100 %: the goodput ratio is 1.0 (windows 14.4 s and
    14.2 s: 8/14.2 ÷ 8/14.4 = 1.014). Busy time (the union of request intervals: 3.2 s vs
    1.6 s) would have said 2.0."""
    from trtspec.analysis.goodput import turn_spans

    slo = Slo(ttft_ms=1000)
    recs = []
    for i in range(8):
        recs += [record("baseline", f"r{i}", 0.4, 0.0, n=1, start=2.0 * i, block="t0"),
                 record("spec", f"r{i}", 0.2, 0.0, n=1, start=100 + 2.0 * i, block="t0")]
    shares = np.array(signed_shares(pairs(recs, "ngram/D4/c1"), slo))
    ratio = float(goodput_ratio(shares[:, 0], shares[:, 1]))
    assert ratio == pytest.approx(14.4 / 14.2) and f"{ratio:.1f}" == "1.0"
    assert turn_spans([r for r in recs if r["arm"] == "spec"])["t0"] == (pytest.approx(14.2), 8)
