"""decide: verdicts on synthetic paired records with known answers."""

from __future__ import annotations

import numpy as np
import pytest
from fake_records import paired, record

from trtspec.analysis.decide import (
    GO,
    INCONCLUSIVE,
    NO_GO,
    decide,
    judge,
)
from trtspec.analysis.gates import gate_percentile, order_bounds, quantile_regression
from trtspec.analysis.policy import apply_where
from trtspec.build.recipe import Decide

CRITERIA = Decide(min_speedup=1.05, max_ttft_p99_regression=0.10, max_e2e_p99_regression=0.10,
                  min_requests=20)


def test_clear_go_and_clear_no_go() -> None:
    go = judge(paired("ngram/D4/c1", 0.050, 0.025), "ngram/D4/c1", CRITERIA, greedy=False)
    assert go.verdict == GO and go.speedup == pytest.approx(2.0, rel=0.05) and go.ci[0] > 1.05
    slow = judge(paired("ngram/D4/c8", 0.050, 0.060), "ngram/D4/c8", CRITERIA, greedy=False)
    assert slow.verdict == NO_GO and slow.ci[1] < 1.05 and "below" in slow.reasons[-1]


def test_each_primary_metric_has_its_own_speedup() -> None:
    records = paired("ngram/D4/c1", 0.050, 0.025, ttft=0.5)  # spec's slow prefill dilutes E2E
    speedups = {m: judge(records, "ngram/D4/c1", CRITERIA.model_copy(
        update={"primary_metric": m}), greedy=False).speedup
        for m in ("tpot", "tpot_p50", "e2e_p50", "e2e_per_token_p50")}
    assert speedups["tpot_p50"] == pytest.approx(2.0, rel=0.05)
    assert speedups["tpot"] == pytest.approx(2.0, rel=0.05)
    assert 1.2 < speedups["e2e_p50"] < 1.6
    assert speedups["e2e_per_token_p50"] == pytest.approx(speedups["e2e_p50"], rel=0.01)
    # `throughput` named a per-request latency: older recipes still load, as what it was
    assert Decide(primary_metric="throughput").primary_metric == "e2e_per_token_p50"


def test_tpot_is_each_request_s_own_speedup_by_hand() -> None:
    """primary_metric tpot: the geometric mean of baseline / spec per request. Ratios 2, ½, 2,
    ½ and four of 1.5 multiply to 1.5⁴, so the mean is (1.5⁴)^(1/8) = √1.5 = 1.2247, whatever
    each request's own TPOT. The medians' ratio of the same pairs: baseline TPOTs 10, 40, 10,
    40, 20×4 ms → median 20; spec 5, 80, 5, 80, 13.33×4 → median 13.33; 20 / 13.33 = 1.5."""
    base = [0.010, 0.040, 0.010, 0.040, 0.020, 0.020, 0.020, 0.020]
    ratio = [2.0, 0.5, 2.0, 0.5, 1.5, 1.5, 1.5, 1.5]
    records = [x for i, (b, r) in enumerate(zip(base, ratio, strict=True))
               for x in (record("ngram/D4/c1", "baseline", f"r{i}", b),
                         record("ngram/D4/c1", "spec", f"r{i}", b / r))]
    few = CRITERIA.model_copy(update={"min_requests": 8})
    tpot_ = few.model_copy(update={"primary_metric": "tpot"})
    assert judge(records, "ngram/D4/c1", tpot_, greedy=False).speedup == \
        pytest.approx(1.5 ** 0.5, rel=1e-9)
    assert judge(records, "ngram/D4/c1", few, greedy=False).speedup == \
        pytest.approx(1.5, rel=1e-9)


def test_tpot_decides_a_workload_of_unlike_requests_the_medians_cannot() -> None:
    """Half the requests copy (spec 1.6× faster), half do not (0.95×), baseline TPOT alike:
    the spec median falls in the gap between the two kinds and jumps from one to the other
    from resample to resample, so the medians' CI spans both (≈ 0.95–1.6×); each request's
    own speedup, averaged on a log scale (√(0.95 · 1.6) = 1.233), is shown above 1.05×."""
    rng = np.random.default_rng(0)
    records = []
    for i in range(16):
        b = 0.035 * (1 + 0.03 * rng.standard_normal())
        s = b / (0.95, 1.6)[i % 2] * (1 + 0.03 * rng.standard_normal())
        records += [record("ngram/D4/c1", "baseline", f"r{i}", b),
                    record("ngram/D4/c1", "spec", f"r{i}", s)]
    few = CRITERIA.model_copy(update={"min_requests": 16})
    tpot_ = few.model_copy(update={"primary_metric": "tpot"})
    paired_ = judge(records, "ngram/D4/c1", tpot_, greedy=False)
    medians = judge(records, "ngram/D4/c1", few, greedy=False)
    assert paired_.verdict == GO and paired_.speedup == pytest.approx(1.233, rel=0.02)
    assert medians.verdict == INCONCLUSIVE and medians.ci[0] < 1 and medians.ci[1] > 1.55


