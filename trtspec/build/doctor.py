"""`trtspec doctor`: what this machine has, and what each recipe needs that is missing.

For TensorRT-LLM it names the installed release, the workflows that release offers, the modes
trtspec runs on it with whether each keeps the target's distribution at T > 0, and, per recipe,
which methods that release runs on the recipe's workflow and mode (:func:`recipe_features`).
Release differences come from trtspec.build.trtllm_options (one place for each release's names);
without TensorRT-LLM the answers are for the release trtspec is written against
(``trtllm_options.RELEASE``), and say so. ``tensorrt_llm`` itself is imported only through the
guarded runtime module, to learn whether the installed package imports.
"""

from __future__ import annotations

import os
import platform
from pathlib import Path
from typing import Any

from trtspec.build import gpu as gpus
from trtspec.build import trtllm_options as options
from trtspec.build.manifest import versions
from trtspec.build.recipe import RecipeError, load_recipe

SUPPORTED = "1.2.x"  # the TensorRT-LLM line trtspec is written and checked against
NATIVE_TYPES = ("NGram", "Draft_Target", "Eagle3", "MTP")  # the pytorch workflow's, in 1.2.x


def machine() -> list[tuple[str, str]]:
    import torch

    v = versions()
    detected = gpus.detect()
    rows = [("python", f"{v['python']} ({platform.machine()})"),
            ("trtspec", v["trtspec"] or "?"),
            ("torch", f"{v['torch']}; CUDA {'available' if torch.cuda.is_available() else 'no'}"),
            ("transformers", v["transformers"] or "missing"),
            ("tensorrt_llm", trtllm_row(v["tensorrt_llm"])),
            ("TensorRT-LLM workflows", "; ".join(workflows(v["tensorrt_llm"]))),
            ("TensorRT-LLM modes", "; ".join(modes(v["tensorrt_llm"]))),
            ("GPUs", "; ".join(f"{g.name} (SM {g.compute_capability}, {g.memory_gib:.0f} GiB, "
                               f"driver {g.driver})" for g in detected) or "none"),
            ("MLflow tracking URI", os.environ.get("MLFLOW_TRACKING_URI",
                                                   "sqlite:///mlflow.db (default)"))]
    return rows


def recipe_needs(path: Path) -> list[str]:
    """What running this recipe here would lack; [] when nothing."""
    try:
        recipe = load_recipe(path)
    except RecipeError as e:
        return [f"invalid: {e}"]
    missing = []
    detected = gpus.detect()
    if recipe.backend.kind == "trtllm":
        if versions()["tensorrt_llm"] is None:
            missing.append("tensorrt_llm (Linux + NVIDIA GPU + CUDA; pip index pypi.nvidia.com)")
        want = gpus.profile(recipe.gpu.name) if recipe.gpu.name != "auto" else None
        if not detected:
            missing.append(f"an NVIDIA GPU ({want.name if want else 'any'})")
        elif want and detected[0].compute_capability != want.compute_capability:
            missing.append(f"a {want.name} (SM {want.compute_capability}); this machine has "
                           f"{detected[0].name}")
        if detected and len(detected) < recipe.gpu.count:
            missing.append(f"{recipe.gpu.count} GPUs (found {len(detected)})")
        installed = versions()["tensorrt_llm"]
        if installed and recipe.backend.workflow == "engine" and options.at_least(installed, 1, 3):
            missing.append(f"TensorRT-LLM {SUPPORTED} for the engine workflow (installed: "
                           f"{installed}, which has none)")
    else:
        from trtspec.runtime.models import ModelNotFound, resolve

        specs = [recipe.target.model] + [m.model for m in recipe.methods
                                         if m.method == "draft_model"]
        for spec in specs:
            try:
                resolve(spec, convert=False)
            except ModelNotFound as e:
                if "not converted yet" not in str(e):
                    missing.append(f"model {spec}: {e}")
    return missing


def trtllm_row(release: str | None) -> str:
    """The installed release, whether it is in the supported line and whether it imports."""
    if release is None:
        return f"not installed (plans only: build --dry-run; {SUPPORTED}: pip install " \
               "'trtspec[trtllm]' on Linux with an NVIDIA GPU)"
    from trtspec.runtime.trtllm import release as importable

    line = "supported" if in_range(release) else f"outside the supported {SUPPORTED}"
    if importable() is None:
        return f"{release} ({line}), but `import tensorrt_llm` fails here"
    return f"{release} ({line})"


def in_range(release: str) -> bool:
    return options.at_least(release, 1, 2) and not options.at_least(release, 1, 3)


def workflows(release: str | None) -> list[str]:
    """What ``release`` offers (None: what the supported release would)."""
    if release is not None and options.at_least(release, 1, 3):
        found = ["pytorch (LLM API, trtllm-serve)"]
        return found + ["no engine workflow (trtllm-build engines end with 1.2.x)"]
    found = ["pytorch (LLM API, trtllm-serve)", "engine (trtllm-build, trtllm-serve "
             "--backend tensorrt)"]
    return found if release is not None else [f"none here ({options.RELEASE} would offer: "
                                              f"{', '.join(w.split(' (')[0] for w in found)})"]


