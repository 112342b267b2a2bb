"""MLflow logging against a real server: runs, names, artifacts; down-then-sync, no duplicates."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import free_port

from trtspec.cli import main
from trtspec.eval.run import read_records, run_eval, summarize
from trtspec.tracking import condition_metrics, log_eval


def toy_eval(out: Path) -> Path:
    import sys

    sys.path.insert(0, str(Path(__file__).parent / "eval"))
    from eval_driver import toy_inputs

    inputs = toy_inputs(n_requests=4)
    run_eval(out, inputs)
    (out / "summary.json").write_text(json.dumps(summarize(read_records(out))))
    (out / "eval.json").write_text(json.dumps({
        "recipe": "toy-tracking", "recipe_digest": "d" * 64, "workloads": ["toy"],
        "requests": 4, "conditions": [c.key for c in inputs.conditions]}))
    return out


def test_eval_is_logged_as_parent_and_nested_runs(tmp_path: Path, mlflow_server: str) -> None:
    from mlflow.tracking import MlflowClient

    out = toy_eval(tmp_path / "toy-eval-1")
    receipt = log_eval(out, mlflow_server)
    client = MlflowClient(tracking_uri=mlflow_server)
    parent = client.get_run(receipt["run_id"])
    assert parent.data.tags["trtspec.eval_id"] == "toy-eval-1"
    assert parent.data.params["recipe_digest"] == "d" * 64
    assert {"records.jsonl", "summary.json", "eval.json"} <= {
        a.path for a in client.list_artifacts(receipt["run_id"])}
    parent_filter = f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'"
    children = client.search_runs([receipt["experiment_id"]], filter_string=parent_filter)
    assert len(children) == 4
    metrics = client.get_run(receipt["conditions"]["draft_model/D4/c2"]).data.metrics
    for name in ("perf/tpot_p50_ms", "perf/ttft_p99_ms", "baseline/tpot_p50_ms", "spec/al_pooled",
                 "spec/al_request_mean", "spec/acceptance_rate", "spec/acceptance_pos/0",
                 "spec/category_al/copy", "speedup/tpot_p50"):
        assert name in metrics, name
    assert metrics["spec/al_pooled"] > 1.0


def test_server_down_then_sync_logs_once(tmp_path: Path, mlflow_server: str, capsys) -> None:
    from mlflow.tracking import MlflowClient

    out = toy_eval(tmp_path / "toy-eval-2")
    dead = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(SystemExit) as exit_info:
        main(["sync", str(out), "--mlflow-uri", dead])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "unreachable" in err and "Traceback" not in err
    assert len(read_records(out)) == 4 * 2 * 4  # nothing measured was lost
    main(["sync", str(out), "--mlflow-uri", mlflow_server])
    first = json.loads((out / "mlflow.json").read_text())
    main(["sync", str(out), "--mlflow-uri", mlflow_server])  # receipt: no-op
    (out / "mlflow.json").unlink()
    main(["sync", str(out), "--mlflow-uri", mlflow_server])  # receipt lost: the tag finds it
    client = MlflowClient(tracking_uri=mlflow_server)
    parents = client.search_runs([first["experiment_id"]],
                                 filter_string="tags.`trtspec.eval_id` = 'toy-eval-2' and "
                                               "tags.`trtspec.level` = 'eval'")
    assert len(parents) == 1 and parents[0].info.run_id == first["run_id"]


def test_metric_names_on_a_hand_built_summary() -> None:
    entry = {"baseline": {"tpot_ms_p50": 60.0, "al_pooled": 1.0},
             "spec": {"tpot_ms_p50": 30.0, "ttft_ms_p99": 80.0, "al_pooled": 3.0,
                      "acceptance_rate": float("nan"), "acceptance_per_position": [0.5]},
             "speedup_tpot_p50": 2.0}
    records = [{"condition": "k", "arm": "spec", "category": "a", "emitted_tokens": 6,
                "verification_rounds": 2}]
    metrics = condition_metrics(entry, records, "k")
    assert metrics == {"perf/tpot_p50_ms": 30.0, "perf/ttft_p99_ms": 80.0,
                       "baseline/tpot_p50_ms": 60.0, "spec/al_pooled": 3.0,
                       "spec/acceptance_pos/0": 0.5, "speedup/tpot_p50": 2.0,
                       "spec/category_al/a": 3.0}
