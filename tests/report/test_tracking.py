"""MLflow logging against a real server: runs, names, artifacts; down-then-sync, no duplicates."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from conftest import free_port

from trtspec.cli import main
from trtspec.eval.run import read_records, run_eval, summarize
from trtspec.report.tracking import _origin_tags, condition_metrics, log_eval
from trtspec.report.tracking.client import TrackingUnavailable

ROOT = Path(__file__).resolve().parents[2]


def toy_eval(out: Path) -> Path:
    import sys

    sys.path.insert(0, str(Path(__file__).parents[1] / "eval"))
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
    assert f"MLflow: logged as run {first['run_id']}" in capsys.readouterr().out
    main(["sync", str(out), "--mlflow-uri", mlflow_server])  # receipt: no-op
    assert "already logged (its mlflow.json receipt)" in capsys.readouterr().out
    (out / "mlflow.json").unlink()
    main(["sync", str(out), "--mlflow-uri", mlflow_server])  # receipt lost: the tag finds it
    assert (f"already logged (found by its eval id) as run {first['run_id']}"
            in capsys.readouterr().out)
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


def test_the_mean_chosen_draft_length_is_logged_once() -> None:
    entry = {"baseline": {"draft_len_mean": 0.0}, "spec": {"draft_len_mean": 2.5,
                                                          "draft_len_share": {"0": 0.5}}}
    assert condition_metrics(entry, [], "ngram/Dadaptive/c1") == {"spec/draft_len_mean": 2.5}


def _parents(client, experiment_id: str, eval_id: str) -> list:
    return client.search_runs([experiment_id],
                              filter_string=f"tags.`trtspec.eval_id` = '{eval_id}' and "
                                            "tags.`trtspec.level` = 'eval'")


def _children(client, experiment_id: str, run_id: str) -> list:
    return client.search_runs([experiment_id],
                              filter_string=f"tags.`mlflow.parentRunId` = '{run_id}'")


def _edit_meta(out: Path, **changes) -> None:
    meta = json.loads((out / "eval.json").read_text())
    (out / "eval.json").write_text(json.dumps(meta | changes))


def test_failed_parent_is_deleted_and_the_eval_logged_again(tmp_path: Path, mlflow_server: str,
                                                            monkeypatch) -> None:
    """A sync that broke inside the run leaves a FAILED parent: the next sync must not adopt
    it (it has no conditions), but delete it and log everything again."""
    from mlflow.tracking import MlflowClient

    import trtspec.report.tracking as tracking

    out = toy_eval(tmp_path / "toy-eval-failed")
    real, calls = tracking.condition_metrics, []

    def fail_once(*args):
        calls.append(args)
        if len(calls) == 1:
            raise RuntimeError("disk hiccup")
        return real(*args)

    monkeypatch.setattr(tracking, "condition_metrics", fail_once)
    with pytest.raises(RuntimeError, match="disk hiccup"):
        log_eval(out, mlflow_server)
    assert not (out / "mlflow.json").exists()
    client = MlflowClient(tracking_uri=mlflow_server)
    experiment_id = client.get_experiment_by_name("toy-tracking").experiment_id
    (failed,) = _parents(client, experiment_id, "toy-eval-failed")
    assert failed.info.status == "FAILED"
    assert len(_children(client, experiment_id, failed.info.run_id)) == 1

    receipt = log_eval(out, mlflow_server)
    assert receipt["run_id"] != failed.info.run_id
    assert client.get_run(receipt["run_id"]).info.status == "FINISHED"
    summary = json.loads((out / "summary.json").read_text())
    assert set(receipt["conditions"]) == set(summary)
    children = _children(client, experiment_id, receipt["run_id"])
    assert {c.info.run_id for c in children} == set(receipt["conditions"].values())
    assert all(c.info.status == "FINISHED" for c in children)
    assert [r.info.run_id for r in _parents(client, experiment_id, "toy-eval-failed")] == [
        receipt["run_id"]]  # the failed parent is deleted …
    assert not _children(client, experiment_id, failed.info.run_id)  # … and its nested run
    assert json.loads((out / "mlflow.json").read_text()) | {"status": "logged"} == receipt


def test_lost_receipt_adopts_the_run_with_its_conditions(tmp_path: Path,
                                                         mlflow_server: str) -> None:
    """The receipt rebuilt from the server names each condition's run (log_decision needs
    them), and nothing is logged twice."""
    from mlflow.tracking import MlflowClient

    out = toy_eval(tmp_path / "toy-eval-lost")
    first = log_eval(out, mlflow_server)
    (out / "mlflow.json").unlink()
    second = log_eval(out, mlflow_server)
    assert first.pop("status") == "logged" and second.pop("status") == "found"
    assert second == first and len(first["conditions"]) == 4
    assert json.loads((out / "mlflow.json").read_text()) == first
    client = MlflowClient(tracking_uri=mlflow_server)
    assert len(_parents(client, first["experiment_id"], "toy-eval-lost")) == 1
    assert len(_children(client, first["experiment_id"], first["run_id"])) == 4
    child = client.get_run(first["conditions"]["draft_model/D4/c2"])
    assert child.data.tags["trtspec.condition"] == "draft_model/D4/c2"


def test_params_are_the_recipe_with_its_overrides(tmp_path: Path, mlflow_server: str) -> None:
    """`--set` overrides change what ran: the params show the validated recipe after them,
    and the raw YAML only when the folder's recipe no longer validates."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=mlflow_server)
    out = toy_eval(tmp_path / "toy-eval-recipe")
    shutil.copyfile(ROOT / "recipes" / "cpu-smollm2.yaml", out / "recipe.yaml")
    _edit_meta(out, overrides=["sampling.max_tokens=7", "methods.0.max_n=4"])
    params = client.get_run(log_eval(out, mlflow_server)["run_id"]).data.params
    assert params["recipe.sampling.max_tokens"] == "7"
    assert params["recipe.methods.0.max_n"] == "4"
    assert params["recipe.sampling.seed"] == "0"  # a default the file leaves out

    old = toy_eval(tmp_path / "toy-eval-old-recipe")
    (old / "recipe.yaml").write_text("name: old\nsampling:\n  max_tokens: 9\n")
    params = client.get_run(log_eval(old, mlflow_server)["run_id"]).data.params
    assert params["recipe.sampling.max_tokens"] == "9" and "recipe.sampling.seed" not in params


