"""`trtspec doctor`: what this machine has, and what each recipe needs that is missing."""

from __future__ import annotations

import os
import platform
from pathlib import Path

from trtspec.build import gpu as gpus
from trtspec.build.manifest import versions
from trtspec.build.recipe import RecipeError, load_recipe


def machine() -> list[tuple[str, str]]:
    import torch

    v = versions()
    detected = gpus.detect()
    rows = [("python", f"{v['python']} ({platform.machine()})"),
            ("trtspec", v["trtspec"] or "?"),
            ("torch", f"{v['torch']}; CUDA {'available' if torch.cuda.is_available() else 'no'}"),
            ("transformers", v["transformers"] or "missing"),
            ("tensorrt_llm", v["tensorrt_llm"] or "not installed (plans only: build --dry-run)"),
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
