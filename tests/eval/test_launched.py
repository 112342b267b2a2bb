"""`trtspec eval --launch` end to end through the stand-in trtllm-serve (tests/serve/
trtllm_serve_standin.py, a toy model: NOT TensorRT-LLM, and none of its numbers are)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from trtspec.cli import main
from trtspec.eval.run import DIVERGENCES, read_jsonl, read_records

# one request per built-in category: 8 independent units, the fewest a verdict judges
SMALL = ["--num-prompts", "8", "--max-tokens", "8", "--no-mlflow", "--set",
         "decide.min_requests=8"]


def launch(recipe: Path, engines: Path, reports: Path, *extra: str) -> None:
    main(["eval", str(recipe), "--launch", "--engines", str(engines), "--reports",
          str(reports), *SMALL, *extra])


def test_a_d_sweep_is_one_command_named_by_d_and_decided_with_schedules(
        trtllm_build, trtllm_serve, tmp_path: Path, capsys) -> None:
    recipe, engines = trtllm_build()
    launch(recipe, engines, tmp_path / "reports", "--eval-id", "sweep")
    out = tmp_path / "reports" / "sweep"
    records = read_records(out)
    assert {r["condition"] for r in records} == {"ngram/D2/c1", "ngram/D4/c1"}
    assert {(r["method"], r["draft_len"]) for r in records} == {("ngram", 2), ("ngram", 4)}
    assert len(records) == 2 * 2 * 8 and not any(r.get("error") for r in records)
    assert all(r["top_logprobs"] for r in records)  # greedy: the servers were asked
    # one server at a time, each stopped: the baseline, then its speculating server, per D
    started = trtllm_serve("start")
    names = [Path(e["argv"][e["argv"].index("--config") + 1]).stem for e in started]
    assert names == ["baseline-for-ngram-d2", "ngram-d2", "baseline-for-ngram-d4", "ngram-d4"]
    assert len(trtllm_serve("signal")) == 4 and len(trtllm_serve("exit")) == 4
    assert started[3]["options"]["speculative_config"]["max_draft_len"] == 4
    assert "speculative_config" not in started[2]["options"]
    assert (out / "servers" / "ngram-d4.yaml").is_file() and (out / "servers" /
                                                              "ngram-d4.log").is_file()
    meta = json.loads((out / "eval.json").read_text())
    assert meta["launch"]["side_by_side"] is False and meta["server"] == "trtllm"
    capsys.readouterr()
    with pytest.raises(SystemExit):
        main(["decide", str(out), "--no-mlflow"])
    decision = json.loads((out / "decision.json").read_text())
    assert {v["condition"] for v in decision["verdicts"]} == {"ngram/D2/c1", "ngram/D4/c1"}
    overall = [v for v in decision["verdicts"] if v["category"] == "all"]
    assert all(v["greedy"] == {"identical": 8, "ties": 0, "diverged": 0, "unmeasured": 0}
               for v in overall)
    assert (out / "schedules" / "trtspec-policy.yaml").is_file()
    # the snippet for trtllm-serve where a D was GO (timing: the stand-in drafts for free,
    # but four requests on a busy machine may leave it INCONCLUSIVE)
    go = any(v["verdict"] == "GO" for v in decision["verdicts"])
    assert (out / "schedules" / "trtllm-speculative.yaml").is_file() == go
    assert "ngram/D4/c1" in (out / "report.md").read_text()
    # resumed: complete already, so no server is started again
    main(["eval", str(recipe), "--resume", str(out), "--engines", str(engines), "--no-mlflow"])
    assert len(trtllm_serve("start")) == 4 and len(read_records(out)) == 32


def test_side_by_side_both_servers_run_at_once_with_a_kv_cache_fraction_each_and_the_same_scheduler(
        trtllm_build, trtllm_serve, tmp_path: Path) -> None:
    recipe, engines = trtllm_build((4,))
    d4 = engines / "standin-ngram" / "h200" / "llmapi" / "ngram-d4.yaml"
    two_model = yaml.safe_load(d4.read_text()) | {"disable_overlap_scheduler": True}
    d4.write_text(yaml.safe_dump(two_model))
    launch(recipe, engines, tmp_path / "reports", "--eval-id", "sbs", "--side-by-side")
    started = trtllm_serve("start")
    assert len(started) == 2
    for event in started:
        argv = event["argv"]
        assert argv[argv.index("--kv_cache_free_gpu_memory_fraction") + 1] == "0.4"
        assert event["options"]["disable_overlap_scheduler"] is True  # the baseline too
    assert len(read_records(tmp_path / "reports" / "sbs")) == 16


def test_a_near_tie_divergence_is_a_tie_and_a_wide_one_is_not(
        trtllm_build, trtllm_serve, tmp_path: Path, monkeypatch) -> None:
    recipe, engines = trtllm_build((2,))
    # the speculating server takes the runner-up at output position 3
    monkeypatch.setenv("TRTLLM_STANDIN_TIE_AT", "3")
    for name, margin in (("near", "0.01"), ("wide", "2.0")):
        monkeypatch.setenv("TRTLLM_STANDIN_TIE_MARGIN", margin)
        launch(recipe, engines, tmp_path / "reports", "--eval-id", name)
        out = tmp_path / "reports" / name
        found = read_jsonl(out / DIVERGENCES)
        assert len(found) == 8 and {d["position"] for d in found} == {3}
        for d in found:  # a runner-up pushed out of the top 5: a lower bound, no margin
            assert d["margin"] == pytest.approx(float(margin), abs=1e-6) or (
                name == "wide" and d["margin"] is None and 0.5 < d["margin_at_least"] < 2.0)
        with pytest.raises(SystemExit):
            main(["decide", str(out), "--no-mlflow"])
        greedy = next(v["greedy"] for v in json.loads((out / "decision.json").read_text())[
            "verdicts"] if v["category"] == "all")
        assert greedy == ({"identical": 0, "ties": 8, "diverged": 0, "unmeasured": 0}
                          if name == "near" else
                          {"identical": 0, "ties": 0, "diverged": 8, "unmeasured": 0})


def test_launch_refuses_what_it_cannot_run_in_one_line(
        trtllm_build, tmp_path: Path, capsys, monkeypatch) -> None:
    recipe, engines = trtllm_build()
    for args, said in ((["--launch", "--endpoint", "http://x/v1"], "drop --endpoint"),
                       (["--side-by-side"], "add --launch")):
        with pytest.raises(SystemExit) as e:
            main(["eval", str(recipe), "--engines", str(engines), *args])
        assert e.value.code == 2
        assert said in capsys.readouterr().err
    monkeypatch.setenv("PATH", str(tmp_path))  # no trtllm-serve
    with pytest.raises(SystemExit) as e:
        launch(recipe, engines, tmp_path / "reports")
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and len(err.splitlines()) == 1
    assert "trtllm-serve" in err and "trtspec[trtllm]" in err and "docs/gpu.md" in err
    assert not (tmp_path / "reports").exists()