def test_endpoint_eval_is_tagged_with_its_server(tmp_path: Path, mlflow_server: str) -> None:
    from mlflow.tracking import MlflowClient

    out = toy_eval(tmp_path / "toy-eval-endpoint")
    url = "http://gpu-box:8000/v1"
    _edit_meta(out, endpoint=url, server="vllm", model="m")
    receipt = log_eval(out, mlflow_server)
    client = MlflowClient(tracking_uri=mlflow_server)
    for run_id in (receipt["run_id"], receipt["conditions"]["draft_model/D4/c2"]):
        tags = client.get_run(run_id).data.tags
        assert (tags["backend"], tags["gpu"], tags["endpoint"]) == ("endpoint:vllm", "remote",
                                                                    url)


def test_origin_tags_without_a_server() -> None:
    assert _origin_tags({"endpoint": "http://h/v1"}, None) == {
        "backend": "endpoint:unknown", "gpu": "remote", "endpoint": "http://h/v1"}
    assert _origin_tags({"endpoint": "http://h/v1"}, {"backend": "torch", "gpu": None}) == {
        "backend": "torch", "gpu": "cpu"}
    assert _origin_tags({}, {"backend": "trtllm", "gpu": {"name": "H200"}}) == {
        "backend": "trtllm", "gpu": "H200"}
    assert _origin_tags({}, None) == {"backend": "toy", "gpu": "cpu"}


@pytest.mark.parametrize("kind", ["mlflow", "connection"])
def test_server_errors_become_tracking_unavailable(tmp_path: Path, mlflow_server: str,
                                                   monkeypatch, kind: str) -> None:
    """Callers (the CLI, the eval) catch one exception type with a one-line message."""
    import requests
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    error = MlflowException("RESOURCE_EXHAUSTED: too many requests\n  details …") \
        if kind == "mlflow" else requests.exceptions.ConnectionError("Connection reset\nmore")

    def refuse(*args, **kwargs):
        raise error

    monkeypatch.setattr(MlflowClient, "search_runs", refuse)
    out = toy_eval(tmp_path / f"toy-eval-{kind}-error")
    with pytest.raises(TrackingUnavailable) as info:
        log_eval(out, mlflow_server)
    message = str(info.value)
    assert mlflow_server in message and "\n" not in message
    assert ("too many requests" if kind == "mlflow" else "Connection reset") in message
    assert not (out / "mlflow.json").exists()


@pytest.mark.parametrize("missing", ["eval.json", "summary.json", "records.jsonl"])
def test_not_an_eval_folder_is_a_value_error(tmp_path: Path, missing: str) -> None:
    for name in ("eval.json", "summary.json", "records.jsonl"):
        if name != missing:
            (tmp_path / name).write_text("{}\n")
    dead = f"http://127.0.0.1:{free_port()}"  # never asked: the folder is checked first
    with pytest.raises(ValueError, match=f"no {missing} .*`trtspec eval` writes it"):
        log_eval(tmp_path, dead)


