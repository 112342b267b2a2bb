"""`trtspec audit --endpoint`: the two-sample statistic by hand, and the audit against real
`trtspec serve --backend toy` servers over HTTP with the real `openai` client.

Numbers (toy target: order-2 Markov, vocab 32, seed 0; prompt "1 14"; k = 3 tokens; 1500
samples per server; α = 0.01): the outcome distributions of the correct speculating server and
the plain one are the same; the least favourable difference of TV 0.1 has λ ≥ 30 (power ≈ 0.85
at 19 dof). A temperature 10 % too high differs by λ ≈ 36 in the top-19-plus-tail bins (power
≈ 0.93), exact-match acceptance by λ ≈ 257 (power ≈ 1). Every sample is seeded, so each
outcome here is deterministic."""

from __future__ import annotations

import contextlib
import json
import math
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import requests
from conftest import free_port

from trtspec.audit.endpoint import (
    choose_bins,
    homogeneity,
    least_favourable,
    noncentrality,
    p_value,
    power,
)
from trtspec.cli import main

HERE = Path(__file__).resolve().parents[1]  # tests/
PROMPT, TOKENS, SAMPLES, ALPHA = "1 14", "3", "1500", "0.01"


def test_a_2x3_table_by_hand() -> None:
    # a = 10 20 30, b = 20 20 20: pooled 30 40 50 of 120, each row expects half: 15 20 25
    stat, dof = homogeneity([10, 20, 30], [20, 20, 20])
    assert stat == pytest.approx(2 * (25 / 15 + 0 + 25 / 25)) and dof == 2
    assert p_value(stat, dof) == pytest.approx(math.exp(-stat / 2))  # χ²(2) is exponential
    assert homogeneity([5], [7]) == (0.0, 0)  # one bin: nothing to test
    assert p_value(0.0, 0) == 1.0


def test_bins_come_from_the_pooled_counts() -> None:
    o = [(f"t{i}", False) for i in range(8)]
    a = Counter({o[0]: 40, o[1]: 30, o[2]: 6, o[3]: 3, o[4]: 1})
    b = Counter({o[0]: 35, o[1]: 25, o[2]: 12, o[3]: 5, o[5]: 2})
    table = choose_bins(a, b)
    # n_a = 80, n_b = 79: an outcome is a bin when 79·c/159 ≥ 5, i.e. pooled count c ≥ 10.1;
    # the tail (pooled 8 + 2 + 1, in that order) expects 79·11/159 = 5.5: a bin of its own
    assert table.bins == [[o[0]], [o[1]], [o[2]], [o[3], o[5], o[4]]] and table.tail
    assert table.a == [40, 30, 6, 4] and table.b == [35, 25, 12, 7]
    swapped = choose_bins(b, a)  # the same bins whichever server is which
    assert swapped.bins == table.bins and swapped.a == table.b
    assert homogeneity(swapped.a, swapped.b)[0] == pytest.approx(homogeneity(table.a,
                                                                             table.b)[0])
    # a tail that expects < 5 joins the smallest bin; max_bins caps the bins
    small = choose_bins(Counter({o[0]: 50, o[1]: 40, o[2]: 2}),
                        Counter({o[0]: 45, o[1]: 50, o[2]: 1}))
    assert small.bins == [[o[0]], [o[1], o[2]]] and not small.tail
    capped = choose_bins(a, b, max_bins=2)
    assert capped.bins == [[o[0]], [o[1], o[2], o[3], o[5], o[4]]]


def test_power_for_a_known_noncentrality() -> None:
    # 1 dof: power = P(|Z + √λ| > 1.96) ≈ Φ(√λ − 1.96) = 0.8 at √λ = 1.96 + 0.8416
    assert power(1, (1.959964 + 0.841621) ** 2, 0.05) == pytest.approx(0.8, abs=1e-4)
    assert power(3, 0.0, 0.01) == pytest.approx(0.01)  # no effect: the false-alarm rate
    assert power(0, 50.0, 0.01) == 0.0
    # the least favourable TV-1 difference: Σ Δ²/p = 1/P(S) + 1/(1 − P(S)), P(S) near ½
    assert least_favourable([50, 50]) == pytest.approx(4)
    assert least_favourable([90, 10]) == pytest.approx(1 / 0.9 + 1 / 0.1)
    assert least_favourable([30, 30, 40]) == pytest.approx(1 / 0.4 + 1 / 0.6)
    table = choose_bins(Counter({("x", False): 50, ("y", False): 50}),
                        Counter({("x", False): 50, ("y", False): 50}))
    assert noncentrality(table, 0.1) == pytest.approx(100 * 100 / 200 * 0.01 * 4)


