"""`trtspec serve --native`: trtllm-serve on a TensorRT-LLM pytorch-workflow build's options
file, with the method and D a flag or a decided policy names (the server's own launch and
signals: :mod:`trtspec.serve.launch`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from trtspec.build.open import PLAIN
from trtspec.cli.evaluation import engines_root, explain_engines
from trtspec.cli.policy import policy_from_eval
from trtspec.serve.slots import DraftPolicy
from trtspec.spec.adaptive import ADAPTIVE

IN_PROCESS_ONLY = ("api_key", "slots", "max_waiting", "served_model_name", "spec_metrics",
                   "prefill_chunk", "prefill_stall")


def refuse_in_process_flags(backend: str) -> None:
    """--native runs trtllm-serve: the flags of trtspec's own server do not reach it."""
    from click.core import ParameterSource

    ctx = click.get_current_context()
    given = [f"--{name.replace('_', '-')}" for name in IN_PROCESS_ONLY
             if ctx.get_parameter_source(name) not in (ParameterSource.DEFAULT, None)]
    given = [("--per-request-spec-decode-metrics" if g == "--spec-metrics" else g)
             for g in given] + (["--backend toy"] if backend == "toy" else [])
    if given:
        raise click.UsageError(f"--native runs trtllm-serve, which takes none of "
                               f"{', '.join(given)}: drop them")


def native_build(recipe_path: str, overrides: tuple[str, ...], engines: str | None
                 ) -> tuple[Any, Any, Path]:
    """(the recipe, its manifest, the build folder) of a TensorRT-LLM pytorch-workflow build:
    a recipe's (found as eval finds it) or a build folder."""
    from trtspec.build.gpu import detect
    from trtspec.build.manifest import (
        BUILT_RECIPE,
        ManifestError,
        check_gpu,
        load_manifest,
        open_built,
    )
    from trtspec.build.recipe import load_recipe

    folder = Path(recipe_path) if Path(recipe_path).is_dir() else None
    path = str(folder / BUILT_RECIPE) if folder is not None else recipe_path
    if folder is not None and not Path(path).is_file():
        raise click.UsageError(f"{folder}: no {BUILT_RECIPE} here (a build folder is "
                               "engines/<recipe>/<gpu>/, written by `trtspec build`)")
    recipe = load_recipe(path, list(overrides))
    backend = recipe.backend
    if backend.kind != "trtllm" or backend.workflow != "pytorch":
        what = "the torch backend: drop --native" if backend.kind != "trtllm" else \
            "the engine workflow: serve its engines with the trtllm-serve commands " \
            "`trtspec build --dry-run` prints"
        raise click.UsageError(f"{path}: --native launches trtllm-serve on a pytorch-workflow "
                               f"TensorRT-LLM build; this recipe runs {what}")
    from trtspec.serve.launch import find_executable

    find_executable()  # the executable is all --native needs of TensorRT-LLM
    if folder is not None:
        manifest = load_manifest(folder)
        check_gpu(manifest, detect(), folder / "manifest.json")
        return recipe, manifest, folder
    root, why = engines_root(recipe_path, engines)
    try:
        manifest, manifest_path = open_built(recipe, recipe_path, root)
    except ManifestError as e:
        raise explain_engines(e, root, why) from None
    return recipe, manifest, manifest_path.parent


def native_options(recipe: Any, manifest: Any, method: str | None,
                   draft_len: int | str | None, schedule: DraftPolicy | None,
                   notes: list[str]) -> tuple[str, dict[str, Any], Path]:
    """(a name, the options to serve, the file build wrote they come from): ``method`` at
    ``draft_len`` [default: the recipe's first of each], plain decoding for ``none``, or a
    schedule's D by running requests merged into the method's ``speculative_config``
    (TensorRT-LLM's form of it: :func:`trtspec.build.trtllm_options.draft_len_schedule`)."""
    from trtspec.build.manifest import ManifestError
    from trtspec.serve.launch import merged_options, read_options

    def built(name: str) -> Path | None:
        try:
            return Path(manifest.artifact(name).path)
        except ManifestError:
            return None

    method = method or recipe.methods[0].method
    if method == PLAIN or draft_len == 0:
        path = built("baseline")
        if path is None:
            raise click.UsageError("the build wrote no llmapi/baseline.yaml: run `trtspec "
                                   "build` again")
        return "baseline", read_options(path), path
    if method not in {m.method for m in recipe.methods}:
        raise click.UsageError(f"--method {method}: the recipe has "
                               f"{', '.join(m.method for m in recipe.methods)} (or {PLAIN})")
    lengths = [d for d in recipe.condition_draft_lengths(manifest.draft_lengths)
               if isinstance(d, int) and built(f"{method}-d{d}") is not None]
    if not lengths:
        raise click.UsageError(f"the build wrote no options file for {method} "
                               "(llmapi/<method>-d<D>.yaml): run `trtspec build` again")
    speculative = None
    if schedule is not None:
        from trtspec.build.trtllm_options import draft_len_schedule

        if schedule.adaptive:
            raise click.UsageError("an adaptive D has no TensorRT-LLM form: give fixed draft "
                                   "lengths")
        steps = [(int(n), int(d)) for n, d in schedule.schedule]
        if not steps or steps[0][1] == 0:  # TensorRT-LLM refuses max_draft_len 0
            notes.append("the schedule drafts nothing at one running request: serving plain "
                         "decoding (llmapi/baseline.yaml)")
            return native_options(recipe, manifest, PLAIN, None, None, notes)
        speculative = draft_len_schedule(steps)
        d = int(speculative.get("max_draft_len") or max(d for _, d in steps))
    else:
        d = lengths[0] if draft_len is None else int(draft_len)
    name = f"{method}-d{d}"
    path = built(name)
    if path is None:
        if schedule is None:
            raise click.UsageError(f"--draft-len {d}: the build wrote options for {method} at "
                                   f"D = {', '.join(map(str, lengths))}")
        path = built(f"{method}-d{lengths[0]}")  # the schedule sets max_draft_len
        notes.append(f"{method}: the schedule's max_draft_len {d} was not built: serving "
                     f"{path} with it")
    assert path is not None
    options = merged_options(read_options(path), speculative)
    if speculative:
        name += "-policy"
    return name, options, path


