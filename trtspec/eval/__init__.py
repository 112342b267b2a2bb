"""Evaluation: workloads, conditions, baseline vs speculative runs, records, summaries.

:func:`evaluate` is what ``trtspec eval`` calls: recipe + its manifest → executors for each
condition and arm → ``reports/<eval-id>/`` (records.jsonl, summary.json, recipe.yaml,
manifest.json).
"""

from __future__ import annotations

import contextlib
import json
import shutil
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from trtspec.build.files import write_atomic
from trtspec.build.recipe import Recipe, RecipeError, load_recipe
from trtspec.eval.folder import (
    Interrupted,
    Selection,
    arms_of,
    discard_if_empty,
    meta_if_any,
    resumed_selection,
    start,
)

__all__ = ["Interrupted", "Selection", "eval_recipe", "evaluate", "evaluate_endpoint"]

EVERYTHING = Selection()  # the recipe's workloads and settings, no --set


def evaluate(recipe_path: str | Path, selection: Selection = EVERYTHING,
             eval_id: str | None = None, resume: str | Path | None = None,
             engines_root: str | Path = "engines", reports_root: str | Path = "reports",
             progress: Callable[[int, int, str], None] | None = None,
             say: Callable[[str], None] = print, until_decided: bool = False,
             max_requests: int | None = None, confirm: str | Path | None = None) -> Path:
    """Run the recipe's eval; returns the eval folder. ``until_decided``: then add requests
    to the conditions still INCONCLUSIVE (:mod:`trtspec.eval.sequential`), up to
    ``max_requests`` paired requests per condition [default: 4× the plan, at most every row
    of the workloads]. A resumed eval goes on as it started (sequential, confirmation).
    ``confirm``: an eval folder whose chosen setting is measured again on requests it has not
    seen (:mod:`trtspec.eval.confirm`)."""
    from trtspec.build.manifest import open_built
    from trtspec.build.open import (
        PLAIN,
        check_backend_device,
        check_in_process,
        open_models,
        trtllm_exactness,
    )
    from trtspec.eval.run import Condition, EvalInputs, run_eval

    fresh, chosen, confirms = None, None, {}
    if resume:  # a sequential or confirmation eval resumes as one
        stored = meta_if_any(Path(resume))
        if stored and until_decided and not stored.get("until_decided"):
            raise RecipeError(f"--resume {resume}: that eval was not started with "
                              "--until-decided and may have been judged at the full α already; "
                              "start a new eval with --until-decided instead")
        if stored.get("until_decided") and max_requests not in (None, stored.get("max_requests")):
            raise RecipeError(f"--resume {resume}: its α is spent over a budget of "
                              f"{stored.get('max_requests') or 'the default'} requests per "
                              f"condition; drop --max-requests {max_requests}")
        if max_requests and not until_decided and not stored.get("until_decided"):
            raise RecipeError(f"--resume {resume}: --max-requests is the budget of "
                              "--until-decided, which that eval did not run")
        until_decided = until_decided or bool(stored.get("until_decided"))
        max_requests = max_requests or stored.get("max_requests")
        confirm = confirm or stored.get("confirms")
    if confirm:
        from trtspec.eval.confirm import CONFIRMS, confirm_plan

        if until_decided:
            raise RecipeError("--confirm measures the chosen setting once, on new requests: "
                              "drop --until-decided")
        selection, _, chosen, fresh = confirm_plan(Path(confirm), recipe_path,
                                                   load_recipe(recipe_path).sampling.seed)
        confirms = {CONFIRMS: str(Path(confirm).absolute())}
        say(f"confirming {', '.join(chosen)} (chosen by {confirm}) on {len(fresh)} requests it "
            "did not measure")
    if resume:  # the folder's overrides decide which build is meant
        selection = resumed_selection(Path(resume), selection, recipe_path)
    recipe = load_recipe(recipe_path, selection.all_overrides())
    check_in_process(recipe, recipe_path)  # torch, or TensorRT-LLM's LLM API (mode exact)
    manifest, manifest_path = open_built(recipe, recipe_path, engines_root)
    if recipe.backend.kind == "torch":
        check_backend_device(recipe, recipe_path)

    # the torch backend bakes no draft length into its build: the recipe's list is used as is
    lengths = recipe.condition_draft_lengths(manifest.draft_lengths)  # adaptive is one too
    left_out = manifest.left_out()
    for method, why in left_out.items():
        if any(m.method == method for m in recipe.methods):
            say(f"note: {method} is left out of this eval: {why}; then `trtspec build` again")
    conditions = list(dict.fromkeys(Condition(m.method, d, c) for m in recipe.methods
                                    if m.method not in left_out
                                    for d in lengths for c in recipe.eval.concurrency))
    if not conditions:
        raise RecipeError(f"{recipe_path}: every method is left out of the build "
                          f"({'; '.join(left_out.values())})")
    if chosen is not None:
        conditions = [c for c in conditions if c.key in chosen]
        if not conditions:
            raise RecipeError(f"--confirm {confirm}: {recipe_path} does not run "
                              f"{', '.join(chosen)} (pass the recipe that eval ran)")
    out, recipe, requests, selection, created = start(
        recipe_path, selection, eval_id or (f"{Path(confirm).name}-confirm" if confirm else None),
        resume, reports_root, "",
        lambda _, requests: {"conditions": [c.key for c in conditions], "client": "scheduler",
                             "trtllm_exactness": trtllm_exactness(recipe),
                             "expected_records": len(conditions) * 2 * len(requests),
                             "until_decided": until_decided, "max_requests": max_requests,
                             **confirms}, say, fresh)
    with kept_on_failure(out, created, total=len(conditions) * 2 * len(requests)):
        if created:
            shutil.copyfile(manifest_path, out / "manifest.json")
        else:
            _check_same_build(out, manifest, manifest_path)
        build = open_models(recipe, manifest, recipe_path)
        build.share_gpu(2)  # the baseline's arm and one speculative arm at a time

        def inputs(batch: Sequence[Any], chosen: Sequence[Condition], look: int) -> EvalInputs:
            return EvalInputs(batch, chosen,
                              lambda c, arm: build.arm(PLAIN if arm == "baseline" else
                                                       c.method, c.draft_len),
                              lambda request: build.encode(request.chat()),
                              recipe.sampling.params(), recipe.eval.warmup,
                              margin=build.margin, slots=recipe.limits.max_batch_size,
                              request_rate=recipe.eval.request_rate, look=look)

        if until_decided and max_requests is not None and max_requests <= len(requests):
            raise RecipeError(f"--max-requests {max_requests} leaves no room after the plan's "
                              f"{len(requests)} requests per condition: give more, or drop "
                              "--until-decided")
        try:
            records = run_eval(out, inputs(requests, conditions, 0), resume=not created,
                               progress=progress)
            if until_decided:
                _until_decided(out, recipe, recipe_path, selection, requests, conditions,
                               inputs, max_requests, progress, say)
        finally:
            build.release_arms()
    return finish_eval(out, records)