def test_an_eval_synced_then_resumed_replaces_its_run(tmp_path: Path, mlflow_server: str,
                                                      capsys) -> None:
    """Synced after Ctrl-C with part of its records, then finished: sync logs it again from
    all of them and deletes the partial run (whose tag says how many records it had)."""
    from mlflow.tracking import MlflowClient

    out = toy_eval(tmp_path / "toy-eval-partial")
    path = out / "records.jsonl"
    full = path.read_text()
    path.write_text("".join(full.splitlines(keepends=True)[:10]))
    main(["sync", str(out), "--mlflow-uri", mlflow_server])
    partial = json.loads((out / "mlflow.json").read_text())
    assert partial["records"] == 10
    path.write_text(full)
    main(["sync", str(out), "--mlflow-uri", mlflow_server])
    assert "re-logged (the records changed since)" in capsys.readouterr().out
    receipt = json.loads((out / "mlflow.json").read_text())
    assert receipt["records"] == full.count("\n") and receipt["run_id"] != partial["run_id"]
    client = MlflowClient(tracking_uri=mlflow_server)
    parents = _parents(client, receipt["experiment_id"], "toy-eval-partial")
    assert [r.info.run_id for r in parents] == [receipt["run_id"]]
    assert parents[0].data.tags["trtspec.records"] == str(receipt["records"])


def test_two_folders_with_one_eval_id_keep_their_own_runs(tmp_path: Path,
                                                          mlflow_server: str) -> None:
    """Another folder's run (another machine, a copied folder) is neither adopted nor
    replaced: each eval.json carries its own folder id."""
    from mlflow.tracking import MlflowClient

    outs = [toy_eval(tmp_path / side / "toy-eval-twin") for side in ("a", "b")]
    for side, out in zip("ab", outs, strict=True):
        meta = json.loads((out / "eval.json").read_text())
        (out / "eval.json").write_text(json.dumps(meta | {"folder_id": side}))
    path = outs[1] / "records.jsonl"
    path.write_text("".join(path.read_text().splitlines(keepends=True)[:5]))
    receipts = [log_eval(out, mlflow_server) for out in outs]
    assert [r["status"] for r in receipts] == ["logged", "logged"]
    client = MlflowClient(tracking_uri=mlflow_server)
    parents = _parents(client, receipts[0]["experiment_id"], "toy-eval-twin")
    assert {r.info.run_id for r in parents} == {r["run_id"] for r in receipts}


# --- what a reviewer sees in the MLflow UI ---------------------------------------------------


def test_reviewer_views_kind_times_datasets_and_load_curves(tmp_path: Path,
                                                            mlflow_server: str) -> None:
    """The runs table opens (experiment kind), runs span the eval's own clock (not the time
    logging took), each run names the requests it measured as a dataset, and the parent has
    speedup and TPOT against concurrency as stepped metrics."""
    from mlflow.tracking import MlflowClient

    from trtspec.report.tracking.views import run_window

    out = toy_eval(tmp_path / "toy-eval-views")
    _edit_meta(out, recipe="toy-views")
    records = read_records(out)
    receipt = log_eval(out, mlflow_server)
    client = MlflowClient(tracking_uri=mlflow_server)
    experiment = client.get_experiment(receipt["experiment_id"])
    assert experiment.tags["mlflow.experimentKind"] == "custom_model_development"

    parent = client.get_run(receipt["run_id"])
    first = min(r["start_s"] for r in records)
    last = max(r["start_s"] + r["e2e_s"] for r in records)
    assert parent.info.start_time == int(first * 1000)
    assert parent.info.end_time >= int(last * 1000)
    assert parent.info.end_time == run_window(records)[1]
    for key, run_id in receipt["conditions"].items():
        rows = [r for r in records if r["condition"] == key]
        child = client.get_run(run_id)
        assert (child.info.start_time, child.info.end_time) == run_window(rows)
        assert child.info.status == "FINISHED"
        (dataset,) = child.inputs.dataset_inputs
        assert dataset.dataset.name == "toy" and len(dataset.dataset.digest) == 16
        assert json.loads(dataset.dataset.profile)["num_rows"] == 4

    (dataset,) = parent.inputs.dataset_inputs
    assert (dataset.dataset.name, json.loads(dataset.dataset.source)) == ("toy", {"uri": "toy"})
    assert {t.key: t.value for t in dataset.tags} == {"mlflow.data.context": "eval"}
    assert json.loads(dataset.dataset.profile) == {"num_rows": 4,
                                                   "categories": {"chat": 2, "copy": 2}}

    summary = json.loads((out / "summary.json").read_text())
    for d in (2, 4):
        history = client.get_metric_history(receipt["run_id"], f"speedup/draft_model_D{d}")
        assert sorted((m.step, m.value) for m in history) == [
            (c, summary[f"draft_model/D{d}/c{c}"]["speedup_tpot_p50"]) for c in (1, 2)]
        spec = client.get_metric_history(receipt["run_id"], f"tpot_p50_ms/spec_draft_model_D{d}")
        assert sorted(m.step for m in spec) == [1, 2]
        assert len(client.get_metric_history(receipt["run_id"],
                                             f"tpot_p50_ms/baseline_draft_model_D{d}")) == 2


