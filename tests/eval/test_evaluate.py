"""`trtspec eval` on SmolLM2 (small): build → eval → records and summary; clear errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trtspec.audit import PROMPTS
from trtspec.cli import main
from trtspec.eval.run import read_records

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes" / "cpu-smollm2.yaml"
SMALL = ("methods=[{method: ngram}]", "draft_lengths=[4]", "sampling.max_tokens=32",
         "eval.concurrency=[1]", "eval.warmup=1", "eval.per_category=null")


def test_eval_smollm2_end_to_end(tmp_path: Path, smollm2, mlflow_server, capsys) -> None:
    from mlflow.tracking import MlflowClient

    workload = tmp_path / "w.jsonl"
    rows = [{"id": f"copy-{i}", "category": "copy", "prompt":
             f"Repeat exactly: the {w} fox jumps over the lazy dog. the {w} fox jumps"}
            for i, w in enumerate(["red", "brown", "grey"])]
    rows += [{"id": f"chat-{i}", "category": "chat", "prompt": p}
             for i, p in enumerate(["Name a colour.", "Say hello.", "Count to three."])]
    workload.write_text("".join(json.dumps(r) + "\n" for r in rows))
    sets = [a for s in SMALL for a in ("--set", s)]
    main(["build", str(RECIPE), "--engines", str(tmp_path / "engines"), *sets])
    main(["eval", str(RECIPE), "--engines", str(tmp_path / "engines"), "--reports",
          str(tmp_path / "reports"), "--eval-id", "e1", "-w", str(workload), *sets,
          "--mlflow-uri", mlflow_server])
    out = tmp_path / "reports" / "e1"
    printed = capsys.readouterr().out
    assert "ngram/D4/c1" in printed and "records: " in printed
    records = read_records(out)
    assert len(records) == 2 * 6 and {r["category"] for r in records} == {"copy", "chat"}
    assert all(r["output_tokens"] <= 32 for r in records)
    summary = json.loads((out / "summary.json").read_text())["ngram/D4/c1"]
    assert summary["spec"]["al_pooled"] > 1.0 and summary["baseline"]["al_pooled"] == 1.0
    assert {"recipe.yaml", "manifest.json", "eval.json"} <= {p.name for p in out.iterdir()}
    receipt = json.loads((out / "mlflow.json").read_text())
    client = MlflowClient(tracking_uri=mlflow_server)
    parent = client.get_run(receipt["run_id"])
    assert parent.data.params["recipe.target.model"] == "smollm2-135m-instruct"
    assert parent.data.tags["backend"] == "torch" and parent.data.tags["gpu"] == "cpu"
    child = client.get_run(receipt["conditions"]["ngram/D4/c1"])
    assert child.data.tags["method"] == "ngram" and child.data.metrics["spec/al_pooled"] > 1.0
    assert "spec/category_al/copy" in child.data.metrics
    # audit the models this eval measured, then decide: the report lands in the same run
    with pytest.raises(SystemExit) as exit_info:
        main(["audit", str(out), "--samples", "300", "--prompt", PROMPTS[0]])
    assert exit_info.value.code == 0
    audit = json.loads((out / "audit.json").read_text())
    assert audit["methods"]["ngram"]["passed"] and audit["sampling"]["temperature"] == 1.0
    assert audit["methods"]["ngram"]["prompts"][0]["rejected"] > 0.05
    with pytest.raises(SystemExit) as exit_info:
        main(["decide", str(out)])
    assert exit_info.value.code in (0, 1)
    decision = json.loads((out / "decision.json").read_text())
    verdict = decision["verdicts"][0]["verdict"]
    assert "no exactness audit" not in " ".join(decision["verdicts"][0]["reasons"])
    assert "report, verdicts and audit logged to run" in capsys.readouterr().out
    parent = client.get_run(receipt["run_id"])
    assert parent.data.tags["verdict.ngram/D4/c1"] == verdict
    assert parent.data.tags["audit.ngram"] == "pass"
    assert {a.path for a in client.list_artifacts(receipt["run_id"], "decision")} == {
        "decision/report.html", "decision/report.md", "decision/decision.json",
        "decision/audit.json"}
    assert client.get_run(receipt["conditions"]["ngram/D4/c1"]).data.tags["verdict"] == verdict
    with pytest.raises(SystemExit) as exit_info:  # the same eval id again without --resume
        main(["eval", str(RECIPE), "--engines", str(tmp_path / "engines"), "--reports",
              str(tmp_path / "reports"), "--eval-id", "e1", "-w", str(workload), *sets])
    assert exit_info.value.code == 2 and "--resume" in capsys.readouterr().err
    main(["eval", str(RECIPE), "--resume", str(out), "--engines", str(tmp_path / "engines"),
          "-w", str(workload), *sets, "--no-mlflow"])  # nothing left to do
    assert len(read_records(out)) == 12


def test_eval_with_mlflow_down_keeps_everything_then_syncs(tmp_path: Path, smollm2,
                                                         mlflow_server, capsys) -> None:
    from conftest import free_port

    sets = [a for s in (*SMALL, "eval.warmup=0") for a in ("--set", s)]
    workload = tmp_path / "w.jsonl"
    workload.write_text(json.dumps({"id": "a", "category": "c", "prompt": "Say hi."}) + "\n")
    main(["build", str(RECIPE), "--engines", str(tmp_path / "engines"), *sets])
    main(["eval", str(RECIPE), "--engines", str(tmp_path / "engines"), "--reports",
          str(tmp_path / "reports"), "--eval-id", "down", "-w", str(workload), *sets,
          "--mlflow-uri", f"http://127.0.0.1:{free_port()}"])
    out = tmp_path / "reports" / "down"
    err = capsys.readouterr().err
    assert "MLflow: not logged" in err and f"trtspec sync {out}" in err
    assert len(read_records(out)) == 2 and not (out / "mlflow.json").exists()
    main(["sync", str(out), "--mlflow-uri", mlflow_server])
    assert json.loads((out / "mlflow.json").read_text())["run_id"]


def test_eval_needs_a_current_build(tmp_path: Path, capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["eval", str(RECIPE), "--engines", str(tmp_path / "none")])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "run `trtspec build RECIPE` first" in err
