"""What a reviewer sees of an eval in MLflow besides its numbers: when it ran, what it ran on,
how it changes with load, and the verdicts as a table.

The UI is only as honest as what is logged: a run's duration is the time logging took unless
it is given the records' clock, its Datasets column is empty unless the workloads are logged as
inputs, and a metric logged once per condition is a bar, not a curve against load. These
helpers build each of those views from the eval folder's own files (:mod:`trtspec.report.tracking`
logs them).
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from trtspec.analysis.records import condition_parts

EXPERIMENT_KIND = ("mlflow.experimentKind", "custom_model_development")  # the runs table
VERDICT_TABLE = "decision/verdicts.json"
LOGGED_ARTIFACTS = "mlflow.loggedArtifacts"  # MLflow's tag listing a run's tables


def run_window(records: Sequence[dict[str, Any]]) -> tuple[int | None, int | None]:
    """(start, end) in epoch ms of the requests in ``records``: the first one sent and the last
    one finished, on the eval's clock. (None, None) for records written before that clock
    (``start_s`` 0), which cannot be placed in time."""
    starts = [r["start_s"] for r in records if (r.get("start_s") or 0) > 0]
    if not starts:
        return None, None
    ends = [r["start_s"] + (r.get("e2e_s") or 0.0) for r in records
            if (r.get("start_s") or 0) > 0]
    ends += [r["wall_clock"] for r in records if (r.get("wall_clock") or 0) > 0]
    return int(min(starts) * 1000), int(max(ends) * 1000)


def datasets(records: Sequence[dict[str, Any]], workloads: Sequence[str]) -> list[Any]:
    """One MLflow dataset input per workload source of ``records``: the requests that ran
    (request id, category, prompt tokens), named after the workload, its source the workload
    (a JSONL path, ``builtin``, ``speed-bench:<config>``), its digest a hash of those rows."""
    from mlflow.entities import Dataset, DatasetInput, InputTag

    by_source: dict[str, dict[str, tuple[str, int]]] = {}
    for r in records:
        rows = by_source.setdefault(r.get("source") or "custom", {})
        rows.setdefault(r["request_id"], (r.get("category", "default"),
                                          int(r.get("context_tokens") or 0)))
    custom = [w for w in workloads if w != "builtin" and not w.startswith("speed-bench:")]
    out = []
    for source, rows in sorted(by_source.items()):
        if source == "custom" and len(custom) == 1:
            name, uri, kind = Path(custom[0]).stem, custom[0], "local"
        else:
            name, uri = source, ", ".join(custom) if source == "custom" and custom else source
            kind = "local" if source == "custom" else "code"
        table = [[rid, cat, tokens] for rid, (cat, tokens) in sorted(rows.items())]
        digest = hashlib.sha256(json.dumps(table).encode()).hexdigest()[:16]
        categories: dict[str, int] = {}
        for _, cat, _ in table:
            categories[cat] = categories.get(cat, 0) + 1
        schema = {"mlflow_colspec": [
            {"type": "string", "name": "request_id", "required": True},
            {"type": "string", "name": "category", "required": True},
            {"type": "long", "name": "context_tokens", "required": True}]}
        dataset = Dataset(name=name, digest=digest, source_type=kind,
                          source=json.dumps({"uri": uri}), schema=json.dumps(schema),
                          profile=json.dumps({"num_rows": len(table), "categories": categories}))
        out.append(DatasetInput(dataset, tags=[InputTag("mlflow.data.context", "eval")]))
    return out


def load_metrics(summary: dict[str, Any], records: Sequence[dict[str, Any]]) -> list[Any]:
    """The parent run's metrics against load: per method × D, speedup (TPOT p50), TPOT p50 of
    each arm and AL with ``step`` = concurrency, so MLflow draws each as a curve over c."""
    from mlflow.entities import Metric

    out = []
    for key, entry in summary.items():
        method, d, c = condition_parts(key)
        _, end = run_window([r for r in records if r["condition"] == key])
        stamp = end or int(time.time() * 1000)
        series = f"{method}_D{d}"
        values = {f"speedup/{series}": entry.get("speedup_tpot_p50"),
                  f"speedup_e2e/{series}": entry.get("speedup_e2e_p50"),
                  f"tpot_p50_ms/spec_{series}": entry.get("spec", {}).get("tpot_ms_p50"),
                  f"tpot_p50_ms/baseline_{series}": entry.get("baseline", {}).get("tpot_ms_p50"),
                  f"al_pooled/{series}": entry.get("spec", {}).get("al_pooled")}
        out += [Metric(name, float(v), stamp, c) for name, v in values.items()
                if isinstance(v, int | float) and v == v]
    return out


def ran_params(meta: dict[str, Any], recipe: dict[str, Any],
               records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """What the eval ran, from eval.json and the records: the workloads, how many of each
    category each one ran (a custom JSONL runs whole unless --per-category was given, whatever
    the recipe's ``eval.per_category``), and the requests measured (``--until-decided`` adds
    some). These replace the recipe's ``eval.workloads`` / ``eval.per_category``, which say what
    the recipe file asks for, not what ran."""
    selection = meta.get("selection") or {}
    default = (recipe.get("eval") or {}).get("per_category")
    workloads = meta.get("workloads") or []
    per = []
    for spec in workloads:
        custom = spec != "builtin" and not spec.startswith("speed-bench:")
        n = selection.get("per_category") or (
            None if custom and not selection.get("legacy") else default)
        per.append(f"{spec}={n if n else 'all'}")
    out: dict[str, Any] = {"workloads": ",".join(workloads), "per_category": ", ".join(per),
                           "requests": meta.get("requests", 0),
                           "requests_measured": len({r["request_id"] for r in records})}
    if selection.get("num_prompts") is not None:
        out["num_prompts"] = selection["num_prompts"]
    return out


def log_verdict_table(client: Any, run_id: str, decision: dict[str, Any]) -> None:
    """Every verdict (each condition, overall and per category) as an MLflow table artifact,
    replaced when decide runs again (``log_table`` would append the old rows)."""
    import tempfile

    columns = ["condition", "category", "verdict", "speedup", "ci_low", "ci_high", "requests",
               "reasons"]
    rows = []
    for v in decision.get("verdicts", []):
        ci = list(v.get("ci") or (None, None))
        rows.append([v["condition"], v["category"], v["verdict"], _finite(v.get("speedup")),
                     _finite(ci[0]), _finite(ci[1]), v.get("requests"),
                     "; ".join(v.get("reasons") or [])])
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / Path(VERDICT_TABLE).name
        path.write_text(json.dumps({"columns": columns, "data": rows}))
        client.log_artifact(run_id, str(path), artifact_path=str(Path(VERDICT_TABLE).parent))
    tables = json.loads(client.get_run(run_id).data.tags.get(LOGGED_ARTIFACTS, "[]"))
    entry = {"path": VERDICT_TABLE, "type": "table"}
    if entry not in tables:
        client.set_tag(run_id, LOGGED_ARTIFACTS, json.dumps([*tables, entry]))


def _finite(value: Any) -> float | None:
    """JSON has no NaN: an undefined speedup or bound is null in the table."""
    return float(value) if isinstance(value, int | float) and value == value else None