def _start(*args: str, **env: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, *args, "--port", str(port)],
                            env={**os.environ, **env}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    return proc, f"http://127.0.0.1:{port}/v1"


@pytest.fixture(scope="module")
def toy_servers():
    """Four toy servers (started together, ready when /health answers): speculating
    (draft_model, D = 4), plain, one at 1.1 × the temperature, one with exact-match
    acceptance."""
    broken = str(HERE / "serve" / "broken_serve.py")
    started = {
        "spec": _start("-m", "trtspec", "serve", "--backend", "toy"),
        "plain": _start("-m", "trtspec", "serve", "--backend", "toy", "--method", "none"),
        "hot": _start(broken, TRTSPEC_TEST_BROKEN="temperature"),
        "exact_match": _start(broken, TRTSPEC_TEST_BROKEN="exact_match"),
    }
    try:
        deadline = time.time() + 120
        for proc, url in started.values():
            while time.time() < deadline and proc.poll() is None:
                with contextlib.suppress(requests.ConnectionError):
                    if requests.get(url.removesuffix("/v1") + "/health", timeout=2).ok:
                        break
                time.sleep(0.1)
            assert proc.poll() is None, "a toy server did not start"
        yield {name: url for name, (_, url) in started.items()}
    finally:
        for proc, _ in started.values():
            proc.terminate()
        for proc, _ in started.values():
            proc.wait(timeout=30)


def _audit(endpoint: str, baseline: str, out: Path, capsys) -> tuple[int, dict, str]:
    with pytest.raises(SystemExit) as exit_info:
        main(["audit", "--endpoint", endpoint, "--baseline-endpoint", baseline, "--prompt",
              PROMPT, "--tokens", TOKENS, "--samples", SAMPLES, "--alpha", ALPHA, "--out",
              str(out)])
    return (exit_info.value.code, json.loads((out / "audit.json").read_text()),
            capsys.readouterr().out)


def test_a_correct_speculating_server_passes(toy_servers, tmp_path, capsys) -> None:
    code, report, printed = _audit(toy_servers["spec"], toy_servers["plain"], tmp_path, capsys)
    m = report["methods"]["endpoint"]
    assert code == 0 and m["passed"] and m["p_value"] >= 0.01, printed
    assert not m["weak"] and m["power"] >= 0.8  # 1500 per server: power ≈ 0.85 at TV 0.1
    assert report["kind"] == "endpoint" and report["draft_len"] == "4"  # as the server says
    prompt = m["prompts"][0]
    assert prompt["speculated"] == 1.0 and prompt["rejected"] > 0.2  # drafts were rejected
    assert prompt["bins"] == 20 and prompt["tail"] and prompt["outcomes"] > 100
    assert "PASS" in printed and "power 0.8" in printed


@pytest.mark.parametrize("broken", ["hot", "exact_match"])
def test_a_wrong_sampler_fails(toy_servers, tmp_path, capsys, broken) -> None:
    code, report, printed = _audit(toy_servers[broken], toy_servers["plain"], tmp_path, capsys)
    m = report["methods"]["endpoint"]
    assert code == 1 and not m["passed"] and m["p_value"] < 0.01, printed
    assert "FAIL" in printed


def test_cli_errors_are_one_line(tmp_path, capsys) -> None:
    down = f"http://127.0.0.1:{free_port()}/v1"
    other = f"http://127.0.0.1:{free_port()}/v1"
    recipe = str(HERE.parent / "recipes" / "cpu-smollm2.yaml")
    for argv, says in (
            (["audit", "--endpoint", down], "give --endpoint URL"),
            (["audit", "--baseline-endpoint", down], "give --endpoint URL"),
            (["audit", recipe, "--endpoint", down, "--baseline-endpoint", down], "not both"),
            (["audit", "--endpoint", down, "--baseline-endpoint", down + "/"], "same server"),
            (["audit", "--endpoint", down, "--baseline-endpoint", other, "--out",
              str(tmp_path / "x")], "cannot connect")):
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        err = capsys.readouterr().err
        assert exit_info.value.code != 0 and len(err.strip().splitlines()) == 1, err
        assert says in err, err
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("passed, weak, verdict", [(True, False, "GO"), (False, False, "NO-GO"),
                                                   (True, True, "INCONCLUSIVE")])
