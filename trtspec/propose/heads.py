"""What Medusa and EAGLE-3 heads share: reading a published checkpoint folder (config.json plus
safetensors, ``.pt`` or ``.bin`` weights) with one-line errors that name the file and tensor,
and reading the target's hidden states the runner captured for the positions it scored.

Why one place: a head checkpoint comes from a hub download, SpecForge, the Medusa trainer or
``trtspec distill``; a wrong file must fail at build (exit 2, one line), not as a shape error
deep inside the first request.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch


class HeadsError(ValueError):
    """A head checkpoint that cannot be used: one line naming the folder, file or tensor."""


def read_config(folder: str | Path) -> dict[str, Any]:
    """``folder/config.json`` as a dict; HeadsError when the folder or file is missing or bad."""
    folder = Path(folder).expanduser()
    if not folder.is_dir():
        raise HeadsError(f"{folder}: no such heads directory")
    path = folder / "config.json"
    if not path.is_file():
        raise HeadsError(f"{path}: missing (a heads directory holds config.json and weights)")
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise HeadsError(f"{path}: not JSON ({e.msg})") from None
    if not isinstance(config, dict):
        raise HeadsError(f"{path}: not a JSON object")
    return config


def read_weights(folder: str | Path, names: Iterable[str]) -> tuple[dict[str, torch.Tensor], Path]:
    """The tensors of the first weight file in ``folder`` named in ``names`` (tried in order;
    ``*.safetensors``, ``*.pt`` or ``*.bin``), loaded on the CPU. Returns (tensors, file)."""
    from safetensors.torch import load_file

    folder = Path(folder).expanduser()
    tried = list(names)
    for name in tried:
        path = folder / name
        if not path.is_file():
            continue
        try:
            if path.suffix == ".safetensors":
                tensors = load_file(str(path), device="cpu")
            else:
                tensors = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as e:  # a truncated or foreign file: say which
            raise HeadsError(f"{path}: cannot read ({type(e).__name__}: "
                             f"{(str(e).splitlines() or [''])[0][:120]})") from None
        if not isinstance(tensors, Mapping):
            raise HeadsError(f"{path}: not a state dict of tensors")
        return dict(tensors), path
    raise HeadsError(f"{folder}: no weights ({' or '.join(tried)})")


def take(tensors: Mapping[str, torch.Tensor], name: str, shape: tuple[int, ...], where: Path,
         *, prefixes: Iterable[str] = ("",)) -> torch.Tensor:
    """``tensors[prefix + name]`` for the first prefix present, checked against ``shape``;
    HeadsError naming the tensor when it is missing or shaped otherwise."""
    for prefix in prefixes:
        key = prefix + name
        if key in tensors:
            t = tensors[key]
            if tuple(t.shape) != tuple(shape):
                raise HeadsError(f"{where}: tensor {key} has shape {list(t.shape)}, expected "
                                 f"{list(shape)}")
            return t
    raise HeadsError(f"{where}: tensor {next(iter(prefixes)) + name} is missing")


def captured(runner: Any) -> tuple[torch.Tensor, list[int]]:
    """The hidden states the target ``runner`` kept in its last prefill/score call
    ([B, T, k·H]) and the tokens fed per row; RuntimeError when it keeps none."""
    hidden = getattr(runner, "hidden", None)
    if hidden is None:
        raise RuntimeError("the target runner kept no hidden states: call capture_hidden() "
                           "before its first prefill")
    return hidden, list(runner.hidden_counts)