def serve_native(recipe_path: str, overrides: tuple[str, ...], engines: str | None,
                 method: str | None, draft_len: int | str | None,
                 draft_len_schedule: str | None, policy_dir: str | None,
                 mlflow_uri: str | None, host: str, port: int,
                 kv_cache_fraction: float | None) -> None:
    """`trtspec serve --native`: trtllm-serve on the build's options file (module docstring
    of :mod:`trtspec.serve.launch`); exits when it exits (0 after a forwarded signal)."""
    import signal

    from trtspec.serve.launch import LaunchError, ServerSpec, TrtllmServer, forwarding

    recipe, manifest, folder = native_build(recipe_path, overrides, engines)
    notes: list[str] = []
    schedule = None
    if policy_dir:
        from trtspec.analysis.policy import decided_build

        if policy_dir.startswith("models:/"):
            from trtspec.report.approve import fetch_approved

            fetched = fetch_approved(policy_dir, mlflow_uri)
            method, schedule = policy_from_eval(fetched.folder, method, notes, label=policy_dir)
            digest = decided_build(fetched.folder)
        else:
            method, schedule = policy_from_eval(Path(policy_dir), method, notes)
            digest = decided_build(policy_dir)
        if digest and digest != manifest.build_digest:
            raise click.UsageError(f"--policy {policy_dir} was decided on another build "
                                   f"({digest[:12]}; this one is "
                                   f"{str(manifest.build_digest)[:12]})")
    elif draft_len_schedule:
        try:
            schedule = DraftPolicy.parse(draft_len_schedule)
        except ValueError as e:
            raise click.BadParameter(str(e), param_hint="--draft-len-schedule") from None
    if draft_len == ADAPTIVE:
        raise click.UsageError("--draft-len adaptive has no TensorRT-LLM form: give a number")
    name, options, source = native_options(recipe, manifest, method, draft_len, schedule, notes)
    t, limits = recipe.target, recipe.limits
    spec = ServerSpec(name=name, model=t.model, options=options, tp_size=t.tp_size,
                      pp_size=t.pp_size, max_batch_size=limits.max_batch_size,
                      max_num_tokens=limits.max_num_tokens, max_seq_len=limits.max_seq_len,
                      kv_cache_fraction=kv_cache_fraction, host=host, port=port)
    server = TrtllmServer(spec, folder / "serve")
    click.echo(f"trtspec serve --native: starting {server.executable} on {source} (options "
               f"as run: {server.options_path}; log: {server.log_path})")
    for note in notes:
        click.echo(f"note: {note}")
    with forwarding([server]) as received:
        try:
            server.start()
        except LaunchError:
            if received:
                click.echo("trtspec serve --native: stopped before it was healthy")
                return
            raise
        try:
            click.echo(f"trtspec serve --native: {server.url}  model {t.model}  ({name})")
            code = server.wait()
        finally:
            server.stop()
    if received:
        names = ", ".join(signal.Signals(s).name for s in dict.fromkeys(received))
        click.echo(f"trtspec serve --native: trtllm-serve stopped on {names} (exit code "
                   f"{code})")
        return
    if code != 0:
        raise LaunchError(f"trtllm-serve exited with code {code}; {server.log_path}: "
                          f"{server.log_tail()}")
    click.echo("trtspec serve --native: trtllm-serve exited")