def test_straddling_ci_is_inconclusive() -> None:
    v = judge(paired("ngram/D2/c1", 0.050, 0.048, n=20, noise=0.15, seed=3), "ngram/D2/c1",
              CRITERIA, greedy=False)
    assert v.verdict == INCONCLUSIVE and v.ci[0] < 1.05 < v.ci[1] and "straddles" in v.reasons[0]


def test_gate_failures_are_no_go_even_with_speedup() -> None:
    slow_first = paired("eagle/D4/c1", 0.050, 0.025, ttft=0.09)  # TTFT p99 +80 %
    v = judge(slow_first, "eagle/D4/c1", CRITERIA, greedy=False)
    assert v.verdict == NO_GO and v.speedup > 1.9
    assert v.reasons[0].startswith(
        "TTFT median regressed 80 % (95 % order-statistic CI +80 … +80 %, limit 10 %")
    wrong = paired("ngram/D4/c1", 0.050, 0.025, digest="different")
    diverged = {("ngram/D4/c1", f"r{i}"): {"margin": 3.0, "dtype": "float32"} for i in range(40)}
    v = judge(wrong, "ngram/D4/c1", CRITERIA, greedy=True, divergences=diverged)
    assert v.verdict == NO_GO and "greedy identity 0.0 %: 40 of 40" in v.reasons[0]
    assert judge(wrong, "ngram/D4/c1", CRITERIA, greedy=False).verdict == GO


def test_audit_and_gpu_memory_gates() -> None:
    fast = paired("ngram/D4/c1", 0.050, 0.025)
    passed = {"methods": {"ngram": {"passed": True, "weak": False, "power": 0.9, "p_value": 0.4,
                                    "threshold": 2.5e-4}}}
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
    old = {"methods": {"ngram": {"passed": True, "weak": False, "p_value": 0.4,
                                 "threshold": 2.5e-4}}}  # an earlier trtspec's: no power
    v = judge(fast, "ngram/D4/c1", CRITERIA, False, audit=old, needs_audit=True)
    assert v.verdict == INCONCLUSIVE and "states no power" in v.reasons[0]
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


def test_latency_gate_uses_a_percentile_the_sample_can_bound() -> None:
    # p99 needs 1 − 0.99ⁿ ≥ 1 − 0.0125 for an upper order-statistic bound: n ≥ 437
    assert [gate_percentile(n) for n in (8, 41, 42, 436, 437)] == [50, 50, 90, 90, 99]
    # hand-computed: every spec TTFT is twice its baseline, 1 … 20 s. The median's bounds at
    # 1.25 % each from Bin(20, ½): P(Bin < 5) = 0.0059 ≤ 0.0125 < P(Bin < 6) = 0.0207, so
    # X₍₅₎; P(Bin ≥ 16) = 0.0059, so X₍₁₆₎. Lower: spec X₍₅₎ / base X₍₁₆₎ − 1 = 10/16 − 1.
    base = np.arange(1.0, 21)
    point, ci = quantile_regression(base, 2 * base, 50)
    assert point == pytest.approx(1.0)
    assert ci == pytest.approx((10 / 16 - 1, 32 / 5 - 1))
    assert order_bounds(base, 0.5, 0.0125) == (5.0, 16.0)


def test_order_statistic_bounds_cover_the_quantile_as_stated() -> None:
    """p90 of 60 exponential draws: each bound misses with probability ≤ 1.25 % (the
    percentile bootstrap's p99 of n = 100 is its maximum or near it, and misses far more)."""
    from trtspec.analysis.gates import order_bounds

    rng = np.random.default_rng(0)
    truth = -np.log(0.1)
    low = high = 0
    for _ in range(4000):
        lo, hi = order_bounds(rng.exponential(size=60), 0.9, 0.0125)
        low += lo > truth
        high += hi < truth
    print(f"misses in 4000: low {low}, high {high} (≤ 1.25 % = 50 each, + 2 SE = 64)")
    assert low <= 64 and high <= 64


