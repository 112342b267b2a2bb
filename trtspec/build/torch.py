"""Torch backend 'build': resolve and convert checkpoints, check tokenizers, describe them."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from trtspec.build.manifest import Artifact, RunnerInfo, file_digest
from trtspec.build.recipe import DraftModel, Eagle, LayerSkip, Medusa, Recipe
from trtspec.runtime.models import resolve
from trtspec.spec.cost_curve import CostCurve

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

    from trtspec.spec.propose.draft_model import check_vocab

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
        elif isinstance(m, Medusa | Eagle):
            artifacts.append(heads_artifact(m))
    return artifacts


HEADS_WEIGHTS = ("medusa_lm_head.safetensors", "medusa_lm_head.pt", "model.safetensors",
                 "pytorch_model.bin")


def heads_artifact(method: Medusa | Eagle) -> Artifact:
    """A Medusa / EAGLE-3 heads folder as an artifact. A folder that does not exist yet is
    recorded as left out (flags.missing says how to train it) instead of failing the build:
    the recipe's other methods still build and run, and the next build picks the heads up."""
    from trtspec.spec.propose.heads import read_config

    spec = method.heads if isinstance(method, Medusa) else method.model
    folder = Path(spec).expanduser()
    train = (f"`trtspec distill <recipe> --method {method.method}` trains them (`make heads` "
             "for the CPU recipe)")
    why = None
    if not folder.exists():
        why = f"no heads at {spec}: {train}"
    elif folder.is_dir() and not (folder / "config.json").exists() and \
            (folder / ".distill").is_dir():
        why = (f"{spec} holds an unfinished `trtspec distill` (no config.json yet): --resume "
               "continues it")
    if why is not None:
        return Artifact(name=method.method, role="heads", source=spec,
                        path=str(folder.absolute()), flags={"missing": why})
    config = read_config(folder)
    return Artifact(name=method.method, role="heads", source=spec, path=str(folder.resolve()),
                    config_digest=file_digest(folder / "config.json",
                                              *(folder / w for w in HEADS_WEIGHTS)),
                    vocab_size=config.get("vocab_size"))


def load_heads(method: Medusa | Eagle, path: str | Path, model: Any) -> Any:
    """The method's heads from ``path``, checked against the target ``model`` (HeadsError, one
    line, on a wrong or missing tensor, or a target whose decoder heads cannot read)."""
    from trtspec.spec.propose.heads import llama_decoder

    llama_decoder(model, method.method)  # HeadsError, one line, for a target heads cannot read
    if isinstance(method, Medusa):
        from trtspec.spec.propose.heads.medusa import load_medusa

        return load_medusa(path, model, num_heads=method.num_heads)
    from trtspec.spec.propose.heads.eagle import load_eagle3

    return load_eagle3(path, model)


def check_heads(recipe: Recipe, artifacts: list[Artifact], model: Any,
                say: Callable[[str], None]) -> None:
    """Load every heads artifact against the loaded target now, so a wrong checkpoint fails the
    build (exit 2, one line) rather than the first request; say which were left out."""
    for m in recipe.methods:
        if not isinstance(m, Medusa | Eagle):
            continue
        artifact = next(a for a in artifacts if a.name == m.method)
        if "missing" in artifact.flags:
            say(f"note: {m.method} left out of this build: {artifact.flags['missing']}")
            continue
        load_heads(m, artifact.path, model)


def head_counts(model_spec: str) -> tuple[int, int] | None:
    """(attention heads, KV heads) from a config.json already on this machine, else None."""
    try:
        config = json.loads((resolve(model_spec, convert=False) / "config.json").read_text())
    except (ValueError, OSError):
        return None
    heads = config.get("num_attention_heads")
    return (heads, config.get("num_key_value_heads") or heads) if heads else None


def target_runner(recipe: Recipe, artifacts: list[Artifact], out_dir: Path,
                  say: Callable[[str], None]) -> tuple[Any, Any, RunnerInfo]:
    """The target's runner as eval and serve make it, its graphs compiled now into the build
    folder's inductor cache. Returns (runner, transformers model, what the manifest records)."""
    import time

    from trtspec.runtime.kinds import built_runner, runner_kind
    from trtspec.runtime.models import load_model

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
                                     note=notes[0] if notes else None,
                                     prepacked=bool(getattr(runner, "prepacked", False)),
                                     packed_attention=bool(getattr(runner, "packed_attention",
                                                                   False)))


def measure_costs(recipe: Recipe, artifacts: list[Artifact], max_tokens: int, target: Any,
                  model: Any) -> CostCurve:
    """``trtspec build`` (torch): time the target Runner eval will use (and the drafts, made
    the way eval makes them), then its round cost over max_batch_size rows; ``model`` is the
    target's loaded transformers model. ``$TRTSPEC_COST_REPEATS`` (default 5) sets the timings
    each figure is the median of: 1 measures in a fifth of the time, with more noise (the
    tests' builds use it; a build for an eval should not)."""
    from trtspec.runtime.hf import HFRunner
    from trtspec.runtime.models import load_model
    from trtspec.spec.cost_curve import ROUND_CONTEXT, measure, measure_rounds

    drafts: dict[str, Any] = {}
    for m in recipe.methods:
        if isinstance(m, LayerSkip):
            drafts[m.method] = target.layer_skip(m.layers, share_cache=False)
        elif isinstance(m, DraftModel):
            draft = load_model(Path(_path(artifacts, "draft")), recipe.backend.device, m.dtype)
            drafts[m.method] = HFRunner(draft)  # as make_proposer runs a draft model
    repeats = int(os.environ.get("TRTSPEC_COST_REPEATS") or 5)
    curve = measure(target, max_tokens, drafts, repeats=repeats)
    began = time.perf_counter()
    rounds = measure_rounds(target, recipe.limits.max_batch_size, max_tokens, ROUND_CONTEXT,
                            repeats=repeats)
    return curve.model_copy(update={"rounds": rounds,
                                    "rounds_seconds": time.perf_counter() - began})


def _path(artifacts: list[Artifact], name: str) -> str:
    return next(a.path for a in artifacts if a.name == name)
