"""`trtspec build`: recipe → plan → artifacts → manifest.

Re-running with an unchanged recipe and GPU is a no-op (``force`` rebuilds); ``dry_run`` only
plans, so it works on any machine, with or without TensorRT-LLM or a GPU. ``--set`` overrides that
change what is built write to their own folder (manifest.build_dir), so they never replace the
build of the recipe as written, nor one another.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trtspec.build import gpu as gpus
from trtspec.build.manifest import (
    BUILT_RECIPE,
    MANIFEST,
    Artifact,
    GpuInfo,
    Manifest,
    ManifestError,
    build_dir,
    versions,
)
from trtspec.build.plan import Plan, make_plan
from trtspec.build.recipe import DraftModel, Eagle, Medusa, Recipe, RecipeError, load_recipe


@dataclass
class BuildResult:
    plan: Plan
    manifest: Manifest | None  # None for a dry run
    manifest_path: Path | None
    up_to_date: bool = False


def build(recipe_path: str | Path, overrides: Sequence[str] = (), gpu: str | None = None,
          dry_run: bool = False, force: bool = False, engines_root: str | Path = "engines",
          say: Callable[[str], None] = print) -> BuildResult:
    recipe = load_recipe(recipe_path, overrides)
    detected = gpus.detect()
    profile = _target_gpu(recipe, gpu, detected, recipe_path)
    if recipe.backend.kind == "torch":
        _check_torch_inputs(recipe, recipe_path)
    heads = _heads(recipe)
    d0, derivation = gpus.d0(*heads) if heads is not None else (None, None)
    if recipe.draft_lengths == "auto":
        if d0 is None:
            raise RecipeError(f"{recipe_path}: draft_lengths: auto needs the target's head counts"
                              ": set target.num_attention_heads and target.num_key_value_heads, "
                              "or list draft_lengths")
        lengths = gpus.sweep_around(d0)
    else:
        lengths = sorted(set(recipe.fixed_draft_lengths()))  # adaptive is no length to build
    slug = profile.slug if profile else "cpu"
    out_dir, as_written = build_dir(recipe, recipe_path, slug, engines_root)
    if as_written is not None:
        say(f"--set changes what is built: writing {out_dir}/ (the recipe as written builds "
            f"into {as_written}/)")
    try:
        plan = make_plan(recipe, profile, out_dir, lengths, d0, derivation,
                         recipe_path=str(recipe_path), overrides=overrides)
    except ValueError as e:
        raise RecipeError(f"{recipe_path}: {e}") from None
    if d0 is not None:
        say(f"D₀ = {d0}  ({derivation}); sweeping D ∈ {lengths}"
            + (f" and adaptive (D ≤ {recipe.adaptive_cap})" if recipe.adaptive else ""))
    if dry_run:
        return BuildResult(plan, None, None)

    existing = out_dir / MANIFEST
    if existing.is_file() and not force:
        current, problem = _current(existing, recipe, heads)
        if current is not None:
            say(f"up to date: {existing} (what the build depends on is unchanged; --force "
                "rebuilds)")
            return BuildResult(plan, current, existing, up_to_date=True)
        say(f"replacing {existing}: it {problem}")

    commands: list[str] = []
    curve = runner = None
    if recipe.backend.kind == "torch":
        from trtspec.build.torch import check_heads, prepare, target_runner

        artifacts = prepare(recipe)
        target, model, runner = target_runner(recipe, artifacts, out_dir, say)
        check_heads(recipe, artifacts, model, say)
        curve = _cost_curve(recipe, artifacts, target, model, say)
    else:
        from trtspec.build.trtllm import execute

        commands = execute(plan, has_gpu=bool(detected))
        artifacts = [Artifact(name=s.name.removeprefix("build ").removeprefix("write "),
                              role="config" if s.kind == "write" else "target",
                              source=recipe.target.model, path=s.produces,
                              flags={"argv": list(s.argv)} if s.argv else {})
                     for s in plan.steps if s.produces and s.kind in ("run", "write")
                     and not s.name.startswith("convert")]
    info = None
    if profile is not None:
        here = next((g for g in detected if g.profile() == profile), None)
        info = GpuInfo(name=profile.name, compute_capability=profile.compute_capability,
                       driver=here.driver if here else None, count=recipe.gpu.count,
                       detected=here is not None)
    manifest = Manifest(recipe=recipe.name, recipe_digest=recipe.digest(),
                        build_digest=recipe.build_digest(), build_inputs=recipe.build_inputs(),
                        methods=recipe.method_digests(), backend=recipe.backend.kind,
                        workflow=plan.workflow, versions=versions(),
                        gpu=info, draft_lengths=lengths, d0=d0, d0_derivation=derivation,
                        artifacts=artifacts, commands=commands, cost_curve=curve,
                        runner=runner)
    path = manifest.save(out_dir)
    _save_recipe(recipe, out_dir)
    say(f"wrote {path}")
    return BuildResult(plan, manifest, path)




def _cost_curve(recipe: Recipe, artifacts: list[Artifact], target: Any, model: Any,
                say: Callable[[str], None]) -> Any:
    """The torch backend's cost curve for the adaptive draft length: t(T) for T = 1 … K + 1
    (K: the recipe's adaptive cap), each draft's one step, and the round cost t(B, W) for
    B = 1 … max_batch_size rows, measured once per build."""
    from trtspec.build.torch import measure_costs

    curve = measure_costs(recipe, artifacts, recipe.adaptive_cap + 1, target, model)
    base = curve.target[1]
    steps = "".join(f"; {m} step {ms / base:.2f}" for m, ms in curve.draft.items())
    say(f"cost curve: t(1) = {base:.1f} ms; t(T)/t(1) for T = 1 … {len(curve.target)}: "
        + " ".join(f"{curve.target[t] / base:.2f}" for t in sorted(curve.target)) + steps)
    if curve.rounds:
        one, rows = curve.rounds[1][1], list(curve.rounds)
        said = f"1 … {rows[-1]}" if rows == list(range(1, len(rows) + 1)) else \
            ", ".join(map(str, rows))
        say(f"round cost: t(B, W)/t(1, 1) for B = {said} rows × W = 1 … "
            f"{len(curve.rounds[1])} tokens, measured in {curve.rounds_seconds:.0f} s:")
        for b, widths in curve.rounds.items():
            say(f"  B = {b}: " + " ".join(f"{ms / one:.2f}" for ms in widths.values()))
    return curve


def _save_recipe(recipe: Recipe, out_dir: Path) -> None:
    """The recipe as built (after --set), beside the manifest: `trtspec serve ENGINE_DIR`
    serves a build folder without the recipe file."""
    import yaml

    from trtspec.build.files import write_atomic

    write_atomic(out_dir / BUILT_RECIPE, yaml.safe_dump(recipe.model_dump(mode="json"),
                                                        sort_keys=False))


def _target_gpu(recipe: Recipe, flag: str | None, detected: list[gpus.DetectedGpu],
                recipe_path: str | Path) -> gpus.GpuProfile | None:
    name = flag or recipe.gpu.name
    if name != "auto":
        try:
            return gpus.profile(name)
        except ValueError as e:
            where = "--gpu" if flag else "gpu.name"
            raise RecipeError(f"{recipe_path}: {where}: {e}") from None
    if detected:
        found = detected[0].profile()
        if found is None:
            raise RecipeError(f"{recipe_path}: this machine's {detected[0].name} has no trtspec "
                              f"profile: pass --gpu with one of {', '.join(gpus.PROFILES)}")
        return found
    if recipe.backend.kind == "trtllm":
        raise RecipeError(f"{recipe_path}: gpu.name is auto but this machine has no NVIDIA GPU: "
                          f"pass --gpu NAME to plan for one ({', '.join(gpus.PROFILES)})")
    return None  # the torch backend on this machine's CPU


def _check_torch_inputs(recipe: Recipe, recipe_path: str | Path) -> None:
    """The torch backend runs here: its device must exist and its models must be on this
    machine (a TensorRT-LLM plan may name paths of the build machine instead)."""
    from trtspec.build.open import check_backend_device
    from trtspec.runtime.models import check_spec

    check_backend_device(recipe, recipe_path)
    specs = [("target.model", recipe.target.model)] + [
        (f"methods.{i}.model", m.model) for i, m in enumerate(recipe.methods)
        if isinstance(m, DraftModel)]
    for key, spec in specs:
        try:
            check_spec(spec)
        except ValueError as e:
            raise RecipeError(f"{recipe_path}: {key}: {e}") from None


def _heads(recipe: Recipe) -> tuple[int, int] | None:
    """The target's (attention heads, KV heads): the recipe's, else (torch backend) its
    config.json's where it is on this machine, else None."""
    t = recipe.target
    if t.num_attention_heads:
        return t.num_attention_heads, t.num_key_value_heads or t.num_attention_heads
    if recipe.backend.kind != "torch":
        return None
    from trtspec.build.torch import head_counts

    return head_counts(t.model)


def _heads_changed(manifest: Manifest, recipe: Recipe) -> str | None:
    """The first heads method whose folder no longer holds what the build loaded (retrained in
    place: eval would otherwise run new heads under the old manifest)."""
    if recipe.backend.kind != "torch":
        return None
    from trtspec.build.torch import heads_artifact

    for m in recipe.methods:
        if isinstance(m, Medusa | Eagle) and any(a.name == m.method for a in manifest.artifacts):
            built = manifest.artifact(m.method)
            if "missing" not in built.flags and \
                    heads_artifact(m).config_digest != built.config_digest:
                return m.method
    return None


def _current(path: Path, recipe: Recipe, heads: tuple[int, int] | None
             ) -> tuple[Manifest | None, str]:
    """(the existing manifest, "") if it covers this recipe (same build inputs, its methods
    built with the same settings) and its artifacts exist; else (None, why not)."""
    from trtspec.build.manifest import check_covers, load_manifest

    try:
        manifest = load_manifest(path)
    except ManifestError:
        return None, "is not a valid manifest"
    problem = check_covers(manifest, recipe)
    if problem is not None:
        return None, problem
    missing = [a.path for a in manifest.artifacts
               if not Path(a.path).exists() and "missing" not in a.flags]
    appeared = [a.name for a in manifest.artifacts
                if "missing" in a.flags and (Path(a.path) / "config.json").exists()]
    if appeared:
        return None, f"left out {appeared[0]}, whose heads are there now"
    changed = _heads_changed(manifest, recipe)
    if changed:
        return None, f"was built with other {changed} heads (their files changed since)"
    if missing:
        return None, f"lists artifacts that are gone ({missing[0]})"
    stale = _cost_curve_stale(manifest, recipe, heads)
    if stale:
        return None, stale
    return manifest, ""


def _cost_curve_stale(manifest: Manifest, recipe: Recipe, heads: tuple[int, int] | None
                      ) -> str | None:
    """Why the build's cost curve no longer prices the rounds its runner would run (torch
    backend, the compiled or eager runner: a wide call's grouped-query attention packed now
    and not when it was measured, or not recorded then while it is now), or None. The
    adaptive D prices rounds by that curve; opening such a build warns (build.open), and
    building again replaces it. What needs the weights loaded to tell (prepacked GEMMs) is
    left to that warning."""
    runner = manifest.runner
    if recipe.backend.kind != "torch" or manifest.cost_curve is None or runner is None or \
            runner.kind == "transformers":
        return None
    if heads is None:  # (attention heads, KV heads): :func:`_heads`
        return None
    from trtspec.runtime.decoder_layer import packs_attention
    from trtspec.runtime.models import pick_device

    now = packs_attention(*heads, pick_device(recipe.backend.device).type)
    then = runner.packed_attention
    if then is None and now:
        return ("did not record whether its cost curve was measured with grouped query heads "
                "packed in calls of 2+ tokens a row, as they are now (an older trtspec)")
    if then is not None and then != now:
        return (f"measured its cost curve with grouped query heads {'' if then else 'not '}"
                f"packed in calls of 2+ tokens a row, and they are {'' if now else 'not '}now")
    return None
