"""MLflow logging for an eval folder: one parent run per eval, one nested run per condition.

Logging reads the eval's files (records.jsonl, summary.json, eval.json, recipe.yaml,
manifest.json) after the measurements are safe on disk, so a tracking server that is down can
never cost a measurement: the eval says so, and ``trtspec sync reports/<eval-id>`` logs later. A
receipt (``mlflow.json``) and a ``trtspec.eval_id`` tag make a second sync a no-op.

Metric names are stable: ``perf/tpot_p50_ms``, ``perf/ttft_p99_ms``, ``baseline/…``,
``spec/al_pooled``, ``spec/al_request_mean``, ``spec/acceptance_rate``,
``spec/acceptance_pos/<i>``, ``spec/category_al/<category>``, ``speedup/tpot_p50`` …
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from trtspec.build.files import write_atomic
from trtspec.report.tracking.client import TrackingUnavailable, check_reachable, tracking_uri
from trtspec.report.tracking.views import (
    EXPERIMENT_KIND,
    datasets,
    load_metrics,
    log_verdict_table,
    ran_params,
    run_window,
)

RECEIPT = "mlflow.json"
STALE_RUNNING_S = 900  # a parent still RUNNING after this was left by a killed process
EVAL_FILES = ("eval.json", "summary.json", "records.jsonl")
LOGGING_SINCE = "trtspec.logging_since"  # epoch s when a sync created the run
SCHEDULES = "schedules"  # the decision's serving schedules, in the eval folder


def log_eval(out_dir: str | Path, uri: str | None = None) -> dict[str, Any]:
    """Log an eval folder to MLflow (once); returns the receipt.

    A finished parent run found by its ``trtspec.eval_id`` tag is adopted (the receipt was
    lost); a failed or interrupted one is deleted and the eval logged again, so a sync that
    broke halfway never leaves a run without its conditions behind a receipt. A run logged
    from fewer records (an eval synced after Ctrl-C, then resumed) is replaced the same way.
    The returned receipt's ``status`` says which: receipt, found, logged or relogged."""
    from mlflow.exceptions import MlflowException

    out = Path(out_dir)
    from trtspec.eval import require_files
    from trtspec.eval.run import read_records

    require_files(out, *EVAL_FILES)  # before any MLflow call: a wrong path is no server problem
    receipt_path = out / RECEIPT
    records = read_records(out)
    if receipt_path.is_file():
        receipt = json.loads(receipt_path.read_text())
        if receipt.get("records", len(records)) == len(records):
            return {**receipt, "status": "receipt"}
        uri = uri or receipt.get("uri")  # the store it went to
    uri = tracking_uri(uri)
    check_reachable(uri)
    meta = json.loads((out / "eval.json").read_text())
    summary = json.loads((out / "summary.json").read_text())
    try:
        receipt, status = _log(out, uri, meta, summary, records)
    except (MlflowException, OSError) as e:
        cause = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
        raise TrackingUnavailable(f"MLflow at {uri} failed: {cause}") from e
    write_atomic(receipt_path, json.dumps(receipt, indent=2) + "\n")
    return {**receipt, "status": status}


