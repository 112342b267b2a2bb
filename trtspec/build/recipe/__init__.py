"""Recipes: what to compare, on which GPU, with which limits (YAML, strict).

:mod:`~trtspec.build.recipe.schema` says what a recipe is; :func:`load_recipe` reads one, applies
``--set`` overrides and turns every problem into one :class:`RecipeError` line that names the
file, the key path and the fix (:mod:`~trtspec.build.recipe.reference`, which also renders the
documented reference from the schema).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from trtspec.build.recipe.decide import Decide, Slo
from trtspec.build.recipe.schema import Recipe, RecipeError, TorchBackend
from trtspec.spec.methods import DraftModel, Eagle, LayerSkip, Medusa, Ngram, Suffix

__all__ = ["Decide", "DraftModel", "Eagle", "LayerSkip", "Medusa", "Ngram", "Recipe",
           "RecipeError", "Slo", "Suffix", "TorchBackend", "load_recipe"]


def load_recipe(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> Recipe:
    """Read, override (``a.b=c``, ``methods.0.max_n=4``) and validate a recipe file."""
    path = Path(path)
    if not path.is_file():
        raise RecipeError(f"{path}: no such recipe file")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" (line {mark.line + 1})" if mark else ""
        raise RecipeError(f"{path}: not valid YAML{where}: {getattr(e, 'problem', e)}") from None
    if not isinstance(data, dict):
        raise RecipeError(f"{path}: a recipe is a YAML mapping with target, methods, backend …")
    for item in overrides:
        _apply_override(path, data, item)
    try:
        return Recipe.model_validate(data)
    except ValidationError as e:
        from trtspec.build.recipe.reference import first_error  # `python -m` runs that module

        set_keys = [item.partition("=")[0] for item in overrides]
        raise RecipeError(f"{path}: {first_error(e, set_keys)}") from None


def _apply_override(path: Path, data: dict[str, Any], item: str) -> None:
    key, sep, raw = item.partition("=")
    if not sep or not key:
        raise RecipeError(f"--set {item!r}: write it as key.path=value")
    try:
        value = yaml.safe_load(raw)
    except yaml.YAMLError as e:
        raise RecipeError(f"--set {key}: the value {raw!r} is not valid YAML "
                          f"({getattr(e, 'problem', None) or 'parse error'}): quote it, e.g. "
                          f"--set '{key}=\"{raw}\"'") from None
    node: Any = data
    parts = key.split(".")
    for i, part in enumerate(parts):
        last = i == len(parts) - 1
        where = ".".join(parts[:i]) or "the recipe"
        if isinstance(node, list):
            if not part.isdigit() or int(part) >= len(node):
                raise RecipeError(f"{path}: --set {key}: '{part}' is not an index of "
                                  f"{where} (0..{len(node) - 1})")
            index: Any = int(part)
        elif isinstance(node, dict):
            index = part
        else:
            raise RecipeError(f"{path}: --set {key}: {where} is a single value "
                              f"({node!r}), not a mapping with keys: set {where}=… instead")
        if last:
            node[index] = value
        else:
            if isinstance(node, dict) and index not in node:
                node[index] = {}
            node = node[index]