def noisy_ttft(seed: int, n: int = 24, shift: float = 1.0) -> list[dict]:
    """A 1.6× faster spec arm whose TTFT (the prefill, the same work in both arms) is noisy
    with rare slow outliers, as on a shared machine."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        ttft = [0.05 * rng.lognormal(0, 0.05) * (1.5 if rng.random() < 0.08 else 1.0)
                for _ in range(2)]
        out += [record("ngram/D4/c1", "baseline", f"r{i}", 0.040, ttft=ttft[0]),
                record("ngram/D4/c1", "spec", f"r{i}", 0.025, ttft=ttft[1] * shift)]
    return out


def test_noise_never_turns_go_into_no_go() -> None:
    verdicts, old_gate_failed = [], 0
    for seed in range(40):
        records = noisy_ttft(seed)
        verdicts.append(judge(records, "ngram/D4/c1", CRITERIA, greedy=False).verdict)
        base = [r["ttft_s"] for r in records if r["arm"] == "baseline"]
        spec = [r["ttft_s"] for r in records if r["arm"] == "spec"]
        old_gate_failed += np.percentile(spec, 99) / np.percentile(base, 99) - 1 > 0.10
    assert old_gate_failed >= 4  # a point-estimate p99 gate would have said NO-GO here
    assert NO_GO not in verdicts and verdicts.count(GO) >= 25
    # a clear regression (+60 %) is never GO: NO-GO when demonstrated, else INCONCLUSIVE
    assert GO not in {judge(noisy_ttft(seed, shift=1.6), "ngram/D4/c1", CRITERIA,
                            greedy=False).verdict for seed in range(40)}


def test_demonstrated_and_possible_regressions() -> None:
    slow = judge(noisy_ttft(0, shift=1.6), "ngram/D4/c1", CRITERIA, greedy=False)
    assert slow.verdict == NO_GO and slow.reasons[0].startswith(
        "TTFT median regressed 64 % (95 % order-statistic CI +54 … +77 %")
    maybe = judge(noisy_ttft(0, shift=1.12), "ngram/D4/c1", CRITERIA, greedy=False)
    assert maybe.verdict == INCONCLUSIVE and maybe.reasons[0].startswith(
        "TTFT median regression of +15 % measured but not demonstrated (95 % order-statistic "
        "CI +8 … +24 %")
    assert "about 47 paired requests would resolve it" in maybe.reasons[0]
    # spec TTFT 8 % slower with spread: a 10 % regression cannot be ruled out, verdict stands
    rng = np.random.default_rng(1)
    records = []
    for i in range(30):
        b = 0.05 * rng.lognormal(0, 0.1)
        records += [record("ngram/D4/c1", "baseline", f"r{i}", 0.040, ttft=b),
                    record("ngram/D4/c1", "spec", f"r{i}", 0.025,
                           ttft=b * 1.08 * rng.lognormal(0, 0.05))]
    v = judge(records, "ngram/D4/c1", CRITERIA, greedy=False)
    assert v.verdict == GO and "TTFT median regression of 10 % not ruled out" in v.caveats[0]
    assert "paired requests would resolve it" in v.caveats[0]


def test_greedy_gate_tells_numerical_ties_from_divergences() -> None:
    records = paired("ngram/D4/c1", 0.050, 0.025)
    for r in records[1:6:2]:  # spec of r0, r1, r2 differs from its baseline
        r["output_digest"] = "other"
    tie = {"condition": "ngram/D4/c1", "margin": 0.03}
    ties = [tie | {"request_id": f"r{i}"} for i in range(3)]
    v = decide(records, CRITERIA, greedy=True, divergences=ties)[0]
    assert v.verdict == GO and v.greedy == {"identical": 37, "ties": 3, "diverged": 0,
                                            "unmeasured": 0}
    assert "37 of 40 outputs identical, 3 at a numerical tie (logit margin ≤ 0.5)" \
        in v.caveats[0]  # no dtype recorded: the bfloat16 margin
    real = ties[:2] + [tie | {"request_id": "r2", "margin": 2.5}]
    v = decide(records, CRITERIA, greedy=True, divergences=real)[0]
    assert v.verdict == NO_GO and v.greedy == {"identical": 37, "ties": 2, "diverged": 1,
                                               "unmeasured": 0}
    assert "1 of 40 spec outputs differ from the baseline beyond a numerical tie" in v.reasons[0]
    # the margin is judged by the dtype it was measured in: 0.03 is a tie in bf16, not in fp32
    fp32 = [t | {"dtype": "float32"} for t in ties]
    v = decide(records, CRITERIA, greedy=True, divergences=fp32)[0]
    assert v.verdict == NO_GO and v.greedy["diverged"] == 3
    assert decide(records, CRITERIA.model_copy(update={"greedy_tie_margin": 0.05}), greedy=True,
                  divergences=fp32)[0].verdict == GO  # an explicit margin wins
    v = decide(records, CRITERIA, greedy=True)[0]  # differences with no margin recorded
    assert v.verdict == INCONCLUSIVE and v.greedy["unmeasured"] == 3
    assert "3 of 40 spec outputs differ from the baseline with no logit margin" in v.reasons[0]


def test_weak_audit_and_failed_requests() -> None:
    fast = paired("ngram/D4/c1", 0.050, 0.025)
    weak = {"methods": {"ngram": {"passed": True, "weak": True, "p_value": 0.4,
                                  "threshold": 2.5e-4}}}
    v = judge(fast, "ngram/D4/c1", CRITERIA, False, audit=weak, needs_audit=True)
    assert v.verdict == INCONCLUSIVE and "audit of ngram is weak" in v.reasons[0]
    weak["methods"]["ngram"] |= {"power": 0.31, "effect": 0.1, "recovered_samples": 800}
    v = judge(fast, "ngram/D4/c1", CRITERIA, False, audit=weak, needs_audit=True)
    assert v.verdict == INCONCLUSIVE and "audit of ngram is weak (power 0.31 against a " \
        "post-rejection total variation of 0.1 as the bins see it, 800 samples with a " \
        "recovered token)" in v.reasons[0]
    fast[1]["error"] = "APIConnectionError: Connection error."  # r0's spec arm failed
    v = judge(fast, "ngram/D4/c1", CRITERIA, False)
    assert v.verdict == INCONCLUSIVE and v.requests == 39
    assert v.reasons[0].startswith("1 request(s) failed at the endpoint and have no measurement")
    fast.append(dict(fast[1], error=None))  # measured again on resume: counts, no hold
    assert judge(fast, "ngram/D4/c1", CRITERIA, False).verdict == GO


def test_decide_command_writes_report_and_exits_as_a_ci_gate(tmp_path, capsys) -> None:
    import json
    import shutil
    from pathlib import Path

    from trtspec.cli import main

    recipe = Path(__file__).resolve().parents[2] / "recipes" / "cpu-smollm2.yaml"
    audit = {"samples": 100, "draft_len": 1, "alpha": 1e-3, "sampling": {
        "temperature": 0.7, "top_k": 0, "top_p": 1.0}, "methods": {"ngram": {
            "passed": True, "weak": False, "p_value": 0.3, "threshold": 5e-4, "prompts": [
                {"prompt": "a | b", "p_value": 0.3, "speculated": 0.9, "rejected": 0.2}]}}}
    cases = (("fast", 0.025, None, 0, "GO"), ("slow", 0.060, None, 1, "NO-GO"),
             ("unaudited", 0.025, {}, 1, "INCONCLUSIVE"),
             ("audited", 0.025, audit, 1, "INCONCLUSIVE"))  # an earlier trtspec's audit
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
        # no rejected_rounds: α solves 1 + α + α² + α³ + α⁴ = AL = (40 + 20) / 20 = 3
        assert decision["cost_model"]["ngram/D4/c1"]["alpha"] == pytest.approx(0.7413, abs=1e-4)
    assert "| ngram | PASS | 1 | a / b | 0.3 | 90 % | 20 % |" in \
        (tmp_path / "audited" / "report.md").read_text()
    assert "Not run: `trtspec audit" in (tmp_path / "unaudited" / "report.md").read_text()
    assert "ngram/D4/c1" in capsys.readouterr().out


def in_turns(condition: str, speedup: float, turns: int, size: int, seed: int = 0) -> list[dict]:
    """Records of c > 1 turns: each arm's turn shares a shock (``block`` names the turn)."""
    rng = np.random.default_rng(seed)
    out = []
    for t in range(turns):
        shock_b, shock_s = rng.lognormal(0, 0.2, 2)
        for i in range(size):
            rid = f"t{t}r{i}"
            b = record(condition, "baseline", rid, 0.05 * shock_b * rng.lognormal(0, 0.05))
            s = record(condition, "spec", rid, 0.05 / speedup * shock_s * rng.lognormal(0, 0.05))
            out += [b | {"block": f"0.{t}"}, s | {"block": f"0.{t}"}]
    return out


