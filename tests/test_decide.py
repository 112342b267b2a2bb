"""decide: verdicts on synthetic paired records with known answers; the cost model."""

from __future__ import annotations

import numpy as np
import pytest

from trtspec.decide import (
    GO,
    INCONCLUSIVE,
    NO_GO,
    apply_where,
    cost_model,
    decide,
    judge,
    leviathan,
    recommend_d,
)
from trtspec.recipe import Decide

CRITERIA = Decide(min_speedup=1.05, max_ttft_p99_regression=0.10, max_e2e_p99_regression=0.10,
                  min_requests=20)


def record(condition: str, arm: str, rid: str, tpot: float, ttft: float = 0.05, n: int = 64,
           category: str = "c", digest: str = "x", rounds: int = 0, proposed: int = 0,
           accepted: int = 0) -> dict:
    times = [ttft + i * tpot for i in range(n)]
    return {"condition": condition, "arm": arm, "request_id": rid, "category": category,
            "token_times_s": times, "output_tokens": n, "e2e_s": times[-1], "ttft_s": ttft,
            "output_digest": digest, "verification_rounds": rounds, "proposed_tokens": proposed,
            "accepted_draft_tokens": accepted}


def paired(condition: str, base_tpot: float, spec_tpot: float, n: int = 40, noise: float = 0.02,
           seed: int = 0, **spec_kw) -> list[dict]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        b = base_tpot * (1 + noise * rng.standard_normal())
        s = spec_tpot * (1 + noise * rng.standard_normal())
        out += [record(condition, "baseline", f"r{i}", b),
                record(condition, "spec", f"r{i}", s, **spec_kw)]
    return out


def test_clear_go_and_clear_no_go() -> None:
    go = judge(paired("ngram/D4/c1", 0.050, 0.025), "ngram/D4/c1", CRITERIA, greedy=False)
    assert go.verdict == GO and go.speedup == pytest.approx(2.0, rel=0.05) and go.ci[0] > 1.05
    slow = judge(paired("ngram/D4/c8", 0.050, 0.060), "ngram/D4/c8", CRITERIA, greedy=False)
    assert slow.verdict == NO_GO and slow.ci[1] < 1.05 and "below" in slow.reasons[-1]


def test_each_primary_metric_has_its_own_speedup() -> None:
    records = paired("ngram/D4/c1", 0.050, 0.025, ttft=0.5)  # spec's slow prefill dilutes E2E
    speedups = {m: judge(records, "ngram/D4/c1", CRITERIA.model_copy(
        update={"primary_metric": m}), greedy=False).speedup
        for m in ("tpot_p50", "e2e_p50", "throughput")}
    assert speedups["tpot_p50"] == pytest.approx(2.0, rel=0.05)
    assert 1.2 < speedups["e2e_p50"] < 1.6
    assert speedups["throughput"] == pytest.approx(speedups["e2e_p50"], rel=0.01)


def test_straddling_ci_is_inconclusive() -> None:
    v = judge(paired("ngram/D2/c1", 0.050, 0.048, n=20, noise=0.15, seed=3), "ngram/D2/c1",
              CRITERIA, greedy=False)
    assert v.verdict == INCONCLUSIVE and v.ci[0] < 1.05 < v.ci[1] and "straddles" in v.reasons[0]


def test_gate_failures_are_no_go_even_with_speedup() -> None:
    slow_first = paired("eagle/D4/c1", 0.050, 0.025, ttft=0.09)  # TTFT p99 +80 %
    v = judge(slow_first, "eagle/D4/c1", CRITERIA, greedy=False)
    assert v.verdict == NO_GO and v.speedup > 1.9 and "TTFT p99 regressed" in v.reasons[0]
    wrong = paired("ngram/D4/c1", 0.050, 0.025, digest="different")
    v = judge(wrong, "ngram/D4/c1", CRITERIA, greedy=True)
    assert v.verdict == NO_GO and "greedy identity 0.0 %" in v.reasons[0]
    assert judge(wrong, "ngram/D4/c1", CRITERIA, greedy=False).verdict == GO


def test_audit_and_gpu_memory_gates() -> None:
    fast = paired("ngram/D4/c1", 0.050, 0.025)
    passed = {"methods": {"ngram": {"passed": True, "p_value": 0.4, "threshold": 2.5e-4}}}
    failed = {"methods": {"ngram": {"passed": False, "p_value": 1e-9, "threshold": 2.5e-4}}}
    assert judge(fast, "ngram/D4/c1", CRITERIA, False, audit=passed, needs_audit=True
                 ).verdict == GO
    v = judge(fast, "ngram/D4/c1", CRITERIA, False, audit=failed)
    assert v.verdict == NO_GO and "exactness audit failed (p = 1e-09" in v.reasons[0]
    v = judge(fast, "ngram/D4/c1", CRITERIA, False, audit=None, needs_audit=True)
    assert v.verdict == INCONCLUSIVE and "no exactness audit" in v.reasons[0]
    other = {"methods": {"layer_skip": passed["methods"]["ngram"]}}  # another method's audit
    assert judge(fast, "ngram/D4/c1", CRITERIA, False, audit=other, needs_audit=True
                 ).verdict == INCONCLUSIVE
    for r in fast:  # 75 of 80 GiB at peak: 6 % free < 10 %
        r |= {"cuda_max_allocated_mb": 75 * 1024 if r["arm"] == "spec" else 60 * 1024,
              "cuda_total_mb": 80 * 1024}
    v = judge(fast, "ngram/D4/c1", CRITERIA, False)
    assert v.verdict == NO_GO and "GPU memory headroom 6 % < 10 % (peak 75.0 of 80.0 GiB)" \
        in v.reasons[0]