def modes(release: str | None) -> list[str]:
    """The modes trtspec runs on ``release``'s pytorch workflow, each with whether it keeps
    the target's distribution at T > 0 (trtspec.runtime.trtllm.exactness: as 1.2.1's source
    reads; ``audit``: measure it with ``trtspec audit``); engines run native alone."""
    from trtspec.runtime.trtllm import exactness

    native = ", ".join(f"{options.decoding_type(_Method(t), release or options.RELEASE)} "
                       f"{_native_exact(t)}" for t in NATIVE_TYPES)
    found = [f"exact (trtspec verifies; exact at T > 0: {exactness('exact', None, 1.0).exact})",
             "drafter (trtspec drafts; not run by eval, audit or serve yet; exact at T > 0 as "
             f"the source reads: {exactness('drafter', None, 1.0).exact})",
             f"native (TensorRT-LLM drafts and verifies; at T > 0: {native})"]
    if release is None:
        return [f"none here (on {options.RELEASE}: {'; '.join(found)})"]
    return found


def _native_exact(decoding: str) -> str:
    from trtspec.runtime.trtllm import exactness

    one_model = decoding in options.ONE_MODEL  # trtspec sets allow_advanced_sampling for them
    return exactness("native", decoding, 1.0, allow_advanced_sampling=one_model).exact


class _Method:
    """A recipe method's stand-in for trtllm_options.decoding_type, by 1.2.x decoding type."""

    def __init__(self, decoding: str) -> None:
        self.method = {"NGram": "ngram", "Draft_Target": "draft_model", "Eagle3": "eagle",
                       "MTP": "mtp", "Medusa": "medusa"}[decoding]
        self.version = 3


def recipe_features(path: Path) -> list[str]:
    """For a trtllm recipe, one line per method: whether the installed TensorRT-LLM (without
    one: the supported release) runs it on the recipe's workflow and mode, and whether that is
    exact at T > 0. [] for a torch recipe or one that does not load (recipe_needs says why)."""
    try:
        recipe = load_recipe(path)
    except RecipeError:
        return []
    if recipe.backend.kind != "trtllm":
        return []
    installed = versions()["tensorrt_llm"]
    release = installed or options.RELEASE
    workflow, mode = recipe.backend.workflow, recipe.backend.mode
    where = f"TensorRT-LLM {release}" + ("" if installed else " (not installed here)")
    if workflow == "engine" and options.at_least(release, 1, 3):
        return [f"{where} has no engine workflow: build with TensorRT-LLM {SUPPORTED}, or set "
                "backend.workflow: pytorch"]
    return [f"{m.method}: " + _feature(m, release, workflow, mode) + f" [{where}]"
            for m in recipe.methods]


def _feature(method: Any, release: str, workflow: str, mode: str) -> str:
    from trtspec.runtime.trtllm import exactness

    if mode != "native":
        if method.method not in ("ngram", "suffix", "draft_model"):
            return f"no: trtspec drafts ngram, suffix and draft_model in mode {mode}"
        exact = exactness(mode, None, 1.0)  # type: ignore[arg-type]
        if mode == "drafter":
            return (f"not run by eval, audit or serve yet (its Drafter is built; exact at "
                    f"T > 0 as the source reads: {exact.exact}): use backend.mode: exact")
        return f"yes, mode {mode} (exact at T > 0: {exact.exact})"
    decoding = options.decoding_type(method, release, workflow)
    if decoding is None:
        return "no: " + _no_native(method, release, workflow)
    if workflow == "engine":
        if decoding in ("Medusa", "Eagle"):
            return (f"yes, {decoding} engine (exact at T > 0: no; it verifies by token "
                    "matching or typical acceptance)")
        return (f"planned only on engines (TensorRT-LLM runs {decoding} on the pytorch "
                "workflow): set backend.workflow: pytorch to run it")
    if decoding == "Eagle":
        return "no: EAGLE-1/2 run on 1.2.x engines only"
    fields = options.sampling_fields(decoding, release)
    exact = exactness("native", decoding, 1.0, **{"allow_advanced_sampling": True} if fields
                      else {})
    said = f", {', '.join(fields)} set" if fields else ""
    return f"yes, native {decoding} (exact at T > 0: {exact.exact}{said})"


def _no_native(method: Any, release: str, workflow: str) -> str:
    match method.method:
        case "suffix":
            return "TensorRT-LLM has no suffix drafting: backend.mode drafter or exact"
        case "layer_skip":
            return "layer_skip runs on the torch backend only"
        case "medusa":
            return ("TensorRT-LLM ≥ 1.3 has no Medusa" if options.at_least(release, 1, 3)
                    else "Medusa runs on 1.2.x engines only: backend.workflow: engine")
        case "eagle":
            return ("EAGLE-1/2 have no form in TensorRT-LLM ≥ 1.3: eagle version 3"
                    if options.at_least(release, 1, 3) else
                    "EAGLE-1/2 run on 1.2.x engines only: backend.workflow: engine")
    return f"TensorRT-LLM {release} has no form of {method.method}"