def test_turns_are_the_unit_at_concurrency() -> None:
    v = judge(in_turns("ngram/D4/c4", 1.5, turns=10, size=16), "ngram/D4/c4", CRITERIA, False)
    assert (v.unit, v.units, v.requests) == ("turn", 10, 160)
    naive = judge([{k: x for k, x in r.items() if k != "block"}
                   for r in in_turns("ngram/D4/c4", 1.5, turns=10, size=16)],
                  "ngram/D4/c4", CRITERIA, False)
    assert naive.unit == "request" and naive.ci[1] - naive.ci[0] < 0.5 * (v.ci[1] - v.ci[0])
    assert "these records name no turn" in naive.caveats[0]
    # 3 turns of 16: plenty of requests, too few independent units for an interval
    few = judge(in_turns("ngram/D4/c4", 1.5, turns=3, size=16), "ngram/D4/c4", CRITERIA, False)
    assert few.verdict == INCONCLUSIVE and few.ci[0] != few.ci[0]
    assert few.reasons[0] == ("3 independent turns (of 16 request(s) each) are too few for an "
                              "interval (< 8): measure about 80 more paired requests")


def test_many_cells_share_one_error_rate() -> None:
    # one cell whose CI just clears 1.05: GO alone, not among 20 cells at a family-wise 2.5 %
    edge = paired("ngram/D4/c1", 0.050, 0.050 / 1.2, n=30, noise=0.12, seed=0)
    alone = judge(edge, "ngram/D4/c1", CRITERIA, greedy=False)
    assert alone.verdict == GO and alone.family == 1 and alone.level == 0.025
    others = [r for k in range(19) for r in paired(f"ngram/D{k + 5}/c1", 0.05, 0.05, n=30,
                                                   noise=0.12, seed=k)]
    family = decide(edge + others, CRITERIA, greedy=False)
    cell = next(v for v in family if v.condition == "ngram/D4/c1" and v.category == "all")
    assert cell.family == 40 and cell.verdict == INCONCLUSIVE  # 20 conditions × (all + c)
    assert "but not at the family-wise level" in cell.reasons[0]
    assert cell.p_go > cell.level and cell.ci[0] > 1.05


