"""Which Runner a model runs on: the kind a recipe or a build names (``compiled``, ``eager`` or
``transformers``), with the fallbacks said once, and the target's runner as built."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch import nn

from trtspec.runtime.compiled import CompiledRunner, unsupported


def _stderr(line: str) -> None:
    import sys

    print(line, file=sys.stderr)


def make_runner(model: nn.Module, kind: str = "compiled", *, eos_token_id: int | None = None,
                vocab_size: int | None = None, cache_dir: Path | None = None,
                capacity: int = 512, prepacked: bool | None = None,
                warn: Callable[[str], None] = _stderr) -> Any:
    """The Runner of a backend.runner kind: ``compiled`` (this decoder under torch.compile),
    ``eager`` (the same decoder, eager) or ``transformers`` (the model's own modules, eager: any
    architecture). A model this decoder does not cover runs on ``transformers``, with one
    warning; ``TRTSPEC_COMPILE=0`` turns ``compiled`` into ``eager``. ``prepacked``: see
    CompiledRunner (default: on a CPU, unless ``TRTSPEC_PREPACK=0``)."""
    from trtspec.runtime.hf import HFRunner

    if kind == "compiled" and os.environ.get("TRTSPEC_COMPILE", "1") == "0":
        kind = "eager"
    if kind != "transformers" and (reason := unsupported(model)):
        warn(f"warning: the {kind} runner does not support {reason}; running the transformers "
             "runner")
        kind = "transformers"
    if kind == "transformers":
        return HFRunner(model, eos_token_id=eos_token_id, vocab_size=vocab_size)
    return CompiledRunner(model, eos_token_id, vocab_size, compile=kind == "compiled",
                          cache_dir=cache_dir, capacity=capacity, prepacked=prepacked, warn=warn)


def runner_kind(runner: Any) -> str:
    """compiled, eager or transformers: what ``runner`` runs now (after any fallback)."""
    if isinstance(runner, CompiledRunner):
        return "compiled" if runner.compiled else "eager"
    return "transformers"


def built_runner(model: nn.Module, kind: str, *, rows: int, cache_dir: Path | None,
                 eos_token_id: int | None = None, say: Callable[[str], None] = _stderr) -> Any:
    """The target's Runner as ``trtspec build`` makes it and eval and serve remake it: with
    ``compiled``, its graphs for a batch of ``rows`` rows are compiled (or loaded from
    ``cache_dir``) now, so no request waits for a compiler."""
    if kind == "compiled" and cache_dir is not None and not Path(cache_dir).is_dir():
        say(f"no inductor cache at {cache_dir}: compiling now (a minute or two)")
    runner = make_runner(model, kind, eos_token_id=eos_token_id, cache_dir=cache_dir, warn=say)
    if runner_kind(runner) == "compiled":
        runner.warm_up(rows)
    return runner
