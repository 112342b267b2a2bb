"""Evaluation: workloads, conditions, baseline vs speculative runs, records, summaries.

:func:`evaluate` is what ``trtspec eval`` calls: recipe + its manifest → executors for each
condition and arm → ``reports/<eval-id>/`` (records.jsonl, summary.json, recipe.yaml,
manifest.json).
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from trtspec.files import write_atomic
from trtspec.recipe import DraftModel, LayerSkip, Ngram, Recipe, RecipeError, load_recipe


def evaluate(recipe_path: str | Path, overrides: Sequence[str] = (),
             workloads: Sequence[str] = (), per_category: int | None = None,
             eval_id: str | None = None, resume: str | Path | None = None,
             engines_root: str | Path = "engines", reports_root: str | Path = "reports",
             speed_bench_dir: str | Path = "data/speed-bench",
             progress: Callable[[int, int], None] | None = None) -> Path:
    """Run the recipe's eval; returns the eval folder."""
    from trtspec.build import check_backend_device
    from trtspec.eval.run import Condition, EvalInputs, run_eval
    from trtspec.manifest import open_built

    recipe = load_recipe(recipe_path, overrides)
    if recipe.backend.kind != "torch":
        raise RecipeError(f"{recipe_path}: in-process eval runs the torch backend; the "
                          "TensorRT-LLM runtime and --endpoint evals are not built yet")
    manifest, manifest_path = open_built(recipe, recipe_path, engines_root)
    check_backend_device(recipe, recipe_path)

    # the torch backend bakes no draft length into its build: the recipe's list is used as is
    lengths = recipe.draft_lengths if recipe.draft_lengths != "auto" else manifest.draft_lengths
    conditions = [Condition(m.method, d, c) for m in recipe.methods
                  for d in lengths for c in recipe.eval.concurrency]
    out, requests = _start(recipe, recipe_path, overrides, workloads, per_category, eval_id,
                           resume, reports_root, speed_bench_dir, "",
                           {"conditions": [c.key for c in conditions]})
    if resume is None:
        shutil.copyfile(manifest_path, out / "manifest.json")
    else:
        _check_same_build(out, manifest, manifest_path)
    models = _loaded_models(manifest, recipe)
    inputs = EvalInputs(requests, conditions, _executor_factory(recipe, manifest, models),
                        _encoder(models), recipe.sampling.params(), recipe.eval.warmup,
                        margin=_margin(models))
    return _finish(out, run_eval(out, inputs, resume=resume is not None, progress=progress))


def eval_recipe(eval_dir: str | Path) -> Recipe:
    """The recipe an eval folder ran, with the --set overrides it ran with."""
    out = Path(eval_dir)
    if not (out / "recipe.yaml").is_file():
        raise RecipeError(f"{out} is not an eval folder (no recipe.yaml): pass "
                          "reports/<eval-id>")
    meta = json.loads((out / "eval.json").read_text()) if (out / "eval.json").is_file() else {}
    return load_recipe(out / "recipe.yaml", meta.get("overrides", []))


def require_files(eval_dir: str | Path, *names: str) -> Path:
    """The eval folder, after checking it holds ``names`` (one line naming what is missing)."""
    out = Path(eval_dir)
    missing = [n for n in names if not (out / n).is_file()]
    if missing:
        raise RecipeError(f"{out} is not a complete eval folder: no {', '.join(missing)} "
                          "(`trtspec eval` writes it; pass reports/<eval-id>)")
    return out


def in_process(eval_dir: str | Path) -> bool:
    """An in-process eval keeps its build's manifest.json; an endpoint eval has none (and its
    sampler, running in the server, cannot be audited here)."""
    return (Path(eval_dir) / "manifest.json").is_file()


def _start(recipe: Recipe, recipe_path: str | Path, overrides: Sequence[str],
           workloads: Sequence[str], per_category: int | None, eval_id: str | None,
           resume: str | Path | None, reports_root: str | Path, speed_bench_dir: str | Path,
           tag: str, extra: dict[str, Any]) -> tuple[Path, list[Any]]:
    """The eval folder (new or resumed) with recipe.yaml and eval.json, and its requests.

    A new eval never touches an existing folder: an eval id in use is refused before anything
    is written. A resumed eval must be the same eval: the same recipe digest (after --set
    overrides), workloads and requests, else it stops and says what differs."""
    from trtspec.eval.workloads import load_workload

    out = Path(resume) if resume else Path(reports_root) / (
        eval_id or f"{recipe.name}{tag}-{time.strftime('%Y%m%d-%H%M%S')}")
    requests = [r for spec in (workloads or recipe.eval.workloads)
                for r in load_workload(spec, speed_bench_dir, per_category
                                       or recipe.eval.per_category, recipe.sampling.seed)]
    meta = {"recipe": recipe.name, "recipe_digest": recipe.digest(), "overrides": list(overrides),
            "workloads": list(workloads or recipe.eval.workloads), "requests": len(requests),
            "request_ids": _ids_digest(requests), **extra}
    if resume:
        _check_same_eval(out, meta)
        return out, requests
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out} exists: pass --resume {out} to continue that eval, or "
                              "choose another --eval-id")
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        out.mkdir(exist_ok=out.exists())  # an empty folder is fine; a racing eval is not
    except FileExistsError:
        raise FileExistsError(f"{out} was just created by another eval: choose another "
                              "--eval-id") from None
    shutil.copyfile(recipe_path, out / "recipe.yaml")
    write_atomic(out / "eval.json", json.dumps(meta, indent=2) + "\n")
    return out, requests


def _ids_digest(requests: Sequence[Any]) -> str:
    import hashlib

    return hashlib.sha256("\n".join(r.id for r in requests).encode()).hexdigest()[:16]