def _log(out: Path, uri: str, meta: dict[str, Any], summary: dict[str, Any],
         records: list[dict[str, Any]]) -> tuple[dict[str, Any], str]:
    """Adopt a finished parent run or log the eval anew; returns the receipt and "found" or
    "logged"."""
    from mlflow.entities import Metric, Param
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name(meta["recipe"])
    experiment_id = experiment.experiment_id if experiment else \
        client.create_experiment(meta["recipe"])
    if not (experiment and EXPERIMENT_KIND[0] in experiment.tags):  # the runs table, not traces
        client.set_experiment_tag(experiment_id, *EXPERIMENT_KIND)
    eval_id = out.name
    folder = meta.get("folder_id")  # another folder with the same eval id is another eval
    existing = [run for run in client.search_runs(
        [experiment_id], filter_string=f"tags.`trtspec.eval_id` = '{eval_id}' and "
                                       "tags.`trtspec.level` = 'eval'")
        if run.data.tags.get("trtspec.folder") in (None, folder)]
    logged = str(len(records))

    def current(run: Any) -> bool:  # logged whole, from the records there are now
        return run.info.status == "FINISHED" and run.data.tags.get(
            "trtspec.records", logged) == logged

    replaced = False
    for run in existing:  # FAILED, KILLED, RUNNING long after any logging would end, or stale
        age = time.time() - float(run.data.tags.get(LOGGING_SINCE, run.info.start_time / 1000))
        if run.info.status == "RUNNING" and age < STALE_RUNNING_S:
            raise TrackingUnavailable(f"run {run.info.run_id} of {eval_id} is being logged "
                                      f"right now (started {age:.0f} s ago): retry later")
        if not current(run):
            replaced |= run.info.status == "FINISHED"
            for child in _children(client, experiment_id, run.info.run_id):
                client.delete_run(child.info.run_id)
            client.delete_run(run.info.run_id)
    finished = [run for run in existing if current(run)]
    if finished:  # logged before, receipt lost: do not duplicate
        run_id = finished[0].info.run_id
        return {"uri": uri, "experiment_id": experiment_id, "run_id": run_id,
                "conditions": _condition_map(client, experiment_id, run_id),
                "records": len(records)}, "found"

    tags = {"trtspec.eval_id": eval_id, "trtspec.level": "eval", "trtspec.records": logged,
            **({"trtspec.folder": folder} if folder else {}), "git_sha": _git_sha(),
            **_origin_tags(meta, _read_json(out / "manifest.json"))}
    params: dict[str, Any] = {"recipe_digest": meta.get("recipe_digest", ""),
                              "manifest_digest": _digest(out / "manifest.json")}
    recipe = _recipe_data(out)
    params |= ran_params(meta, recipe, records)  # what ran, not what the recipe file asks
    params |= {k: v for k, v in _flatten(recipe, "recipe").items()
               if k not in ("recipe.eval.workloads", "recipe.eval.per_category")}
    start, end = run_window(records)
    parent = client.create_run(experiment_id, start_time=start, run_name=eval_id,
                               tags=_run_tags(tags))
    run_id = parent.info.run_id
    conditions: dict[str, str] = {}
    with _terminated(client, run_id, end):
        client.log_batch(run_id, params=[Param(k, str(v)[:500]) for k, v in params.items()])
        for name in ("records.jsonl", "summary.json", "eval.json", "recipe.yaml",
                     "manifest.json"):
            if (out / name).is_file():
                client.log_artifact(run_id, str(out / name))
        workloads = meta.get("workloads", [])
        client.log_inputs(run_id, datasets(records, workloads))
        for key, entry in summary.items():
            method, d, c = key.split("/")
            rows = [r for r in records if r["condition"] == key]
            c_start, c_end = run_window(rows)
            child = client.create_run(experiment_id, start_time=c_start, run_name=key, tags={
                **_run_tags(tags), "trtspec.level": "condition", "trtspec.condition": key,
                "method": method, "mlflow.parentRunId": run_id})
            conditions[key] = child.info.run_id
            with _terminated(client, child.info.run_id, c_end):
                client.log_batch(child.info.run_id, params=[
                    Param("method", method), Param("draft_len", d[1:]),
                    Param("concurrency", c[1:])])
                stamp = c_end or int(time.time() * 1000)
                client.log_batch(child.info.run_id, metrics=[
                    Metric(k, v, stamp, 0) for k, v in
                    condition_metrics(entry, records, key).items()])
                client.log_inputs(child.info.run_id, datasets(rows, workloads))
        client.log_batch(run_id, metrics=load_metrics(summary, records))
    return {"uri": uri, "experiment_id": experiment_id, "run_id": run_id,
            "conditions": conditions, "records": len(records)}, \
        "relogged" if replaced else "logged"


def _run_tags(tags: dict[str, str]) -> dict[str, str]:
    """MLflow's own run tags (user, source, git commit) as ``mlflow.start_run`` sets them, plus
    ours, and the time logging began: a run carries the eval's start time, so its age says
    nothing about whether a sync is still writing it."""
    from mlflow.tracking.context.registry import resolve_tags

    return resolve_tags({**tags, LOGGING_SINCE: f"{time.time():.0f}"})


