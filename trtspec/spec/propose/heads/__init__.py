"""What Medusa and EAGLE-3 heads share: reading a published checkpoint folder (config.json plus
safetensors, ``.pt`` or ``.bin`` weights) with one-line errors that name the file and tensor,
and reading the target's hidden states the runner captured for the positions it scored.

Why one place: a head checkpoint comes from a hub download, SpecForge, the Medusa trainer or
``trtspec distill``; a wrong file must fail at build (exit 2, one line), not as a shape error
deep inside the first request.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
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


def llama_decoder(model: Any, heads: str) -> Any:
    """``model``'s decoder when it has decoder layers and a final norm (what Medusa and EAGLE-3
    heads read); HeadsError (one line) otherwise."""
    get = getattr(model, "get_decoder", None)
    decoder = get() if callable(get) else None
    if decoder is None or not hasattr(decoder, "layers") or not hasattr(decoder, "norm"):
        kind = getattr(getattr(model, "config", None), "model_type", None) or \
            type(model).__name__
        raise HeadsError(f"{heads} heads need a Llama-family target (decoder layers + final "
                         f"norm): {kind}")
    return decoder


@dataclass
class Captured:
    """The hidden states a target Runner kept in its last prefill/score call: only the rows it
    scored (a contiguous range from ``first``), so one admitted prompt keeps one row's states."""

    states: torch.Tensor  # [n, T, k·H]: batch rows first … first + n − 1
    first: int
    counts: list[int]  # tokens fed per batch row (0: not scored)

    def row(self, b: int) -> torch.Tensor:
        """[counts[b], k·H]: row b's states at the positions it was fed."""
        return self.states[b - self.first, : self.counts[b]]

    def at(self, rows: Sequence[int], positions: Sequence[int]) -> torch.Tensor:
        """[len(rows), k·H]: row rows[i]'s state at positions[i] (each < its count)."""
        for b, t in zip(rows, positions, strict=True):
            if not 0 <= t < self.counts[b]:
                raise RuntimeError(f"row {b}: hidden position {t} of the target's last call, "
                                   f"which fed it {self.counts[b]} tokens")
        device = self.states.device
        return self.states[torch.tensor([b - self.first for b in rows], device=device),
                           torch.tensor(list(positions), device=device)]


def captured(runner: Any) -> Captured:
    """The hidden states the target ``runner`` kept in its last prefill/score call;
    RuntimeError when it keeps none."""
    hidden = getattr(runner, "hidden", None)
    if hidden is None:
        raise RuntimeError("the target runner kept no hidden states: call capture_hidden() "
                           "before its first prefill")
    return Captured(hidden, int(runner.hidden_first), list(runner.hidden_counts))
