"""Torch backend 'build': resolve and convert checkpoints, check tokenizers, describe them."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from trtspec.manifest import Artifact, RunnerInfo, file_digest
from trtspec.models import resolve
from trtspec.recipe import DraftModel, LayerSkip, Recipe

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
INDUCTOR = "inductor"  # inductor's cache, in the build folder


def describe(name: str, role: str, spec: str, path: Path) -> Artifact:
    config = json.loads((path / "config.json").read_text())
    return Artifact(
        name=name, role=role, source=spec, path=str(path),
        config_digest=file_digest(path / "config.json"),
        tokenizer_digest=file_digest(*(path / f for f in TOKENIZER_FILES)),
        vocab_size=config.get("vocab_size"), num_layers=config.get("num_hidden_layers"))


def prepare(recipe: Recipe) -> list[Artifact]:
    """Everything the torch backend will load, converted and checked; returns the artifacts."""
    from transformers import AutoTokenizer

    from trtspec.propose.draft_model import check_vocab

    target_path = resolve(recipe.target.model)
    target = describe("target", "target", recipe.target.model, target_path)
    declared = (recipe.target.num_attention_heads, recipe.target.num_key_value_heads)
    actual = head_counts(recipe.target.model)
    if declared[0] is not None and actual is not None and declared != actual[: 2]:
        raise ValueError(f"target.num_attention_heads/num_key_value_heads say {declared} but "
                         f"{recipe.target.model} has {actual}: fix the recipe")
    artifacts = [target]
    for m in recipe.methods:
        if isinstance(m, DraftModel):
            draft_path = resolve(m.model)
            check_vocab(AutoTokenizer.from_pretrained(target_path),
                        AutoTokenizer.from_pretrained(draft_path))
            artifacts.append(describe("draft", "draft", m.model, draft_path))
        elif isinstance(m, LayerSkip):
            layers = target.num_layers or 0
            if not 1 <= m.layers < layers:
                raise ValueError(f"methods: layer_skip.layers = {m.layers} but the target has "
                                 f"{layers} layers: use 1..{layers - 1}")
            artifacts.append(target.model_copy(update={
                "name": f"layer_skip-{m.layers}", "role": "draft",
                "flags": {"layers": m.layers}, "num_layers": m.layers}))
    return artifacts


def head_counts(model_spec: str) -> tuple[int, int] | None:
    """(attention heads, KV heads) from a config.json already on this machine, else None."""
    try:
        config = json.loads((resolve(model_spec, convert=False) / "config.json").read_text())
    except (ValueError, OSError):
        return None
    heads = config.get("num_attention_heads")
    return (heads, config.get("num_key_value_heads", heads)) if heads else None


def target_runner(recipe: Recipe, artifacts: list[Artifact], out_dir: Path,
                  say: Callable[[str], None]) -> tuple[Any, Any, RunnerInfo]:
    """The target's runner as eval and serve make it, its graphs compiled now into the build
    folder's inductor cache. Returns (runner, transformers model, what the manifest records)."""
    import time

    from trtspec.models import load_model
    from trtspec.runtime.kinds import built_runner, runner_kind

    target = next(a for a in artifacts if a.name == "target")
    model = load_model(Path(target.path), recipe.backend.device, recipe.target.dtype)
    notes: list[str] = []
    cache = (out_dir / INDUCTOR).resolve()
    if recipe.backend.runner == "compiled":
        say(f"compiling the target's decoder layer (torch.compile; cache: {cache}/) …")
        cache.mkdir(parents=True, exist_ok=True)
    began = time.perf_counter()
    runner = built_runner(model, recipe.backend.runner, rows=recipe.limits.max_batch_size,
                          cache_dir=cache, say=notes.append)
    kind = runner_kind(runner)
    seconds = time.perf_counter() - began if kind == "compiled" else None
    if seconds is not None:
        say(f"compiled in {seconds:.0f} s")
    for line in notes:
        say(line)
    return runner, model, RunnerInfo(kind=kind, requested=recipe.backend.runner,
                                     compile_seconds=seconds,
                                     cache_dir=str(cache) if kind == "compiled" else None,
                                     note=notes[0] if notes else None)