def _until_decided(out: Path, recipe: Recipe, recipe_path: str | Path, selection: Selection,
                   plan: Sequence[Any], conditions: Sequence[Any],
                   inputs: Callable[[Sequence[Any], Sequence[Any], int], Any],
                   max_requests: int | None, progress: Callable[[int, int, str], None] | None,
                   say: Callable[[str], None]) -> None:
    """The looks after the plan (:func:`trtspec.eval.sequential.until_decided`)."""
    from trtspec.analysis.decide import decide
    from trtspec.eval.folder import workload_pool
    from trtspec.eval.run import DIVERGENCES, RECORDS, read_jsonl, read_records, run_eval
    from trtspec.eval.sequential import until_decided

    pool = workload_pool(recipe, selection, recipe_path)
    budget = min(max_requests or 4 * len(plan), len(pool))
    by_key = {c.key: c for c in conditions}

    def measure(batch: Sequence[Any], keys: Sequence[str], look: int) -> None:
        run_eval(out, inputs(batch, [by_key[k] for k in keys], look), resume=True,
                 progress=progress)

    def judge(alphas: dict[str, float], families: dict[str, int]
              ) -> dict[str, tuple[str, int]]:
        verdicts = decide(read_records(out / RECORDS), recipe.decide,
                          recipe.sampling.temperature == 0, recipe.sampling.seed,
                          divergences=read_jsonl(out / DIVERGENCES), alphas=alphas,
                          families=families, interim=True)  # gates: once, by decide at the end
        return {v.condition: (v.verdict, v.family) for v in verdicts if v.category == "all"}

    until_decided(out, plan, pool, budget, list(by_key), measure, judge,
                  recipe.sampling.seed, say)


