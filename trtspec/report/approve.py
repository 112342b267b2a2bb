"""The approval record: what was decided, who approved it, and exactly what to serve, as a
version of a registered model in MLflow's model registry.

A verdict in a report is not a decision anyone made. ``trtspec approve`` turns a decided eval
into one: it refuses what should not be served (no GO condition, an exactness audit that
failed or is missing where the recipe requires one, a build that changed since it was
measured, an eval never decided), then logs the eval's decision files as one artifact folder
and registers it as a new version of the model named after the recipe, tagged with the
verdicts, the audit, the eval, the reviewer and the build, and moves the ``approved`` alias to
it. ``trtspec serve --policy models:/<recipe>@approved`` downloads that folder and serves
exactly the policy it holds (:func:`fetch_approved`).
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trtspec.analysis.decide import GO
from trtspec.analysis.records import condition_parts

ALIAS = "approved"
APPROVAL = "approval.json"  # who approved what, inside the registered folder
FILES = ("eval.json", "summary.json", "manifest.json", "decision.json", "audit.json",
         "report.md", "report.html")
TAG_LIMIT = 5000  # MLflow's longest tag value


class ApprovalRefused(ValueError):
    """The eval must not be approved (one line: why, and what to do instead)."""


@dataclass(frozen=True)
class Approved:
    """A registered model version holding an approved policy."""

    name: str
    version: str
    run_id: str
    source: str
    uri: str
    tags: dict[str, str]


def approve(eval_dir: str | Path, reviewer: str, note: str | None = None,
            uri: str | None = None, engines_root: str | Path = "engines") -> Approved:
    """Check the eval may be approved, then register its decision (see the module doc).
    Nothing is written to MLflow when a check fails."""
    from trtspec.eval import require_files
    from trtspec.report.tracking import RECEIPT
    from trtspec.report.tracking.client import check_reachable, tracking_uri

    out = require_files(eval_dir, "eval.json", "summary.json", "records.jsonl")
    if not (out / "decision.json").is_file():
        raise ApprovalRefused(f"{out} was never decided (no decision.json): run `trtspec decide "
                              f"{out}` first")
    if (out / "records.jsonl").stat().st_mtime > (out / "decision.json").stat().st_mtime:
        raise ApprovalRefused(f"{out}: records.jsonl changed after it was decided (a resumed "
                              f"eval): run `trtspec decide {out}` again")
    decision = json.loads((out / "decision.json").read_text())
    meta = json.loads((out / "eval.json").read_text())
    overall = [v for v in decision.get("verdicts", []) if v["category"] == "all"]
    go = [v for v in overall if v["verdict"] == GO]
    if not go:
        seen = ", ".join(f"{v['condition']} {v['verdict']}" for v in overall) or "none"
        raise ApprovalRefused(f"{out}: no condition is GO ({seen}): nothing to approve")
    audit = audit_result(out, decision, sorted({condition_parts(v["condition"])[0] for v in go}))
    built = check_build(out, Path(engines_root))
    receipt = json.loads((out / RECEIPT).read_text()) if (out / RECEIPT).is_file() else {}
    uri = tracking_uri(uri or receipt.get("uri"))
    check_reachable(uri)
    tags = {"verdicts": " ".join(f"{v['condition']}={v['verdict']}" for v in overall),
            "audit": audit, "eval_id": out.name, "reviewer": reviewer, "note": note or "",
            "build_digest": built.get("build_digest") or "none (endpoint eval)",
            "recipe_digest": meta.get("recipe_digest", ""), "policy": _policy_text(out, decision),
            "approved_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    return _register(out, meta["recipe"], uri, receipt, tags, built)


def audit_result(out: Path, decision: dict[str, Any], methods: list[str]) -> str:
    """"pass (…)" for the GO methods' exactness audits, "not required" or "not applicable";
    refuses a failed one (in decision.json or a later audit.json) and a missing one where the
    recipe requires it."""
    audits = [((decision.get("audit") or {}).get("methods") or {})]
    if (out / "audit.json").is_file():
        audits.append(json.loads((out / "audit.json").read_text()).get("methods") or {})
    required = (decision.get("criteria") or {}).get("require_audit", True)
    passed = []
    for method in methods:  # a failed audit refuses, even one run after decide
        found = [a[method] for a in audits if method in a]
        failed = [a for a in found if not a.get("passed")]
        if failed:
            raise ApprovalRefused(f"{out}: the exactness audit of {method} failed (p = "
                                  f"{failed[0].get('p_value', float('nan')):.2g}): its outputs "
                                  "are not the target's distribution; do not serve it")
        if found and (found[-1].get("weak") or "power" not in found[-1]):
            # as a failed one: it could not have failed (or, from an earlier trtspec, says
            # not whether it could)
            power = (f" (power {found[-1]['power']:.2f} < {found[-1].get('min_power', 0.8)})"
                     if "power" in found[-1] else "")
            raise ApprovalRefused(f"{out}: the exactness audit of {method} is weak{power}: "
                                  "re-run `trtspec audit` with more --samples, then decide "
                                  "again")
    if not decision.get("audit_applies", True):
        return "not applicable (greedy endpoint eval: gated by greedy identity)"
    for method in methods:
        found = [a[method] for a in audits if method in a]
        if not found and required:
            raise ApprovalRefused(f"{out}: {method} has no exactness audit and the recipe "
                                  f"requires one: run `trtspec audit {out}`, then decide again")
        if found:
            passed.append(f"{method} p={found[-1].get('p_value', float('nan')):.3g}")
    return f"pass ({', '.join(passed)})" if passed else "not required (decide.require_audit)"


def check_build(out: Path, engines_root: Path) -> dict[str, Any]:
    """The build the eval measured (its manifest.json) must still be the one in the build
    folder: the same build digest and checkpoints. Returns that manifest (``{}`` for an
    endpoint eval, which measured a server's build trtspec cannot see)."""
    from trtspec.build.manifest import ManifestError, build_fingerprint, load_manifest, open_built
    from trtspec.eval import eval_recipe

    if not (out / "manifest.json").is_file():
        return {}
    measured = load_manifest(out / "manifest.json")
    try:
        current, path = open_built(eval_recipe(out), out / "recipe.yaml", engines_root)
    except ManifestError as e:
        raise ApprovalRefused(f"{out}: the build it measured is gone or no longer fits ({e})"
                              ) from None

    if build_fingerprint(measured) != build_fingerprint(current):
        raise ApprovalRefused(f"{out}: the build no longer matches what was measured ({path} was"
                              f" rebuilt {current.created}, the eval measured the build of "
                              f"{measured.created}): run the eval again on this build")
    return {"build_digest": measured.build_digest, "folder": str(path.parent)}


def _policy_text(out: Path, decision: dict[str, Any]) -> str:
    """What `trtspec serve --policy` will run: the method and D by running requests (the
    eval's policy file when decide wrote one, as serve reads it)."""
    from trtspec.analysis.policy import POLICY, read_policy, serve_policy

    written = out / "schedules" / POLICY
    policy = read_policy(written) if written.is_file() else serve_policy(decision)
    return f"{policy.method} {policy.text}" if policy.text else "plain decoding"


def _register(out: Path, name: str, uri: str, receipt: dict[str, Any], tags: dict[str, str],
              built: dict[str, Any]) -> Approved:
    """Log the approval folder to the eval's run (or an approval run), then register it."""
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    from trtspec.report.tracking.client import TrackingUnavailable

    client = MlflowClient(tracking_uri=uri)
    try:
        run_id = _approval_run(client, out, name, uri, receipt)
        tags["eval_run_id"] = run_id
        folder = f"approval/{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"
        with tempfile.TemporaryDirectory() as tmp:
            _approval_folder(out, Path(tmp), tags, built)
            client.log_artifacts(run_id, tmp, artifact_path=folder)
        try:
            client.get_registered_model(name)
        except MlflowException:
            client.create_registered_model(name, description=(
                f"Approved speculative-decoding policies of the trtspec recipe {name}: each "
                "version is one decided eval's decision, report and serving policy."))
        source = f"runs:/{run_id}/{folder}"
        version = client.create_model_version(
            name, source, run_id=run_id, tags={k: v[:TAG_LIMIT] for k, v in tags.items()},
            description=f"{tags['verdicts']} — approved by {tags['reviewer']}"
                        + (f": {tags['note']}" if tags["note"] else ""))
        client.set_registered_model_alias(name, ALIAS, version.version)
        client.set_tag(run_id, "trtspec.approved_version", f"{name}/{version.version}")
    except (MlflowException, OSError) as e:
        cause = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
        raise TrackingUnavailable(f"MLflow at {uri} failed: {cause}") from e
    return Approved(name, str(version.version), run_id, source, uri, tags)


def _approval_run(client: Any, out: Path, name: str, uri: str, receipt: dict[str, Any]) -> str:
    """The eval's parent run when its receipt points at this store and the run is there; else
    a run of its own in the recipe's experiment, so the version links to a run either way."""
    from mlflow.exceptions import MlflowException

    from trtspec.report.tracking.client import absolute_uri
    from trtspec.report.tracking.views import EXPERIMENT_KIND

    if receipt.get("run_id") and absolute_uri(receipt.get("uri", "")) == uri:
        try:
            if client.get_run(receipt["run_id"]).info.lifecycle_stage == "active":
                return receipt["run_id"]
        except MlflowException:
            pass
    experiment = client.get_experiment_by_name(name)
    experiment_id = experiment.experiment_id if experiment else client.create_experiment(name)
    if not (experiment and EXPERIMENT_KIND[0] in experiment.tags):
        client.set_experiment_tag(experiment_id, *EXPERIMENT_KIND)
    run = client.create_run(experiment_id, run_name=f"approve-{out.name}",
                            tags={"trtspec.eval_id": out.name, "trtspec.level": "approval"})
    client.set_terminated(run.info.run_id, "FINISHED")
    return run.info.run_id


def _approval_folder(out: Path, dst: Path, tags: dict[str, str], built: dict[str, Any]) -> None:
    """What the version holds: the recipe as built (the build folder's recipe.yaml; the eval's
    for an endpoint eval), the eval's decision files, its schedules and who approved it. It has
    decision.json, so `serve --policy` reads it as it reads a decided eval folder."""
    recipe = Path(built["folder"]) / "recipe.yaml" if built.get("folder") else None
    shutil.copyfile(recipe if recipe and recipe.is_file() else out / "recipe.yaml",
                    dst / "recipe.yaml")
    if (out / "recipe.yaml").is_file():
        shutil.copyfile(out / "recipe.yaml", dst / "eval-recipe.yaml")
    for name in FILES:
        if (out / name).is_file():
            shutil.copyfile(out / name, dst / name)
    if (out / "schedules").is_dir():
        shutil.copytree(out / "schedules", dst / "schedules")
    (dst / APPROVAL).write_text(json.dumps(tags, indent=2) + "\n")


@dataclass(frozen=True)
class Fetched:
    """A registered version's folder, downloaded, and how to name it."""

    folder: Path
    name: str
    version: str
    alias: str | None
    reviewer: str

    def describe(self) -> str:
        how = ", ".join([f"alias {self.alias}"] * bool(self.alias)
                        + [f"approved by {self.reviewer}"])
        return f"registered model {self.name} version {self.version} ({how})"


def parse_ref(ref: str) -> tuple[str, str | None, str | None]:
    """``models:/<name>@<alias>`` or ``models:/<name>/<version>`` → (name, alias, version)."""
    body = ref.removeprefix("models:/")
    if "@" in body:
        name, _, alias = body.partition("@")
        if name and alias:
            return name, alias, None
    else:
        name, _, version = body.rpartition("/")
        if name and version.isdigit():
            return name, None, version
    raise ApprovalRefused(f"--policy {ref}: give models:/<name>@<alias> or "
                          "models:/<name>/<version>")


def fetch_approved(ref: str, uri: str | None = None, dst: str | Path | None = None) -> Fetched:
    """Download the registered version ``ref`` names (its approval folder) into ``dst`` [a new
    temporary folder]; refuses a version that holds no decision."""
    import mlflow.artifacts
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    from trtspec.report.tracking.client import check_reachable, tracking_uri

    name, alias, number = parse_ref(ref)
    uri = tracking_uri(uri)
    check_reachable(uri)
    client = MlflowClient(tracking_uri=uri)
    try:
        version = client.get_model_version_by_alias(name, alias) if alias else \
            client.get_model_version(name, number)
        target = Path(dst or tempfile.mkdtemp(prefix=f"trtspec-policy-{name}-"))
        folder = Path(mlflow.artifacts.download_artifacts(
            artifact_uri=version.source, dst_path=str(target), tracking_uri=uri))
    except MlflowException as e:
        cause = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
        raise ApprovalRefused(f"--policy {ref}: {cause} (at {uri})") from None
    if not (folder / "decision.json").is_file():
        raise ApprovalRefused(f"--policy {ref}: version {version.version} holds no decision.json"
                              " (register it with `trtspec approve`)")
    reviewer = version.tags.get("reviewer") or "unknown"
    return Fetched(folder, name, str(version.version), alias, reviewer)
