"""A Runner over a transformers causal LM (Llama-family decoders: Llama, Mistral, Qwen2, SmolLM).

Ragged batches without padding games: :class:`RowCache` keeps each row's tokens in slots
[0, len_b) of one [B, H, capacity, d] buffer per layer. New tokens are written at len_b + t, a
4D boolean mask lets query t of row b see slots ≤ len_b + t, and ``position_ids`` are per row.
Rollback only lowers len_b: rejected keys stay behind as garbage that the mask hides and the next
write overwrites, so there is no crop, no recompute and no holes. The stock HF attention modules
do the math, so the logits are the model's own.
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn


class RowCache:
    """KV cache with a length per row; implements the ``update`` call HF attention makes."""

    def __init__(self, num_layers: int, batch: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device, capacity: int = 256) -> None:
        shape = (batch, kv_heads, capacity, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.lengths = torch.zeros(batch, dtype=torch.long, device=device)  # [B] committed
        self._rows = slice(0, batch)  # rows taking part in the current forward
        self._slots: torch.Tensor | None = None  # [b, T] where this forward writes
        self._width = 0  # slots the current forward attends over

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[2]

    def begin(self, rows: slice, width: int) -> torch.Tensor:
        """Prepare a forward of ``width`` new tokens for ``rows``; returns position ids [b, T]."""
        start = self.lengths[rows]  # [b]
        needed = int(start.max()) + width
        if needed > self.capacity:
            self._grow(max(needed, 2 * self.capacity))
        self._rows = rows
        self._slots = start[:, None] + torch.arange(width, device=start.device)  # [b, T]
        self._width = needed
        return self._slots

    def mask(self) -> torch.Tensor:
        """[b, 1, T, width] bool: query t of row b sees slots 0 … len_b + t."""
        assert self._slots is not None
        kv = torch.arange(self._width, device=self._slots.device)
        return (kv[None, None, :] <= self._slots[:, :, None])[:, None]

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """key/value [b, H, T, d] → write at the row's slots; return [b, H, width, d] views."""
        assert self._slots is not None
        b, h, t, d = key.shape
        index = self._slots[:, None, :, None].expand(b, h, t, d)
        keys = self.keys[layer_idx][self._rows]
        values = self.values[layer_idx][self._rows]
        keys.scatter_(2, index, key)
        values.scatter_(2, index, value)
        return keys[:, :, : self._width], values[:, :, : self._width]

    def select(self, rows: torch.Tensor) -> RowCache:
        """A cache whose row i is a copy of this cache's row ``rows[i]``."""
        out = copy.copy(self)
        out.keys = [k.index_select(0, rows) for k in self.keys]
        out.values = [v.index_select(0, rows) for v in self.values]
        out.lengths = self.lengths.index_select(0, rows)
        out._rows, out._slots, out._width = slice(0, len(rows)), None, 0
        return out

    def _grow(self, capacity: int) -> None:
        def grown(t: torch.Tensor) -> torch.Tensor:
            pad = t.new_zeros((*t.shape[:2], capacity - t.shape[2], t.shape[3]))
            return torch.cat([t, pad], dim=2)

        self.keys = [grown(k) for k in self.keys]
        self.values = [grown(v) for v in self.values]