def test_decide_applies_an_endpoint_audit_to_an_endpoint_eval(tmp_path, passed, weak,
                                                              verdict) -> None:
    """An endpoint eval (no manifest.json) with audit.json of kind endpoint: a failed audit is
    NO-GO, a weak one holds the verdict, a passing one lets a clear speedup be GO; the report
    shows the endpoint audit's statistic."""
    import shutil

    from fake_records import paired

    from trtspec.build.recipe import load_recipe
    from trtspec.report.decision import make_decision

    out = tmp_path / "e"
    out.mkdir()
    shutil.copyfile(Path(__file__).resolve().parents[2] / "recipes" / "cpu-smollm2.yaml",
                    out / "recipe.yaml")
    rows = paired("endpoint/D4/c1", 0.050, 0.025, n=30)
    prompt = {"prompt": "1 14", "samples": 1500, "outcomes": 300, "bins": 20, "tail": True,
              "chi2": 25.0, "dof": 19, "p_value": 0.16}
    method = {"method": "endpoint", "passed": passed, "weak": weak, "threshold": 1e-3,
              "p_value": 0.16 if passed else 1e-9, "chi2": 25.0, "dof": 19,
              "noncentrality": 12.0 if weak else 40.0, "power": 0.09 if weak else 0.86,
              "effect": 0.1, "prompts": [prompt]}
    (out / "audit.json").write_text(json.dumps({
        "kind": "endpoint", "endpoint": "http://a/v1", "baseline_endpoint": "http://b/v1",
        "model": "m", "alpha": 1e-3, "samples": 1500, "tokens": 3, "draft_len": "4",
        "min_power": 0.8, "sampling": {"temperature": 1.0, "top_k": 0, "top_p": 1.0},
        "methods": {"endpoint": method}}))
    verdicts, decision = make_decision(out, load_recipe(out / "recipe.yaml"), rows)
    overall = next(v for v in verdicts if v.category == "all")
    assert decision["audit_applies"] and overall.verdict == verdict, overall.reasons
    if weak:
        assert any("endpoint's exactness audit is weak (power 0.09" in r for r in overall.reasons)
    section = (out / "report.md").read_text().split("## Exactness audit")[1]
    assert "http://a/v1 against http://b/v1" in section and "X² = 25.0 on 19 dof" in section


def test_a_sampled_endpoint_eval_without_an_audit_of_its_servers_is_held(tmp_path) -> None:
    """An endpoint eval (eval.json names its servers) sampled at temperature 0.7: no GO
    without an endpoint audit, and an audit of other servers does not count; greedy, the
    greedy-identity gate stands in for it."""
    import shutil

    from fake_records import paired

    from trtspec.build.recipe import load_recipe
    from trtspec.report.decision import make_decision

    out = tmp_path / "e"
    out.mkdir()
    shutil.copyfile(Path(__file__).resolve().parents[2] / "recipes" / "cpu-smollm2.yaml",
                    out / "recipe.yaml")
    (out / "eval.json").write_text(json.dumps({"endpoint": "http://a/v1",
                                               "baseline_endpoint": "http://b/v1"}))
    rows = paired("endpoint/D4/c1", 0.050, 0.025, n=30)
    sampled = load_recipe(out / "recipe.yaml", ["sampling.temperature=0.7"])
    verdicts, decision = make_decision(out, sampled, rows)
    assert verdicts[0].verdict == "INCONCLUSIVE" and decision["audit_applies"]
    assert any("run `trtspec audit --eval <eval dir>`" in r for r in verdicts[0].reasons)
    (out / "audit.json").write_text(json.dumps({
        "kind": "endpoint", "endpoint": "http://elsewhere/v1", "baseline_endpoint": "http://b/v1",
        "methods": {"endpoint": {"passed": True, "weak": False, "p_value": 0.5}}}))
    verdicts, decision = make_decision(out, sampled, rows)
    assert verdicts[0].verdict == "INCONCLUSIVE" and decision["audit"] is None
    verdicts, decision = make_decision(out, load_recipe(out / "recipe.yaml"), rows)
    assert verdicts[0].verdict == "GO" and not decision["audit_applies"]
