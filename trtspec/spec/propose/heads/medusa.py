"""Medusa-1 heads: K small heads on the target's last hidden state, drafting without a cache.

Terms. The target's *hidden state* at a position is its last decoder layer's output there after
the target's final norm (what its LM head reads); ``h`` [H] is the one at the position whose
logits gave a row's last emitted token x₀. *Head k* (k = 0..K−1) is ``num_layers`` residual
blocks x + SiLU(W x + b) (W [H, H]) and a vocabulary projection [V, H]; from ``h`` it predicts
the token k + 1 places after x₀, so one call of the K heads gives logits for d₁..d_K at once.
Medusa-1 trains the heads on a frozen target; the target itself is unchanged.

Exactness. Draft d_k is sampled from q_k = ``logits_to_probs``(head k−1's logits, the row's
params) with one uniform from the row's generator, and q_k is returned as its probability:
given x₀ and d₁..d_{k−1}, q_k is exactly the distribution d_k was drawn from (the heads read h
only, so the earlier drafts change nothing), which is all rejection sampling needs. Under greedy
params q_k is the point mass on head k−1's top-1 token, and verification is token matching.

Where h comes from. The proposer asks the target Runner to keep its last layer's output
(``capture_hidden([-1])``, before the final norm) from the same forwards that verify: after
prefill / admission h is the prompt's last position; after a round that scored [x₀, d₁..d_D]
and accepted a drafts it is position a (d_a, or x₀ when a = 0), whose logits gave the new last
token. The final norm is applied once, when h is stored. No model with a cache drafts, so a
round costs the heads' K small matmuls, and ``draft_runner`` is None.

Checkpoint layout (FasterDecoding/Medusa's, which TensorRT-LLM's ``load_medusa_hf`` reads): a
folder with ``config.json`` {"medusa_num_heads", "medusa_num_layers", "hidden_size",
"vocab_size", "base_model_name_or_path"} and ``medusa_lm_head.safetensors`` (or ``.pt``) holding
``{k}.{j}.linear.weight`` [H, H] and ``{k}.{j}.linear.bias`` [H] for j < num_layers and
``{k}.{num_layers}.weight`` [V, H]. Keys may carry a ``medusa_head.`` prefix (Medusa's full-model
state dict) or ``medusa_heads.`` (ModelOpt's); :func:`save_medusa` writes none, as TensorRT-LLM
reads them. trtspec's own key ``"medusa_shared_lm_head": true`` lets a head without its
``{k}.{num_layers}.weight`` use the target's LM head (shared, not copied); TensorRT-LLM needs
every projection, which :func:`save_medusa` writes unless told to keep heads shared.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from trtspec.spec.propose.draft_model import fit_vocab
from trtspec.spec.propose.heads import (
    HeadsError,
    captured,
    llama_decoder,
    read_config,
    read_weights,
    take,
)
from trtspec.spec.propose.proposer import Draft
from trtspec.spec.sample.probs import SamplingParams, rows_to_probs, sample, uniforms

WEIGHT_FILES = ("medusa_lm_head.safetensors", "medusa_lm_head.pt")
PREFIXES = ("medusa_head.", "medusa_heads.")  # accepted on read; written: none
SHARED_KEY = "medusa_shared_lm_head"  # trtspec's: heads without a projection use the target's


class ResBlock(nn.Module):
    """x + SiLU(linear(x)), x [..., H]."""

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + nn.functional.silu(self.linear(x))


class MedusaHeads(nn.Module):
    """K heads; head k is ``heads[k]`` (its residual blocks, then its projection unless
    ``shared[k]``: then the target's LM head ``lm_head``, held by reference and not a
    parameter). ``heads.state_dict()`` is the public layout, less the shared projections."""

    def __init__(self, hidden_size: int, vocab_size: int, num_heads: int, num_layers: int,
                 lm_head: nn.Module | None = None, shared: Sequence[bool] | None = None) -> None:
        super().__init__()
        if num_heads < 1 or num_layers < 0:
            raise ValueError(f"Medusa needs ≥ 1 head and ≥ 0 layers, got {num_heads}, "
                             f"{num_layers}")
        self.hidden_size, self.vocab_size = hidden_size, vocab_size
        self.num_heads, self.num_layers = num_heads, num_layers
        self.shared = list(shared) if shared is not None else [False] * num_heads
        if any(self.shared) and lm_head is None:
            raise ValueError("a shared head needs the target's lm_head")
        self._lm_head = (lm_head,)  # a tuple: not registered, so not saved, moved or trained
        self.heads = nn.ModuleList(
            nn.Sequential(*[ResBlock(hidden_size) for _ in range(num_layers)],
                          *([] if s else [nn.Linear(hidden_size, vocab_size, bias=False)]))
            for s in self.shared)

    def projection(self, k: int) -> nn.Module:
        """Head k's vocabulary projection [V, H]: its own or the target's LM head."""
        return self._lm_head[0] if self.shared[k] else self.heads[k][self.num_layers]

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """h [N, H] (the target's normed last hidden state) → logits [N, K, V]."""
        out = []
        for k, head in enumerate(self.heads):
            x = h
            for j in range(self.num_layers):
                x = head[j](x)
            out.append(self.projection(k)(x))
        return torch.stack(out, dim=1)

    @classmethod
    def from_target(cls, model: nn.Module, num_heads: int, num_layers: int = 1) -> MedusaHeads:
        """Medusa's own initialisation: residual blocks zero (identity), each projection a copy
        of the target's LM head, so head k first predicts what the target predicts next."""
        lm_head = model.get_output_embeddings()
        weight = lm_head.weight  # [V, H]
        heads = cls(weight.shape[1], weight.shape[0], num_heads, num_layers)
        with torch.no_grad():
            for k, head in enumerate(heads.heads):
                for j in range(num_layers):
                    head[j].linear.weight.zero_()
                    head[j].linear.bias.zero_()
                heads.projection(k).weight.copy_(weight)
        return heads.to(weight.dtype).to(weight.device)


def load_medusa(folder: str | Path, target_model: nn.Module,
                num_heads: int | None = None) -> MedusaHeads:
    """The heads in ``folder`` for ``target_model`` (its first ``num_heads`` [default: all]),
    in the target's dtype on its device; HeadsError (one line) for anything that does not fit."""
    config = read_config(folder)
    where_config = Path(folder).expanduser() / "config.json"
    lm_head = target_model.get_output_embeddings()
    vocab, hidden = lm_head.weight.shape
    have, layers = config.get("medusa_num_heads"), config.get("medusa_num_layers", 1)
    shared = config.get(SHARED_KEY, False)
    for key, value, least in (("medusa_num_heads", have, 1), ("medusa_num_layers", layers, 0)):
        if type(value) is not int or value < least:
            raise HeadsError(f"{where_config}: {key} must be an integer ≥ {least}, got "
                             f"{value!r}")
    if not isinstance(shared, bool):
        raise HeadsError(f"{where_config}: {SHARED_KEY} must be true or false, got {shared!r}")
    for key, target in (("hidden_size", hidden), ("vocab_size", vocab)):
        if key in config and config[key] != target:
            raise HeadsError(f"{where_config}: {key} {config[key]!r} does not match the target's "
                             f"{key} {target}")
    want = have if num_heads is None else num_heads
    if not 1 <= want <= have:
        raise HeadsError(f"{where_config}: {want} heads asked, the checkpoint has {have}")
    tensors, where = read_weights(folder, WEIGHT_FILES)
    prefix = next((p for p in PREFIXES if any(k.startswith(p) for k in tensors)), "")
    found: dict[str, torch.Tensor] = {}
    own = [not (shared and f"{prefix}{k}.{layers}.weight" not in tensors) for k in range(want)]

    def get(name: str, shape: tuple[int, ...]) -> None:
        found[name] = take(tensors, name, shape, where, prefixes=(prefix,))

    for k in range(want):
        for j in range(layers):
            get(f"{k}.{j}.linear.weight", (hidden, hidden))
            get(f"{k}.{j}.linear.bias", (hidden,))
        if own[k]:
            get(f"{k}.{layers}.weight", (vocab, hidden))
    heads = MedusaHeads(hidden, vocab, want, layers, lm_head, [not o for o in own])
    heads.heads.load_state_dict(found, strict=True)
    return heads.to(lm_head.weight.dtype).to(lm_head.weight.device).eval()


def save_medusa(heads: MedusaHeads, folder: str | Path, base_model: str, *,
                keep_shared: bool = False) -> None:
    """Write ``heads`` to ``folder`` in the public layout (config.json and
    medusa_lm_head.safetensors, keys without prefix). A shared head's projection is written as
    a copy of the target's LM head, so TensorRT-LLM can read the folder, unless ``keep_shared``
    (smaller; trtspec-only): then it is left out and config.json says
    ``medusa_shared_lm_head``. A stale medusa_lm_head.pt there is removed (it would be read
    first by TensorRT-LLM)."""
    from safetensors.torch import save_file

    folder = Path(folder).expanduser()
    folder.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    for k in range(heads.num_heads):
        for j in range(heads.num_layers):
            block = heads.heads[k][j].linear
            tensors[f"{k}.{j}.linear.weight"] = block.weight
            tensors[f"{k}.{j}.linear.bias"] = block.bias
        if not (heads.shared[k] and keep_shared):
            tensors[f"{k}.{heads.num_layers}.weight"] = heads.projection(k).weight
    config: dict[str, Any] = {
        "medusa_num_heads": heads.num_heads, "medusa_num_layers": heads.num_layers,
        "hidden_size": heads.hidden_size, "vocab_size": heads.vocab_size,
        "base_model_name_or_path": base_model}
    if keep_shared and any(heads.shared):
        config[SHARED_KEY] = True
    save_file({k: v.detach().cpu().clone().contiguous() for k, v in tensors.items()},
              str(folder / WEIGHT_FILES[0]))
    (folder / WEIGHT_FILES[1]).unlink(missing_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")


class MedusaProposer:
    """Drafts up to K tokens per row with ``heads`` over the hidden states the ``target``
    Runner keeps (it must have ``capture_hidden``); see the module docstring. Per row it holds
    h, the normed hidden state of the position that gave the row's last token."""

    def __init__(self, target: Any, heads: MedusaHeads) -> None:
        decoder = llama_decoder(getattr(target, "model", target), "medusa")  # HeadsError else
        self.hidden_layers = [-1]  # what the executor asks the target to keep (its last layer)
        target.capture_hidden(self.hidden_layers)
        self.target, self.heads = target, heads.eval()
        self.norm = decoder.norm
        self.vocab = target.vocab_size
        self._h: torch.Tensor | None = None  # [B, H] normed, in the heads' dtype

    @property
    def draft_runner(self) -> None:
        """No model with a cache drafts."""
        return None

    def describe(self) -> str:
        shared = sum(self.heads.shared)
        return (f"medusa: {self.heads.num_heads} heads × {self.heads.num_layers} residual "
                f"blocks on the target's last hidden state"
                + (f" ({shared} sharing the target's LM head)" if shared else ""))

    def start(self, prompts: Sequence[Sequence[int]]) -> None:
        self._h = None
        self._keep({b: len(p) - 1 for b, p in enumerate(prompts)}, len(prompts))

    def admit(self, row: int, prompt: Sequence[int], kept: int = 0) -> None:
        self._keep({row: len(prompt) - 1 - kept}, row + 1)  # the last call fed prompt[kept:]

    @torch.inference_mode()
    def release(self, row: int, keep: int = 0) -> None:
        if self._h is not None and row < len(self._h):
            self._h[row] = 0

    def forget(self) -> None:
        """Nothing outlives a request here."""

    def undo(self) -> None:
        """Nothing to put back: propose reads only h, which admit and observe set."""

    def observe(self, num_accepted: Sequence[int]) -> None:
        counts = captured(self.target).counts
        if any(counts):
            self._keep({b: int(num_accepted[b]) for b, n in enumerate(counts) if n},
                       len(num_accepted))

    @torch.inference_mode()
    def _keep(self, positions: dict[int, int], batch: int) -> None:
        """h[b] = norm(hidden[b, positions[b]]) from the target's last call."""
        cap = captured(self.target)
        rows = list(positions)
        picked = cap.at(rows, list(positions.values()))  # [n, H] (checks the positions)
        size = self.heads.hidden_size
        param = next(self.heads.parameters(), None)
        dtype = param.dtype if param is not None else picked.dtype
        if self._h is None or len(self._h) < batch:
            grown = torch.zeros((batch, size), dtype=dtype, device=picked.device)
            if self._h is not None:
                grown[: len(self._h)] = self._h
            self._h = grown
        index = torch.tensor(rows, device=picked.device)
        self._h[index] = self.norm(picked[:, -size:]).to(dtype)  # [n, H]

    @torch.inference_mode()
    def propose(self, tokens: Sequence[Sequence[int]], draft_len: Sequence[int],
                params: Sequence[SamplingParams], generators: Sequence[torch.Generator]) -> Draft:
        batch = len(tokens)
        n = [min(int(d), self.heads.num_heads) for d in draft_len]
        steps = max(n, default=0)
        if steps == 0:
            return Draft.empty(batch)
        if self._h is None or len(self._h) < batch:
            raise RuntimeError("MedusaProposer.propose before start(): no hidden states kept")
        logits = self.heads(self._h[:batch])[:, :steps]  # [B, K, V]
        logits = fit_vocab(logits.reshape(batch * steps, -1), self.vocab).view(batch, steps, -1)
        q = rows_to_probs(logits, params)  # [B, K, V] fp32
        # row b draws n[b] uniforms from its own generator, in step order: the same stream as
        # one draw per live row per step (sample_drafts)
        u = uniforms(n, generators, q.device)  # [B, K]
        ids = sample(q.reshape(batch * steps, -1), u.reshape(-1)).view(batch, steps).cpu()
        ids = ids.masked_fill(torch.arange(steps) >= torch.tensor(n)[:, None], -1)
        return Draft(ids, torch.tensor(n, dtype=torch.long), q)