@contextlib.contextmanager
def kept_on_failure(out: Path, created: bool, total: int) -> Iterator[None]:
    """Ctrl-C keeps every record and says so (:class:`Interrupted`, with a summary of what is
    there); a failure before anything was recorded removes the folder this eval created."""
    from trtspec.eval.run import RECORDS, read_records

    try:
        yield
    except KeyboardInterrupt:
        kept = len(read_records(out / RECORDS))
        if kept:
            finish_eval(out, out / RECORDS)
        elif created:
            discard_if_empty(out)
        raise Interrupted(out, kept, total, discarded=created and not kept) from None
    except BaseException:
        if created:
            discard_if_empty(out)
        raise


def eval_recipe(eval_dir: str | Path) -> Recipe:
    """The recipe an eval folder ran, with the --set overrides it ran with."""
    out = Path(eval_dir)
    if not (out / "recipe.yaml").is_file():
        raise RecipeError(f"{out} is not an eval folder (no recipe.yaml): pass "
                          "reports/<eval-id>")
    meta = meta_if_any(out)
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


def _check_same_build(out: Path, manifest: Any, manifest_path: Path) -> None:
    """A resumed eval measures the models its first part measured: the same build inputs and
    the same checkpoints (config and tokenizer digests)."""
    from trtspec.build.manifest import build_fingerprint, load_manifest

    if not (out / "manifest.json").is_file():
        return
    before = load_manifest(out / "manifest.json")

    if build_fingerprint(before) != build_fingerprint(manifest):
        raise RecipeError(f"--resume {out}: {manifest_path} is not the build this eval started "
                          f"with (built {before.created}, now {manifest.created}): its models "
                          "may differ, so start a new eval")


def finish_eval(out: Path, records: Path) -> Path:
    from trtspec.eval.run import read_records, summarize

    summary = summarize(read_records(records), arms_of(out))
    write_atomic(out / "summary.json", json.dumps(summary, indent=2) + "\n")
    return out


def evaluate_endpoint(recipe_path: str | Path, url: str, model: str,
                      baseline_url: str | None = None, selection: Selection = EVERYTHING,
                      eval_id: str | None = None, resume: str | Path | None = None,
                      reports_root: str | Path = "reports",
                      progress: Callable[[int, int, str], None] | None = None,
                      say: Callable[[str], None] = print) -> Path:
    """The recipe's workloads, sampling and concurrency against OpenAI-compatible servers."""
    from trtspec.eval.endpoint import (
        TOP_LOGPROBS,
        check_reachable,
        detect_server,
        run_endpoint_eval,
    )

    for where in (url, baseline_url):  # before any folder exists: a typo leaves nothing behind
        if where:
            check_reachable(where)
    arms = 1 + bool(baseline_url)
    out, recipe, requests, selection, created = start(
        recipe_path, selection, eval_id, resume, reports_root, "-endpoint",
        lambda recipe, requests: {
            "endpoint": url, "baseline_endpoint": baseline_url, "model": model,
            "server": detect_server(url), "client": "clients",
            "expected_records": len(set(recipe.eval.concurrency)) * arms * len(requests)}, say)
    levels = list(dict.fromkeys(recipe.eval.concurrency))
    with kept_on_failure(out, created, len(levels) * arms * len(requests)):
        records = run_endpoint_eval(out, requests, url, model, recipe.sampling.params(),
                                    levels, baseline_url, not created, progress,
                                    rate=recipe.eval.request_rate, top_logprobs=TOP_LOGPROBS,
                                    dtype=target_dtype(recipe))
    return finish_eval(out, records)


def target_dtype(recipe: Recipe) -> str | None:
    """The dtype a server runs the target in, as the recipe says it (None for auto: the tie
    margin then assumes bfloat16, the widest)."""
    dtype = recipe.target.dtype
    return dtype if dtype in ("float32", "float16", "bfloat16") else None