def test_params_say_what_ran_not_what_the_recipe_file_asks(tmp_path: Path,
                                                          mlflow_server: str) -> None:
    """A custom JSONL runs whole whatever the recipe's eval.per_category: the params say so,
    and the dataset is named after the file and points at it."""
    from mlflow.tracking import MlflowClient

    out = toy_eval(tmp_path / "toy-eval-ran")
    shutil.copyfile(ROOT / "recipes" / "cpu-smollm2.yaml", out / "recipe.yaml")
    jsonl = str(tmp_path / "prompts.jsonl")
    _edit_meta(out, recipe="toy-ran", workloads=[jsonl],
               selection={"workloads": [jsonl], "per_category": None, "legacy": False},
               overrides=["eval.per_category=1"])
    receipt = log_eval(out, mlflow_server)
    client = MlflowClient(tracking_uri=mlflow_server)
    run = client.get_run(receipt["run_id"])
    params = run.data.params
    assert params["workloads"] == jsonl and params["per_category"] == f"{jsonl}=all"
    assert params["requests"] == "4" and params["requests_measured"] == "4"
    assert "recipe.eval.per_category" not in params and "recipe.eval.workloads" not in params
    (dataset,) = run.inputs.dataset_inputs
    assert dataset.dataset.name == "prompts"
    assert json.loads(dataset.dataset.source) == {"uri": jsonl}
    assert dataset.dataset.source_type == "local"


def test_decision_logs_a_verdict_table_and_the_schedules(tmp_path: Path,
                                                         mlflow_server: str) -> None:
    from mlflow.tracking import MlflowClient

    from trtspec.report.tracking import log_decision

    out = toy_eval(tmp_path / "toy-eval-decided")
    _edit_meta(out, recipe="toy-decided")
    receipt = log_eval(out, mlflow_server)
    verdicts = [{"condition": k, "category": cat, "verdict": v, "speedup": s, "ci": [lo, hi],
                 "requests": 4, "reasons": ["because"]}
                for k, cat, v, s, lo, hi in (
                    ("draft_model/D4/c1", "all", "GO", 1.4, 1.2, 1.6),
                    ("draft_model/D4/c1", "copy", "GO", 1.5, 1.1, 1.9),
                    ("draft_model/D2/c2", "all", "INCONCLUSIVE", 1.0, float("nan"), 1.3))]
    (out / "decision.json").write_text(json.dumps({"verdicts": verdicts}))
    (out / "schedules").mkdir()
    (out / "schedules" / "trtspec-policy.yaml").write_text("method: draft_model\n")
    (out / "schedules" / "vllm.yaml").write_text("speculative_config: {}\n")
    log_decision(out, receipt)
    log_decision(out, receipt)  # decide again: the table is replaced, not appended to
    client = MlflowClient(tracking_uri=mlflow_server)
    run_id = receipt["run_id"]
    assert {a.path for a in client.list_artifacts(run_id, "schedules")} == {
        "schedules/trtspec-policy.yaml", "schedules/vllm.yaml"}
    table = json.loads(Path(client.download_artifacts(run_id, "decision/verdicts.json",
                                                      str(tmp_path))).read_text())
    assert table["columns"][:4] == ["condition", "category", "verdict", "speedup"]
    assert [row[:3] for row in table["data"]] == [[v["condition"], v["category"], v["verdict"]]
                                                  for v in verdicts]
    assert table["data"][2][4] is None  # NaN bound: null
    logged = json.loads(client.get_run(run_id).data.tags["mlflow.loggedArtifacts"])
    assert logged == [{"path": "decision/verdicts.json", "type": "table"}]


def test_relative_local_stores_are_made_absolute(tmp_path: Path, monkeypatch) -> None:
    """The URI printed and kept in the receipt names one store from any folder."""
    from trtspec.report.tracking.client import tracking_uri

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert tracking_uri() == f"sqlite:///{tmp_path}/mlflow.db"
    assert tracking_uri("sqlite:///sub/m.db") == f"sqlite:///{tmp_path}/sub/m.db"
    assert tracking_uri("sqlite:////abs/m.db") == "sqlite:////abs/m.db"
    assert tracking_uri("file:mlruns") == f"file://{tmp_path}/mlruns"
    assert tracking_uri("mlruns") == f"file://{tmp_path}/mlruns"
    assert tracking_uri("http://127.0.0.1:5000") == "http://127.0.0.1:5000"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "sqlite:///env.db")
    assert tracking_uri() == f"sqlite:///{tmp_path}/env.db"