def test_apply_where_chooses_by_the_lower_bound() -> None:
    steady = paired("ngram/D2/c1", 0.050, 0.050 / 1.5, n=40, noise=0.02)
    lucky = paired("ngram/D4/c1", 0.050, 0.050 / 1.6, n=20, noise=0.35, seed=2)
    verdicts = decide(steady + lucky, CRITERIA, greedy=False)
    overall = {v.condition: v for v in verdicts if v.category == "all"}
    assert overall["ngram/D4/c1"].speedup > overall["ngram/D2/c1"].speedup
    assert overall["ngram/D4/c1"].ci[0] < overall["ngram/D2/c1"].ci[0]
    assert {v.verdict for v in overall.values()} == {GO}
    best = apply_where(verdicts)["ngram"]["best_d"]["c1"]
    assert best[0] == 2 and best[2] == overall["ngram/D2/c1"].ci[0]


def test_a_latency_gate_on_too_few_turns_holds_and_never_fails() -> None:
    """16 requests in 2 turns at c = 4, spec's E2E twice the baseline's: a bootstrap of 2
    turns has no spread (its CI is one value), so the gate cannot demonstrate a regression:
    it holds the verdict at INCONCLUSIVE instead of failing it."""
    records = []
    for i in range(16):
        block = f"t{i // 8}"
        b = record("ngram/D4/c4", "baseline", f"r{i}", 0.05)
        s = record("ngram/D4/c4", "spec", f"r{i}", 0.10)
        records += [b | {"block": block}, s | {"block": block}]
    v = judge(records, "ngram/D4/c4", CRITERIA.model_copy(update={"min_requests": 8}),
              greedy=False)
    assert v.verdict == INCONCLUSIVE
    assert any("measured on 2 independent unit(s) (< 8): not judged" in r for r in v.reasons)
    assert not any("regressed" in r for r in v.reasons)