class HFRunner:
    """A :class:`~trtspec.runtime.Runner` over a transformers ``*ForCausalLM``.

    ``model`` may be a :func:`layer_skip_view` of another model; it then shares the weights but
    keeps its own RowCache.
    """

    def __init__(self, model: nn.Module, eos_token_id: int | None = None,
                 vocab_size: int | None = None) -> None:
        self.model = model.eval()
        config = model.config
        self._decoder = model.get_decoder()
        self._head = model.get_output_embeddings()
        self._num_layers = config.num_hidden_layers
        self._hidden_size = config.hidden_size
        self._kv_heads = getattr(config, "num_key_value_heads", config.num_attention_heads)
        self._head_dim = getattr(config, "head_dim", None) or (
            config.hidden_size // config.num_attention_heads)
        self._vocab = vocab_size or self._head.weight.shape[0]
        self._eos = eos_token_id if eos_token_id is not None else _first(config.eos_token_id)
        self._additive_mask = getattr(config, "_attn_implementation", "sdpa") != "sdpa"
        # transformers ≥ 5 calls it `cache`; 4.x (TensorRT-LLM 1.2's pin) `past_key_values`
        decoder_args = inspect.signature(self._decoder.forward).parameters
        self._cache_kwarg = "cache" if "cache" in decoder_args else "past_key_values"
        # 4.x also takes a 1D `cache_position` (5.x has none); left out, 4.x derives it from
        # cache.get_seq_length(), which RowCache lacks: ragged rows have no single length
        self._cache_position = "cache_position" in decoder_args
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.cache: RowCache | None = None
        self._capture: list[int] = []  # decoder layers whose outputs each forward keeps
        self.hidden: torch.Tensor | None = None  # [n, T, k·H] of the last call (capture_hidden)
        self.hidden_first = 0  # the batch row of hidden[0]
        self.hidden_counts: list[int] = []  # tokens fed per batch row in that call

    @property
    def vocab_size(self) -> int:
        return self._vocab

    @property
    def eos_token_id(self) -> int | None:
        return self._eos

    def prefill(self, prompts: Sequence[Sequence[int]]) -> torch.Tensor:
        """Identical prompts (n samples of one prompt) are computed once and their cache rows
        copied, so a batch of n samples costs one prompt's prefill."""
        first: dict[tuple[int, ...], int] = {}
        for p in prompts:
            first.setdefault(tuple(p), len(first))
        longest = max(len(p) for p in prompts)
        self.cache = RowCache(self._num_layers, len(first), self._kv_heads, self._head_dim,
                              self.dtype, self.device, capacity=max(256, 2 * longest))
        logits = self.score(list(first), last_only=True)[:, 0]  # [U, V]
        if len(first) == len(prompts):
            return logits
        rows = torch.tensor([first[tuple(p)] for p in prompts], device=self.device)
        self.cache = self.cache.select(rows)
        if self._capture:
            self.hidden = self.hidden.index_select(0, rows)
            self.hidden_counts = [len(p) for p in prompts]
        return logits.index_select(0, rows)

    def capture_hidden(self, layers: Sequence[int]) -> None:
        """From now on every prefill/score also keeps the outputs of decoder ``layers`` (0-based,
        negative from the end; before the final norm) at every position fed, from the same
        forward: ``hidden`` [n, T, len(layers)·H] for the n contiguous rows from ``hidden_first``
        that the call scored, and ``hidden_counts`` (Medusa / EAGLE heads read them; an empty
        list stops keeping them)."""
        self._capture = layer_indices(self._num_layers, layers)
        self.hidden = None  # nothing kept yet under this request

    @torch.inference_mode()
    def score(self, tokens: Sequence[Sequence[int]], last_only: bool = False) -> torch.Tensor:
        cache = self._require_cache(len(tokens))
        counts = [len(t) for t in tokens]
        width = max(counts, default=0)
        batch = len(tokens)
        out_width = 1 if last_only else width
        logits = torch.zeros((batch, out_width, self._vocab), dtype=torch.float32,
                             device=self.device)  # stays on the model's device: verify runs there
        live = [b for b, n in enumerate(counts) if n]
        if not live:
            if self._capture:  # nothing scored: no states, but the call is still the last one
                self.hidden = torch.zeros((0, 0, len(self._capture) * self._hidden_size),
                                          dtype=self.dtype, device=self.device)
                self.hidden_first, self.hidden_counts = 0, list(counts)
            return logits
        rows = slice(live[0], live[-1] + 1)  # a contiguous range: views, no copies
        ids = torch.tensor([list(tokens[b]) + [0] * (width - counts[b])
                            for b in range(rows.start, rows.stop)], dtype=torch.long)
        positions = cache.begin(rows, width)  # [b, T]
        mask = cache.mask()  # [b, 1, T, width] bool
        if self._additive_mask:  # eager attention adds the mask to the scores
            mask = torch.zeros(mask.shape, dtype=self.dtype, device=self.device).masked_fill_(
                ~mask, torch.finfo(self.dtype).min)
        extra: dict[str, Any] = {self._cache_kwarg: cache}
        if self._cache_position:  # 4.x: a stand-in. With a 4D mask (returned as-is) and per-row
            # position_ids it only reaches cache.update's kwargs, which RowCache ignores
            extra["cache_position"] = positions[0]
        with layer_outputs(self.model, self._capture) as kept:
            hidden = self._decoder(input_ids=ids.to(self.device), attention_mask=mask,
                                   position_ids=positions, use_cache=True,
                                   **extra).last_hidden_state  # [b, T, d]
        if self._capture:
            self._keep(kept, rows, counts)
        n = torch.tensor(counts[rows], device=self.device)  # [b]
        if last_only:
            hidden = hidden[torch.arange(len(n), device=self.device), (n - 1).clamp(min=0)][:, None]
        logits[rows] = self._head(hidden).float()[..., : self._vocab]
        cache.lengths[rows] += n
        return logits

    def _keep(self, kept: list[torch.Tensor], rows: slice, counts: list[int]) -> None:
        """The captured layers' states of this call, for the rows it scored (a contiguous range:
        only those, so admitting one long prompt into a large batch keeps one row's states)."""
        self.hidden = torch.cat(kept, dim=-1)  # [b, T, k·H]
        self.hidden_first, self.hidden_counts = rows.start, list(counts)

    def rollback(self, lengths: Sequence[int]) -> None:
        cache = self._require_cache(len(lengths))
        new = torch.as_tensor(list(lengths), dtype=torch.long, device=cache.lengths.device)
        if bool((new > cache.lengths).any()):
            raise ValueError("cannot roll forward: a row holds fewer tokens than asked")
        cache.lengths.copy_(new)

    def lengths(self) -> list[int]:
        return [] if self.cache is None else self.cache.lengths.tolist()

    @property
    def shares_cache(self) -> bool:
        return False

    def layer_skip(self, num_layers: int, share_cache: bool = True) -> HFRunner:
        """A layer-skip draft with a RowCache of its own (the stock modules write one cache)."""
        return HFRunner(layer_skip_view(self.model, num_layers), eos_token_id=self._eos,
                        vocab_size=self._vocab)

    def warm_up(self, batch: int, watch: bool = False) -> float:
        return 0.0  # eager: nothing to compile

    def _require_cache(self, rows: int) -> RowCache:
        if self.cache is None:
            raise RuntimeError("call prefill() before score() or rollback()")
        if rows != len(self.cache.lengths):
            raise ValueError(f"got {rows} rows for a batch of {len(self.cache.lengths)}")
        return self.cache


def layer_indices(num_layers: int, layers: Sequence[int]) -> list[int]:
    """Layer numbers as given (negative from the end) → 0-based indices; ValueError when one is
    out of range."""
    out = []
    for i in layers:
        j = i + num_layers if i < 0 else i
        if not 0 <= j < num_layers:
            raise ValueError(f"layer {i} is out of range for a model of {num_layers} layers")
        out.append(j)
    return out


@contextmanager
def layer_outputs(model: nn.Module, layers: Sequence[int]) -> Iterator[list[torch.Tensor]]:
    """Within the block, forwards of ``model`` record the outputs of decoder ``layers`` (0-based,
    negative from the end; the residual stream before the final norm): afterwards the list
    holds one [B, T, H] tensor per layer, in the order asked (the last forward's). Hooks on the
    stock layers, so the states are the model's own, from the forward that made the logits;
    they are removed on exit (a layer-skip view sharing these layers records nothing later)."""
    decoder_layers = model.get_decoder().layers
    wanted = layer_indices(len(decoder_layers), layers)
    seen: dict[int, torch.Tensor] = {}
    kept: list[torch.Tensor] = []

    def hook(index: int) -> Any:
        def record(module: nn.Module, args: Any, output: Any) -> None:
            seen[index] = output[0] if isinstance(output, tuple) else output  # 4.x: a tuple
            if len(seen) == len(set(wanted)):
                kept[:] = [seen[i] for i in wanted]
        return record

    handles = [decoder_layers[i].register_forward_hook(hook(i)) for i in sorted(set(wanted))]
    try:
        yield kept
    finally:
        for h in handles:
            h.remove()


def layer_skip_view(model: nn.Module, num_layers: int) -> nn.Module:
    """The model's first ``num_layers`` decoder layers + final norm + LM head, sharing weights.

    A shallow copy: no parameter is duplicated, so a layer-skip draft costs no extra memory
    beyond its own KV cache.
    """
    decoder = model.get_decoder()
    total = len(decoder.layers)
    if not 1 <= num_layers < total:
        raise ValueError(f"layer_skip needs 1 ≤ draft layers < {total}, got {num_layers}")
    config = copy.copy(model.config)
    config.num_hidden_layers = num_layers
    inner = _shallow(decoder)
    inner.layers = nn.ModuleList(list(decoder.layers)[:num_layers])
    inner.config = config
    view = _shallow(model)
    view.config = config
    _set_decoder(view, inner)
    return view


def _shallow(module: nn.Module) -> nn.Module:
    """copy.copy that does not share the child-module table (so re-assigning children is local)."""
    clone = copy.copy(module)
    clone._modules = dict(module._modules)
    return clone


def _set_decoder(model: nn.Module, decoder: nn.Module) -> None:
    for name, child in model.named_children():
        if child is model.get_decoder():
            setattr(model, name, decoder)
            return
    raise ValueError(f"cannot find the decoder of {type(model).__name__}")


def _first(value: int | list[int] | None) -> int | None:
    return value[0] if isinstance(value, list) else value
