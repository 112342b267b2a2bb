"""`trtspec approve` against a real MLflow server: the registered version, its tags and alias;
the refusals; and `trtspec serve --policy models:/<name>@approved` serving that version."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from test_tracking import ROOT, toy_eval

from trtspec.cli import main


def approvable(tmp_path: Path, name: str, **decision_changes) -> tuple[Path, Path]:
    """(a decided toy eval of recipe ``name`` with GO verdicts and a passing audit, the engines
    root holding the build it measured)."""
    import yaml

    from trtspec.analysis.policy import ServePolicy, write_policy
    from trtspec.build.manifest import Manifest
    from trtspec.build.recipe import load_recipe

    out = toy_eval(tmp_path / f"{name}-eval")
    recipe = yaml.safe_load((ROOT / "recipes" / "cpu-smollm2.yaml").read_text()) | {"name": name}
    (out / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    meta = json.loads((out / "eval.json").read_text())
    (out / "eval.json").write_text(json.dumps(meta | {"recipe": name}))
    built = load_recipe(out / "recipe.yaml")
    engines = tmp_path / "engines"
    manifest = Manifest(recipe=name, recipe_digest=built.digest(),
                        build_digest=built.build_digest(), build_inputs=built.build_inputs(),
                        methods=built.method_digests(), backend="torch", versions={},
                        draft_lengths=[2, 4], artifacts=[])
    manifest.save(engines / name / "cpu")
    (engines / name / "cpu" / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    shutil.copyfile(engines / name / "cpu" / "manifest.json", out / "manifest.json")
    verdicts = [{"condition": k, "category": "all", "verdict": v, "speedup": s, "ci": [lo, hi]}
                for k, v, s, lo, hi in (("draft_model/D4/c1", "GO", 1.5, 1.2, 1.8),
                                        ("draft_model/D2/c1", "GO", 1.3, 1.1, 1.5),
                                        ("draft_model/D4/c2", "NO-GO", 0.9, 0.8, 1.0),
                                        ("draft_model/D2/c2", "INCONCLUSIVE", 1.0, 0.9, 1.1))]
    audit = {"methods": {"draft_model": {"passed": True, "weak": False, "power": 0.93,
                                         "p_value": 0.41, "threshold": 0.001}}}
    decision = {"verdicts": verdicts, "criteria": {"require_audit": True},
                "audit_applies": True, "audit": audit} | decision_changes
    (out / "decision.json").write_text(json.dumps(decision))
    (out / "report.md").write_text("# report\n")
    (out / "schedules").mkdir()
    write_policy(out / "schedules" / "trtspec-policy.yaml",
                 ServePolicy("draft_model", ((1, 4), (2, 0)), ("draft_model",)), out.name)
    return out, engines


def run_approve(out: Path, engines: Path, uri: str, *extra: str) -> None:
    main(["approve", str(out), "--reviewer", "ana", "--mlflow-uri", uri, "--engines",
          str(engines), *extra])


def test_approval_registers_a_version_with_its_decision(tmp_path: Path, mlflow_server: str,
                                                        capsys) -> None:
    from mlflow.tracking import MlflowClient

    from trtspec.report.tracking import log_eval

    out, engines = approvable(tmp_path, "toy-approve")
    receipt = log_eval(out, mlflow_server)
    run_approve(out, engines, mlflow_server, "--note", "ship it")
    printed = capsys.readouterr().out
    assert "approved: registered model toy-approve version 1 (alias approved)" in printed
    assert "--policy models:/toy-approve@approved" in printed
    client = MlflowClient(tracking_uri=mlflow_server)
    version = client.get_model_version_by_alias("toy-approve", "approved")
    assert version.version == "1" and version.run_id == receipt["run_id"]  # the eval's run
    tags = version.tags
    assert tags["verdicts"] == ("draft_model/D4/c1=GO draft_model/D2/c1=GO "
                                "draft_model/D4/c2=NO-GO draft_model/D2/c2=INCONCLUSIVE")
    assert tags["audit"] == "pass (draft_model p=0.41)"
    assert (tags["eval_id"], tags["eval_run_id"], tags["reviewer"], tags["note"]) == (
        "toy-approve-eval", receipt["run_id"], "ana", "ship it")
    manifest = json.loads((out / "manifest.json").read_text())
    assert tags["build_digest"] == manifest["build_digest"]
    assert tags["policy"] == "draft_model 1:4,2:0"
    folder = version.source.removeprefix(f"runs:/{receipt['run_id']}/")
    assert {Path(a.path).name for a in client.list_artifacts(receipt["run_id"], folder)} >= {
        "recipe.yaml", "manifest.json", "decision.json", "report.md", "approval.json",
        "schedules"}
    assert client.get_run(receipt["run_id"]).data.tags["trtspec.approved_version"] == \
        "toy-approve/1"

    run_approve(out, engines, mlflow_server)  # approved again: a new version takes the alias
    assert client.get_model_version_by_alias("toy-approve", "approved").version == "2"
    assert client.get_registered_model("toy-approve").aliases == {"approved": "2"}


def _go_gone(decision: dict) -> dict:
    return {"verdicts": [v | {"verdict": "NO-GO"} for v in decision["verdicts"]]}


@pytest.mark.parametrize("case, message", [
    ("undecided", "was never decided (no decision.json)"),
    ("no-go", "no condition is GO"),
    ("failed-audit", "the exactness audit of draft_model failed"),
    ("weak-audit", "the exactness audit of draft_model is weak (power 0.42 < 0.8)"),
    ("no-audit", "has no exactness audit and the recipe requires one"),
    ("stale-build", "the build no longer matches what was measured"),
    ("resumed", "records.jsonl changed after it was decided"),
])
def test_refusals_register_nothing(tmp_path: Path, mlflow_server: str, capsys, case: str,
                                   message: str) -> None:
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    name = f"toy-refused-{case}"
    out, engines = approvable(tmp_path, name)
    decision = json.loads((out / "decision.json").read_text())
    if case == "undecided":
        (out / "decision.json").unlink()
    elif case == "no-go":
        (out / "decision.json").write_text(json.dumps(decision | _go_gone(decision)))
    elif case == "failed-audit":  # audited again after decide, and it failed
        (out / "audit.json").write_text(json.dumps({"methods": {"draft_model": {
            "passed": False, "p_value": 1e-5, "threshold": 0.001}}}))
    elif case == "weak-audit":  # it passed, but could not have failed: refused as a failure
        (out / "audit.json").write_text(json.dumps({"methods": {"draft_model": {
            "passed": True, "weak": True, "power": 0.42, "p_value": 0.3,
            "threshold": 0.001}}}))
    elif case == "no-audit":
        (out / "decision.json").write_text(json.dumps(decision | {"audit": None}))
    elif case == "resumed":  # more records measured after decide
        import os

        later = (out / "decision.json").stat().st_mtime + 5
        os.utime(out / "records.jsonl", (later, later))
    else:  # rebuilt since: other checkpoints behind the same recipe
        path = engines / name / "cpu" / "manifest.json"
        manifest = json.loads(path.read_text())
        manifest["artifacts"] = [{"name": "target", "role": "target", "source": "m",
                                  "path": "/m", "config_digest": "new"}]
        path.write_text(json.dumps(manifest))
    with pytest.raises(SystemExit) as exit_info:
        run_approve(out, engines, mlflow_server)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and message in err, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    with pytest.raises(MlflowException):
        MlflowClient(tracking_uri=mlflow_server).get_registered_model(name)


def test_serve_runs_the_approved_version(tmp_path: Path, mlflow_server: str) -> None:
    """A real `trtspec serve` process fetches the version the alias points at, says which,
    serves its policy and answers /v1/models."""
    import os
    import signal
    import subprocess
    import sys
    import time

    import requests
    from conftest import free_port

    out, engines = approvable(tmp_path, "toy-served")
    run_approve(out, engines, mlflow_server, "--note", "canary")
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "trtspec", "serve", "--backend", "toy", "--policy",
         "models:/toy-served@approved", "--port", str(port)],
        env={**os.environ, "MLFLOW_TRACKING_URI": mlflow_server}, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True)
    try:
        deadline, models = time.time() + 120, None
        while time.time() < deadline and proc.poll() is None:
            try:
                models = requests.get(f"http://127.0.0.1:{port}/v1/models", timeout=2)
                break
            except requests.ConnectionError:
                time.sleep(0.2)
        assert models is not None and models.ok, proc.communicate()
        assert [m["id"] for m in models.json()["data"]] == ["toy"]
    finally:
        proc.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 0, stderr
    assert ("policy: registered model toy-served version 1 (alias approved, approved by ana)"
            in stdout), stdout
    assert "policy: draft_model, D = 4 at 1" in stdout, stdout
    assert ("--policy models:/toy-served@approved: draft_model by running requests up to 2"
            in stdout), stdout


def test_a_policy_reference_that_names_nothing_is_one_line(mlflow_server: str, capsys,
                                                           monkeypatch) -> None:
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server)
    for ref, why in (("models:/no-such-model@approved", "no-such-model"),
                     ("models:/nameonly", "give models:/<name>@<alias>")):
        with pytest.raises(SystemExit) as exit_info:
            main(["serve", "--backend", "toy", "--policy", ref])
        err = capsys.readouterr().err
        assert exit_info.value.code == 2 and why in err and len(err.strip().splitlines()) == 1