def test_too_few_requests_and_per_category_verdicts() -> None:
    few = judge(paired("ngram/D4/c1", 0.05, 0.02, n=5), "ngram/D4/c1", CRITERIA, greedy=False)
    assert few.verdict == INCONCLUSIVE and "5 paired requests < min_requests 20" in few.reasons[0]
    records = paired("ngram/D4/c1", 0.05, 0.025, n=30) + paired("ngram/D2/c1", 0.05, 0.03, n=30)
    verdicts = decide(records, CRITERIA, greedy=False)
    assert [(v.condition, v.category) for v in verdicts] == [
        ("ngram/D2/c1", "all"), ("ngram/D2/c1", "c"), ("ngram/D4/c1", "all"),
        ("ngram/D4/c1", "c")]
    table = apply_where(verdicts)
    assert table["ngram"]["go"] == ["ngram/D2/c1", "ngram/D4/c1"]
    assert table["ngram"]["best_d"]["c1"][0] == 4


def test_cost_model_recovers_alpha_and_c_and_recommends_the_argmax() -> None:
    alpha, c, d, t = 0.7, 0.2, 4, 0.040
    rng = np.random.default_rng(0)
    records = []
    for i in range(60):
        rounds, emitted, accepted = 0, 0, 0
        while emitted < 120:
            a = 0
            while a < d and rng.random() < alpha:  # i.i.d. acceptance, stop at first reject
                a += 1
            rounds, emitted, accepted = rounds + 1, emitted + a + 1, accepted + a
        round_time = (d * c + 1) * t
        spec_tpot = rounds * round_time / emitted
        records += [record("draft_model/D4/c1", "baseline", f"r{i}", t, n=emitted + 1),
                    record("draft_model/D4/c1", "spec", f"r{i}", spec_tpot, n=emitted + 1,
                           rounds=rounds, proposed=rounds * d, accepted=accepted)]
    model = cost_model(records, "draft_model/D4/c1")
    # acceptance rate counts every proposed draft, so with i.i.d. α it is below α itself
    expected_rate = sum(alpha ** k for k in range(1, d + 1)) / d
    assert model["alpha"] == pytest.approx(expected_rate, abs=0.03)
    assert model["c"] == pytest.approx(c, abs=0.02)
    assert model["predicted_speedup"] == pytest.approx(leviathan(model["alpha"], d, model["c"]))
    assert model["measured_speedup"] == pytest.approx(
        (1 - alpha ** (d + 1)) / ((1 - alpha) * (d * c + 1)), rel=0.05)
    for a, cc in ((0.7, 0.2), (0.9, 0.05), (0.5, 0.5), (0.95, 0.0)):
        best = recommend_d(a, cc)
        assert all(leviathan(a, best, cc) >= leviathan(a, k, cc) for k in range(1, 17))
    assert recommend_d(0.9, 0.05) > recommend_d(0.5, 0.5)


def test_decide_command_writes_report_and_exits_as_a_ci_gate(tmp_path, capsys) -> None:
    import json
    import shutil
    from pathlib import Path

    from trtspec.cli import main

    recipe = Path(__file__).resolve().parents[1] / "recipes" / "cpu-smollm2.yaml"
    audit = {"samples": 100, "draft_len": 1, "alpha": 1e-3, "sampling": {
        "temperature": 0.7, "top_k": 0, "top_p": 1.0}, "methods": {"ngram": {
            "passed": True, "weak": False, "p_value": 0.3, "threshold": 5e-4, "prompts": [
                {"prompt": "a | b", "p_value": 0.3, "speculated": 0.9, "rejected": 0.2}]}}}
    cases = (("fast", 0.025, None, 0, "GO"), ("slow", 0.060, None, 1, "NO-GO"),
             ("unaudited", 0.025, {}, 1, "INCONCLUSIVE"), ("audited", 0.025, audit, 0, "GO"))
    for name, spec_tpot, manifest_audit, code, verdict in cases:
        out = tmp_path / name
        out.mkdir()
        shutil.copyfile(recipe, out / "recipe.yaml")
        (out / "eval.json").write_text(json.dumps({"overrides": ["sampling.temperature=0.7"]}))
        rows = paired("ngram/D4/c1", 0.050, spec_tpot, n=30, rounds=20, proposed=80,
                      accepted=40)
        (out / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        if manifest_audit is not None:  # an in-process eval: the audit is required
            (out / "manifest.json").write_text("{}")
            if manifest_audit:
                (out / "audit.json").write_text(json.dumps(manifest_audit))
        with pytest.raises(SystemExit) as exit_info:
            main(["decide", str(out), "--no-mlflow"])
        assert exit_info.value.code == code, name
        report = (out / "report.md").read_text()
        assert "## Verdict per condition" in report and "## Cost model" in report
        assert "## Exactness audit" in report
        page = (out / "report.html").read_text()
        assert page.count('src="data:image/png;base64,') == 4 and "<table>" in page
        decision = json.loads((out / "decision.json").read_text())
        assert decision["verdicts"][0]["verdict"] == verdict, name
        assert decision["cost_model"]["ngram/D4/c1"]["alpha"] == pytest.approx(0.5)
    assert "| ngram | PASS | a / b | 0.3 | 90 % | 20 % |" in \
        (tmp_path / "audited" / "report.md").read_text()
    assert "Not run: `trtspec audit" in (tmp_path / "unaudited" / "report.md").read_text()
    assert "ngram/D4/c1" in capsys.readouterr().out