def test_repeat_copies_of_a_prompt_are_one_unit() -> None:
    """--repeat 4 of 12 prompts whose speedups differ, the copies agreeing (what makes a
    prompt fast is the prompt): counted as 48 independent requests the CI would be half as
    wide; the copies of a prompt are one unit, and the CI is that of the 12 prompts."""
    rng = np.random.default_rng(3)
    criteria = CRITERIA.model_copy(update={"primary_metric": "tpot", "min_requests": 8})
    logs = np.log(1.3) + 0.2 * rng.standard_normal(12)
    once, copies = [], []
    for i, log_speedup in enumerate(logs):
        for k in range(4):
            rid = f"p{i}" if k == 0 else f"p{i}#{k + 1}"
            jitter = 1 + 0.001 * rng.standard_normal()
            turn = {"block": f"0.{4 * i + k}"}  # c = 1: each request its own turn
            pair = [record("ngram/D4/c1", "baseline", rid, 0.05) | turn,
                    record("ngram/D4/c1", "spec", rid, 0.05 / np.exp(log_speedup) * jitter)
                    | turn]
            copies += pair
            if k == 0:
                once += pair
    alone = judge(once, "ngram/D4/c1", criteria, greedy=False)
    repeated = judge(copies, "ngram/D4/c1", criteria, greedy=False)
    assert (alone.unit, alone.units) == ("request", 12)
    assert (repeated.unit, repeated.units, repeated.requests) == ("prompt", 12, 48)
    width = (repeated.ci[1] - repeated.ci[0]) / (alone.ci[1] - alone.ci[0])
    print(f"--repeat 4 CI width / no-repeat CI width: {width:.3f}")
    assert 0.85 <= width <= 1.15


def test_turns_that_share_prompts_are_one_unit() -> None:
    from trtspec.analysis.units import independent_units, prompt_of

    assert [prompt_of({"request_id": x}) for x in ("a", "a#2", "a#12", "b#1", "#3", "x#y")] \
        == ["a", "a", "a", "b#1", "#3", "x#y"]  # records from before prompt_id
    assert prompt_of({"request_id": "doc#2", "prompt_id": "doc#2"}) == "doc#2"  # not a copy
    rows = [{"request_id": rid, "block": block} for rid, block in
            (("a", "t0"), ("b", "t0"), ("c", "t1"), ("a#2", "t2"), ("d", "t2"), ("e", "t3"))]
    units, name = independent_units(rows)
    assert name == "turn group" and len(set(units)) == 3  # {t0, t2}, {t1}, {t3}
    assert units[0] == units[1] == units[3] == units[4] != units[2]


def test_the_looks_of_an_eval_leave_the_latency_gates_to_its_end() -> None:
    """An ``--until-decided`` look (interim) judges the speedup alone: a TTFT regression does
    not stop the eval there; decide at the end tests the gate, once."""
    slow_first = paired("eagle/D4/c1", 0.050, 0.025, ttft=0.09)
    interim = decide(slow_first, CRITERIA, greedy=False, interim=True)[0]
    final = decide(slow_first, CRITERIA, greedy=False)[0]
    assert interim.verdict == GO and not any("TTFT" in r for r in interim.reasons)
    assert final.verdict == NO_GO and final.reasons[0].startswith("TTFT median regressed")


def test_a_level_the_units_cannot_reach_is_said_with_the_units_that_would() -> None:
    """8 units: a bootstrap-t p never goes below 8·8⁻⁸ = 4.8e-7 (a resample of one unit 8 times
    has no spread), so a cell judged at 1e-7 cannot be GO however clear: it says so, and that
    9 units would reach it (9·9⁻⁹ = 2.6e-8), instead of "measure more" sized by a CI."""
    criteria = CRITERIA.model_copy(update={"primary_metric": "tpot", "min_requests": 8})
    v = judge(paired("ngram/D4/c1", 0.05, 0.025, n=8), "ngram/D4/c1", criteria, greedy=False,
              alpha=1e-7)
    assert v.verdict == INCONCLUSIVE and v.units == 8
    assert "cannot go below" in v.reasons[0] and "the level is 1e-07" in v.reasons[0]
    assert v.reasons[0].endswith("about 9 independent requests would reach it")