@contextlib.contextmanager
def _terminated(client: Any, run_id: str, end: int | None) -> Iterator[None]:
    """End a run at ``end`` (the records' clock) when its body logged everything, else mark it
    FAILED (KILLED on Ctrl-C), so the next sync replaces it rather than adopting it."""
    try:
        yield
    except KeyboardInterrupt:
        client.set_terminated(run_id, "KILLED")
        raise
    except BaseException:
        client.set_terminated(run_id, "FAILED")
        raise
    client.set_terminated(run_id, "FINISHED", end_time=end)


def _children(client: Any, experiment_id: str, run_id: str) -> list[Any]:
    return client.search_runs([experiment_id],
                              filter_string=f"tags.`mlflow.parentRunId` = '{run_id}'")


def _condition_map(client: Any, experiment_id: str, run_id: str) -> dict[str, str]:
    """condition key → nested run id, so log_decision can tag each condition's run."""
    return {(r.data.tags.get("trtspec.condition") or r.data.tags.get("mlflow.runName")
             or r.info.run_name): r.info.run_id
            for r in _children(client, experiment_id, run_id)}


def _origin_tags(meta: dict[str, Any], manifest: dict[str, Any] | None) -> dict[str, str]:
    """Where the numbers came from: the in-process build's backend and GPU, or the endpoint's
    server (on a machine trtspec cannot see); "toy"/"cpu" only for folders with neither."""
    if manifest is not None:
        return {"backend": manifest.get("backend") or "toy",
                "gpu": (manifest.get("gpu") or {}).get("name") or "cpu"}
    if meta.get("endpoint"):
        return {"backend": f"endpoint:{meta.get('server') or 'unknown'}", "gpu": "remote",
                "endpoint": str(meta["endpoint"])}
    return {"backend": "toy", "gpu": "cpu"}


def _recipe_data(out: Path) -> dict[str, Any]:
    """The recipe the eval ran (recipe.yaml with eval.json's --set overrides, validated); the
    raw YAML when it does not validate (an older schema), nothing when there is none."""
    import yaml

    from trtspec.eval import eval_recipe

    try:
        return eval_recipe(out).model_dump(mode="json")
    except ValueError:  # RecipeError and pydantic's ValidationError
        pass
    try:
        data = _read_yaml(out / "recipe.yaml")
    except yaml.YAMLError:
        return {}
    return data if isinstance(data, dict) else {}


def log_decision(out_dir: str | Path, receipt: dict[str, Any]) -> None:
    """Attach the decision to the eval's runs: report.html, report.md, decision.json and
    audit.json as artifacts of the parent run, every verdict as a table (``decision/
    verdicts.json``), the serving schedules (``schedules/``), a ``verdict`` tag and
    ``decide/*`` metrics on each condition's run, and on the parent the verdict's speedup and
    CI against load (``decide/speedup/<method>_D<d>`` …, step = concurrency). Re-running
    decide overwrites the artifacts and the table and adds a metric step."""
    from mlflow.tracking import MlflowClient

    out = Path(out_dir)
    check_reachable(receipt["uri"])
    client = MlflowClient(tracking_uri=receipt["uri"])
    run_id = receipt["run_id"]
    decision = json.loads((out / "decision.json").read_text())
    for name in ("report.html", "report.md", "decision.json", "audit.json"):
        if (out / name).is_file():
            client.log_artifact(run_id, str(out / name), artifact_path="decision")
    log_verdict_table(client, run_id, decision)
    experiment = client.get_experiment(receipt["experiment_id"])  # logged by an older trtspec
    if EXPERIMENT_KIND[0] not in experiment.tags:
        client.set_experiment_tag(experiment.experiment_id, *EXPERIMENT_KIND)
    if (out / SCHEDULES).is_dir() and any(p.is_file() for p in (out / SCHEDULES).rglob("*")):
        client.log_artifacts(run_id, str(out / SCHEDULES), artifact_path=SCHEDULES)
    overall = [v for v in decision["verdicts"] if v["category"] == "all"]
    for v in overall:
        client.set_tag(run_id, f"verdict.{v['condition']}", v["verdict"])
        child = receipt.get("conditions", {}).get(v["condition"])
        if child:
            client.set_tag(child, "verdict", v["verdict"])
            for name, value in (("speedup", v["speedup"]), ("ci_low", v["ci"][0]),
                                ("ci_high", v["ci"][1])):
                if value == value:  # NaN when there were too few requests
                    client.log_metric(child, f"decide/{name}", float(value))
        method, d, c = v["condition"].split("/")  # the verdict's speedup against load
        for name, value in (("speedup", v["speedup"]), ("ci_low", v["ci"][0]),
                            ("ci_high", v["ci"][1])):
            if value == value:
                client.log_metric(run_id, f"decide/{name}/{method}_{d}", float(value),
                                  step=int(c.removeprefix("c")))
    client.log_metric(run_id, "decide/go_conditions",
                      float(sum(v["verdict"] == "GO" for v in overall)))
    for method, m in ((decision.get("audit") or {}).get("methods") or {}).items():
        client.log_metric(run_id, f"audit/{method}/p_value", float(m["p_value"]))
        if "power" in m:  # the power it states (an audit of an earlier trtspec states none)
            client.log_metric(run_id, f"audit/{method}/power", float(m["power"]))
        client.set_tag(run_id, f"audit.{method}", ("pass" if m["passed"] else "fail") +
                       (" (weak)" if m.get("weak") else ""))