def _check_same_eval(out: Path, meta: dict[str, Any]) -> None:
    """Refuse to resume an eval folder with another recipe, workload or request set."""
    path = out / "eval.json"
    if not path.is_file():
        raise RecipeError(f"{out} is not an eval folder (no eval.json): nothing to resume")
    stored = json.loads(path.read_text())
    names = {"recipe_digest": "the recipe (after --set overrides)", "workloads": "workloads",
             "requests": "number of requests", "request_ids": "requests",
             "endpoint": "endpoint", "baseline_endpoint": "baseline endpoint",
             "model": "model", "conditions": "conditions", "client": "endpoint client mode"}
    differ = [label for key, label in names.items()
              if (key in stored or key in meta) and stored.get(key) != meta.get(key)]
    if differ:
        raise RecipeError(f"--resume {out}: {', '.join(differ)} differ from that eval's "
                          f"(it ran {stored.get('workloads')} with overrides "
                          f"{stored.get('overrides') or 'none'}): pass the same recipe, "
                          "--set, --workload and --per-category, or start a new eval")


def _check_same_build(out: Path, manifest: Any, manifest_path: Path) -> None:
    """A resumed eval measures the models its first part measured: the same build inputs and
    the same checkpoints (config and tokenizer digests)."""
    from trtspec.manifest import load_manifest

    if not (out / "manifest.json").is_file():
        return
    before = load_manifest(out / "manifest.json")

    def fingerprint(m: Any) -> tuple[Any, ...]:
        return (m.build_digest, sorted((a.name, a.config_digest, a.tokenizer_digest)
                                       for a in m.artifacts))

    if fingerprint(before) != fingerprint(manifest):
        raise RecipeError(f"--resume {out}: {manifest_path} is not the build this eval started "
                          f"with (built {before.created}, now {manifest.created}): its models "
                          "may differ, so start a new eval")


def _finish(out: Path, records: Path) -> Path:
    from trtspec.eval.run import read_records, summarize

    write_atomic(out / "summary.json", json.dumps(summarize(read_records(records)), indent=2)
                 + "\n")
    return out


def evaluate_endpoint(recipe_path: str | Path, url: str, model: str,
                      baseline_url: str | None = None, overrides: Sequence[str] = (),
                      workloads: Sequence[str] = (), per_category: int | None = None,
                      eval_id: str | None = None, resume: str | Path | None = None,
                      reports_root: str | Path = "reports",
                      speed_bench_dir: str | Path = "data/speed-bench",
                      progress: Callable[[int, int], None] | None = None) -> Path:
    """The recipe's workloads, sampling and concurrency against OpenAI-compatible servers."""
    from trtspec.eval.endpoint import detect_server, run_endpoint_eval

    recipe = load_recipe(recipe_path, overrides)
    out, requests = _start(recipe, recipe_path, overrides, workloads, per_category, eval_id,
                           resume, reports_root, speed_bench_dir, "-endpoint",
                           {"endpoint": url, "baseline_endpoint": baseline_url, "model": model,
                            "server": detect_server(url), "client": "batches"})
    return _finish(out, run_endpoint_eval(out, requests, url, model, recipe.sampling.params(),
                                          recipe.eval.concurrency, baseline_url,
                                          resume is not None, progress))


def _loaded_models(manifest: Any, recipe: Recipe) -> Callable[..., Any]:
    """Load each model once, on the recipe's device and in its dtype: get() is the target,
    get(path) another artifact (a draft model, in its method's dtype)."""
    from trtspec.models import load

    dtypes = {manifest.artifact("target").path: recipe.target.dtype}
    for m in recipe.methods:
        if isinstance(m, DraftModel):
            dtypes[manifest.artifact("draft").path] = m.dtype
    cache: dict[str, Any] = {}

    def get(spec: str | None = None) -> Any:
        key = spec or manifest.artifact("target").path
        if key not in cache:
            cache[key] = load(key, device=recipe.backend.device,
                              dtype=dtypes.get(key, recipe.target.dtype))
        return cache[key]

    return get


def _margin(models: Callable[..., Any]) -> Callable[[list[int], int, int], tuple[float, str]]:
    """|logit a − logit b| of the target after ``prefix`` (one prefill) and the dtype the
    target ran in."""
    from trtspec.runtime.hf import HFRunner

    def margin(prefix: list[int], a: int, b: int) -> tuple[float, str]:
        runner = HFRunner(models().model)
        logits = runner.prefill([prefix])[0]  # [V]
        return float((logits[a] - logits[b]).abs()), str(runner.dtype).removeprefix("torch.")

    return margin


def _executor_factory(recipe: Recipe, manifest: Any, models: Callable[..., Any]):
    from trtspec.executor import SpecExecutor
    from trtspec.propose import make_proposer
    from trtspec.runtime.hf import HFRunner

    methods = {m.method: m for m in recipe.methods}

    def make(condition: Any, arm: str) -> SpecExecutor:
        target = models()
        runner = HFRunner(target.model, eos_token_id=target.tokenizer.eos_token_id)
        if arm == "baseline":
            return SpecExecutor(runner)
        m = methods[condition.method]
        knobs: dict[str, Any] = {}
        if isinstance(m, Ngram):
            knobs = {"ngram_min": m.min_n, "ngram_max": m.max_n}
        elif isinstance(m, LayerSkip):
            knobs = {"draft_layers": m.layers}
        elif isinstance(m, DraftModel):
            knobs = {"draft": models(manifest.artifact("draft").path)}
        proposer = make_proposer(m.method, target, draft_len=condition.draft_len, **knobs)
        return SpecExecutor(runner, proposer, condition.draft_len)

    return make


def _encoder(models: Callable[..., Any]):
    from trtspec.models import encode

    return lambda request: encode(models().tokenizer, request.chat())