def condition_metrics(entry: dict[str, Any], records: list[dict[str, Any]], key: str
                      ) -> dict[str, float]:
    """Stable MLflow metric names for one condition's summary (+ AL per category)."""
    out: dict[str, float] = {}
    for arm, prefix in (("spec", "perf"), ("baseline", "baseline")):
        for name, value in entry.get(arm, {}).items():
            if isinstance(value, int | float) and name.endswith(
                    ("_mean", "_p50", "_p90", "_p99", "_per_s")) and name != "draft_len_mean":
                out[f"{prefix}/{_metric_name(name)}"] = float(value)
    spec = entry.get("spec", {})
    for name in ("al_pooled", "al_request_mean", "acceptance_rate", "alpha", "proposed_tokens",
                 "accepted_draft_tokens", "emitted_tokens", "verification_rounds",
                 "discarded_tokens", "rejected_rounds", "failed_requests", "draft_len_mean"):
        if isinstance(spec.get(name), int | float) and spec[name] == spec[name]:  # not NaN
            out[f"spec/{name}"] = float(spec[name])
    for i, rate in enumerate(spec.get("acceptance_per_position", [])):
        if rate == rate:
            out[f"spec/acceptance_pos/{i}"] = float(rate)
    for name, value in entry.items():
        if name.startswith("speedup_"):
            out[f"speedup/{name.removeprefix('speedup_')}"] = float(value)
    emitted: dict[str, list[int]] = {}
    for r in records:
        if r["condition"] == key and r["arm"] == "spec":
            e = emitted.setdefault(r["category"], [0, 0])
            e[0] += r["emitted_tokens"]
            e[1] += r["verification_rounds"]
    for category, (tokens, rounds) in emitted.items():
        if rounds:
            out[f"spec/category_al/{category}"] = tokens / rounds
    return out


def _metric_name(name: str) -> str:
    """ttft_ms_p50 → ttft_p50_ms (the unit last, as the issue's names read)."""
    for unit in ("_ms",):
        if unit in name:
            base, _, stat = name.partition(unit + "_")
            return f"{base}_{stat}{unit}"
    return name


def _flatten(data: Any, prefix: str) -> dict[str, Any]:
    if isinstance(data, dict):
        out: dict[str, Any] = {}
        for k, v in data.items():
            out |= _flatten(v, f"{prefix}.{k}")
        return out
    if isinstance(data, list) and data and all(isinstance(v, dict) for v in data):
        out = {}
        for i, v in enumerate(data):
            out |= _flatten(v, f"{prefix}.{i}")
        return out
    return {prefix: data}


def _read_json(path: Path) -> Any:
    return json.loads(path.read_text()) if path.is_file() else None


def _read_yaml(path: Path) -> Any:
    import yaml

    return yaml.safe_load(path.read_text()) if path.is_file() else None


def _digest(path: Path) -> str:
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else ""


def _git_sha() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=5, check=False).stdout.strip() or "unknown"
    except OSError:
        return "unknown"
