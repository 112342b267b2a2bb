"""CompiledRunner: a Llama-family decoder run as ``torch.compile`` graphs.

Why: eager transformers spends a CPU decode step in module calls and unfused small ops, and runs
its projections as ``x @ Wᵀ``, which BLAS serves slowly for the few rows of a decode or verify
step. This decoder fuses q|k|v and gate|up (copies: the model is left as it was), on a CPU
prepacks every projection's weight for oneDNN once (``decoder_layer.prepack``: about 2× faster
GEMMs at a verify round's rows; ``prepacked=False`` or ``TRTSPEC_PREPACK=0`` keeps ``W · xᵀ``
over rows padded to what BLAS runs fastest), and inductor fuses norm, rotary, SiLU·mul and the
cache write.

One decoder layer (``decoder_layer.layer_fn``) is compiled, not the whole model: every layer has the
same shapes, so its weights are graph *inputs* and one graph serves all layers (and a layer-skip
draft of the same model). Its dimensions are dynamic — the contiguous range of rows that take part
(Bb), the new tokens per row (Tb) and the key/value slots attended (W) — so a growing context or
another draft length never recompiles: about twenty graphs per batch size (those of two groups
in one call included: see below), as size-1 dimensions
specialise (Bb = 1 or more, Tb = 1 or more), several rows are either the whole batch or part of it
(the cache view's strides differ; see warm_up) and, weights not prepacked, ``project`` switches
form past PROJECT_ROWS rows.
On a GPU this means inductor's kernels without CUDA graphs (a replay would copy every layer's
weights, inputs here, into its static buffers). Ragged rows are padded to Tb. Padding is harmless by
construction (the RowCache rule): a padded query writes its key at a slot ≥ the row's committed
length, which the mask hides and the next real write overwrites. Inductor's on-disk cache lives
under the build folder, so a second process reuses the kernels.

A round and a prompt's chunk in one call (``score_pair``, ``decoder_layer.pair_fn``): two groups of
rows, adjacent in the cache, their tokens packed into every projection (the weights read once)
and each group attending over its own span, so the round's rows never attend over the prompt's.

Live rows only (``pack_rows``, on by default): a call scores the contiguous range of *physical*
cache rows that hold the rows it feeds, so a batch row is a name, mapped to a physical row
(``_phys``). When the rows a call feeds are not contiguous there (a request ended between two
others) and one of the three calls before it fed the same rows (a set that recurs, as a round's
does until a request ends, not a draft step's passing subset), rows are swapped first, moving the
fewest into the densest window: each swap copies two rows' committed keys and values, once, and
every later call scores only the live rows (two live requests in rows 0 and 7 of 8 score 2 rows,
not 8). Callers see no difference: logits, lengths
and rollback stay by batch row. A call that keeps hidden states (heads read them by batch row)
puts the rows back in order first and is never packed.
"""

from __future__ import annotations

import copy
import os
import sys
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from trtspec.runtime import CacheFull
from trtspec.runtime.decoder_layer import (
    PROJECT_ROWS,
    gemm_weights,
    layer_fn,
    layer_weights,
    packs_attention,
    pair_fn,
    prepack,
    prepacks,
    project,
)

SPAN_STEP = 32
MIN_CAPACITY = 512
# how fast a prompt's chunk attends, per FLOP, against its projections, by device: fitted on the
# 2-core CPU (a 16-token chunk in the round's call timed at positions 64-1,900, float32,
# weights prepacked: 0.23 and 0.38 in two runs, benchmarks/bench_chunk_cost.py); other devices
# not measured (attention_context None)
ATTENTION_RATE = {"cpu": 0.3}
# a round's longest row attends in a group of its own (CompiledRunner._split) where that
# spares this many keys (rows × slots) or more, by device: a second attention call and its mask
# a layer cost about what reading 250 keys a layer does (2-core CPU, SmolLM2-135M, compiled;
# a micro-benchmark, not kept: 1,024 is a margin over it, not itself measured; what a split
# saves at 2,880 keys and more: benchmarks/bench_split.py); other devices not measured (never
# split: on a GPU each call is kernel launches more a layer, where a thousand keys take
# microseconds to read)
SPLIT_KEYS = {"cpu": 1024}
FREE_USABLE = 0.8  # of the free memory, what a growing KV cache may take (the rest: the
# activations and logits of the calls that follow)


def _stderr(line: str) -> None:
    print(line, file=sys.stderr)


def unsupported(model: nn.Module) -> str | None:
    """Why ``model`` cannot run on this runner, or None when it can."""
    config = model.config
    if config.model_type not in ("llama", "mistral", "qwen2"):
        return f"model type {config.model_type!r} (compiled: llama, mistral, qwen2)"
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
        return "sliding-window attention"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"activation {config.hidden_act!r}"
    layer = model.get_decoder().layers[0]
    extra = {n for n, _ in layer.self_attn.named_children()} - {"q_proj", "k_proj", "v_proj",
                                                                 "o_proj"}
    if extra:
        return f"attention with {sorted(extra)}"
    if any(getattr(m, "bias", None) is not None for m in layer.mlp.children()):
        return "MLP biases"
    if getattr(layer.self_attn.o_proj, "bias", None) is not None:
        return "an attention output bias"
    return None


def pow2(n: int, floor: int = 1) -> int:
    return max(floor, 1 << max(0, n - 1).bit_length())


class CompiledRunner:
    """A :class:`~trtspec.runtime.Runner` over a Llama-family ``*ForCausalLM`` (or a layer-skip
    view of one). ``compile=False`` runs the same functions eagerly (the reference).
    ``prepacked`` (default: on unless ``TRTSPEC_PREPACK=0``) prepacks the GEMM weights where
    every one of them can be (module docstring; all or none, as one graph serves every layer):
    the prepacked copies cost about the model's weights once more in memory, where the fused
    copies they replace were about half of them (SmolLM2 in float32: the runner adds 508 MiB
    prepacked, 251 MiB not)."""

    def __init__(self, model: nn.Module, eos_token_id: int | None = None,
                 vocab_size: int | None = None, *, compile: bool = True,
                 cache_dir: Path | None = None, capacity: int = 512,
                 prepacked: bool | None = None,
                 warn: Callable[[str], None] = _stderr) -> None:
        reason = unsupported(model)
        if reason:
            raise ValueError(f"the compiled runner does not support {reason}")
        self.model = model.eval()
        config = model.config
        decoder = model.get_decoder()
        self._embed, self._norm = decoder.embed_tokens, decoder.norm
        self._rotary = decoder.rotary_emb
        self._head = model.get_output_embeddings()
        self._hq = config.num_attention_heads
        self._hkv = getattr(config, "num_key_value_heads", None) or self._hq
        self._d = getattr(config, "head_dim", None) or config.hidden_size // self._hq
        self._eps = float(config.rms_norm_eps)
        self._layer_params = sum(w.numel() for w in gemm_weights(decoder.layers[0]))
        if prepacked is None:
            prepacked = os.environ.get("TRTSPEC_PREPACK", "1") != "0"
        self.prepacked = prepacked and all(
            prepacks(w) for w in (self._head.weight, *(w for layer in decoder.layers
                                                       for w in gemm_weights(layer))))
        if prepacked and not self.prepacked and self._head.weight.device.type == "cpu":
            warn(f"warning: the weights ({self._head.weight.dtype}) are not prepacked for "
                 "oneDNN here: the projections run as W · xᵀ, slower on a CPU (a "
                 "float32 model, or bfloat16 on a CPU with AVX-512 BF16, is prepacked)")
        self._weights = [layer_weights(layer, prepacked=self.prepacked)
                         for layer in decoder.layers]
        self._head_w = (prepack(self._head.weight) if self.prepacked  # [V′, H]
                        else self._head.weight)
        self._vocab = vocab_size or self._head.weight.shape[0]
        eos = config.eos_token_id if eos_token_id is None else eos_token_id
        self._eos = eos[0] if isinstance(eos, list) else eos
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        # a call of 2+ tokens a row attends packed (decoder_layer.PACK_GQA): a build records it
        self.packed_attention = packs_attention(self._hq, self._hkv, self.device.type)
        self._capacity = pow2(capacity, MIN_CAPACITY)
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self._lengths: list[int] = []
        self._phys: list[int] = []  # batch row → physical cache row (the owner's: see packing)
        self.pack_rows = True  # score only the rows a call feeds (module docstring)
        self.split_keys: int | None = SPLIT_KEYS.get(self.device.type)  # the longest row in
        # a group of its own (see _split): where that spares this many keys; None: never
        self.swaps = self.grows = 0  # row swaps packing made, cache tensors grown or shrunk
        self.last_scored = 0  # rows the last call scored (packed, or the range it spanned)
        self.last_split = False  # whether score's last call split its rows (see _split)
        self._recent: deque[tuple[int, ...]] = deque(maxlen=4)  # rows fed by the last calls
        self._pending = 0  # slots a row a gradual reservation grows toward (reserve)
        self._owner = self  # whose KV cache this runner reads and writes (see view)
        self._warmed: set[int] = set()  # batch sizes warm_up has compiled for
        self.late_compiles = 0  # graphs compiled after a warm-up: each made a request wait
        self._warming = self._watch = False
        self.compiled, self.warn, self.cache_dir = compile, warn, cache_dir
        self._eager = layer_fn(self._hq, self._hkv, self._d, self._eps,
                               prepacked=self.prepacked)
        self._graph: Callable[..., torch.Tensor] = self._eager
        self._pair = pair_fn(self._hq, self._hkv, self._d, self._eps, prepacked=self.prepacked)
        self._pair_graph: Callable[..., tuple[torch.Tensor, ...]] = self._pair
        self._pairing = True  # score_pair makes one call (off after its graph failed)
        self.shapes: set[tuple[int, ...]] = set()  # (Bb, Tb) run compiled so far, and
        # (Bb, Tb, Bb′, Tb′) for a pair
        self._capture: list[int] = []  # layers whose outputs each forward keeps (heads)
        self.hidden: torch.Tensor | None = None  # [n, T, k·H] of the last call: rows from
        self.hidden_first, self.hidden_counts = 0, []  # hidden_first; tokens fed per batch row
        if compile:
            if cache_dir is not None:
                os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache_dir)
            dynamo = torch._dynamo.config
            for knob in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit",
                         "accumulated_cache_size_limit"):
                if hasattr(dynamo, knob):
                    setattr(dynamo, knob, max(getattr(dynamo, knob), 256))
            self._graph = torch.compile(self._eager, dynamic=False, fullgraph=True)
            self._pair_graph = torch.compile(self._pair, dynamic=False, fullgraph=True)

    @property
    def attention_context(self) -> float | None:
        """The context at which a prompt token's attention costs about what its projections
        do: per layer 2 FLOPs a GEMM weight against 4·Hq·d a key attended (SmolLM2-135M:
        3,072 keys), times ATTENTION_RATE (about 920 on the CPU); None on a device not
        measured, and with the weights not prepacked (measured prepacked only: unprepacked
        GEMMs run about 2× slower, so attention weighs less). Why: a step's chunk at a
        prompt's end attends over all of it, so at 1,900 tokens a 16-token chunk cost
        2.4–2.8× what it did at the start (two runs, benchmarks/bench_chunk_cost.py; the
        scheduler prices a chunk's tokens by it: its module docstring, "chunk")."""
        rate = ATTENTION_RATE.get(self.device.type) if self.prepacked else None
        flops = 2 * self._layer_params, 4 * self._hq * self._d  # a token's; a key's
        return None if rate is None else rate * flops[0] / flops[1]

    @property
    def vocab_size(self) -> int:
        return self._vocab

    @property
    def eos_token_id(self) -> int | None:
        return self._eos

    def view(self, num_layers: int, *, share_cache: bool = False) -> CompiledRunner:
        """A layer-skip draft: this model's first ``num_layers`` layers, final norm and head,
        sharing every weight and compiled graph. Its KV cache is its own, or with
        ``share_cache`` this runner's first ``num_layers`` layers: the target's forwards have
        already written the draft's keys and values for every committed token (same weights,
        same inputs), so the draft never re-reads what it skipped. It writes only at slots past
        the target's committed length, which the target overwrites before it reads them."""
        if not 1 <= num_layers < len(self._weights):
            raise ValueError(f"layer_skip needs 1 ≤ draft layers < {len(self._weights)}, got "
                             f"{num_layers}")
        draft = copy.copy(self)
        draft._weights = self._weights[:num_layers]
        draft.keys, draft.values, draft._lengths = [], [], []
        draft._owner = self if share_cache else draft
        draft._phys, draft._pending, draft.swaps, draft.grows = [], 0, 0, 0
        draft._recent = deque(maxlen=4)
        draft._warmed = set()
        draft._capture, draft.hidden, draft.hidden_counts = [], None, []
        return draft

    def capture_hidden(self, layers: Sequence[int]) -> None:
        """See :meth:`trtspec.runtime.Runner.capture_hidden`: the layers' outputs are kept from
        the scoring forward itself (tensors the layer graph returns anyway: no recompile)."""
        from trtspec.runtime.hf import layer_indices

        self._capture = layer_indices(len(self._weights), layers)
        self.hidden = None  # nothing kept yet under this request

    @property
    def shares_cache(self) -> bool:
        return self._owner is not self

    def layer_skip(self, num_layers: int, share_cache: bool = True) -> CompiledRunner:
        return self.view(num_layers, share_cache=share_cache)

    def detached(self) -> CompiledRunner:
        """The same layers with a KV cache of their own (to time a draft step, say): a shared-
        cache view does not prefill."""
        return self if self._owner is self else self._owner.view(len(self._weights))

    def follow(self) -> None:
        """A shared-cache view takes the lengths its owner's cache holds for each row (forward
        too: the owner wrote those slots), so it writes only past what the owner committed."""
        if self._owner is self:
            raise RuntimeError("follow() is for a view made with share_cache=True")
        self._lengths = list(self._owner._lengths)

    def _caches(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        n = len(self._weights)
        return self._owner.keys[:n], self._owner.values[:n]

    def prefill(self, prompts: Sequence[Sequence[int]]) -> torch.Tensor:
        if self._owner is not self:
            raise RuntimeError("a shared-cache view does not prefill: its owner does")
        self._allocate(len(prompts), max(len(p) for p in prompts) + 16)
        return self.score(prompts, last_only=True)[:, 0]

    def score(self, tokens: Sequence[Sequence[int]], last_only: bool = False) -> torch.Tensor:
        return self._score(tokens, last_only)

    @torch.inference_mode()
    def _score(self, tokens: Sequence[Sequence[int]], last_only: bool,
               split: int | None = None) -> torch.Tensor:
        """score(); ``split`` (warm_up) the rows of the first group, forced (else _split's)."""
        self._require(len(tokens))
        counts = [len(t) for t in tokens]
        width = max(counts, default=0)
        batch = len(tokens)
        logits = torch.zeros((batch, 1 if last_only else width, self._vocab),
                             dtype=torch.float32, device=self.device)
        live = [b for b, n in enumerate(counts) if n]
        if self._capture:
            size = len(self._capture) * self._embed.weight.shape[1]
            self.hidden = torch.zeros((0, 0, size), dtype=self.dtype, device=self.device)
            self.hidden_first, self.hidden_counts = 0, list(counts)
        if not live:
            return logits
        self._place(live)
        cut = self._split(live, counts) if split is None else \
            sorted(self._owner._phys[b] for b in live)[split]
        groups = [self._group(tokens, live)] if cut is None else \
            [self._group(tokens, [b for b in live if (self._owner._phys[b] < cut) == first],
                         width) for first in (True, False)]  # one width: the graphs warmed
        self.last_scored = sum(len(g.rows) for g in groups)
        self.last_split = cut is not None
        self._room(max(g.span for g in groups), max(g.top for g in groups), width)
        try:
            xs, kept = self._run(*groups) if cut is not None else self._run(groups[0], None)
        except _PairFailed:  # the pair graph failed to compile: one group from now on (this
            self._recent.pop()  # call's rows counted once: _place records them again)
            return self._score(tokens, last_only)
        if self._capture:
            self.hidden = torch.cat(kept, dim=-1)  # [Bb, Tb, k·H]: the rows scored only
            self.hidden_first = groups[0].rows.start
        self._logits([(g, x, logits, last_only) for g, x in zip(groups, xs, strict=True)])
        for b in live:
            self._lengths[b] += counts[b]
        return logits

    def _split(self, live: list[int], counts: list[int]) -> int | None:
        """Where a call's rows split in two groups, each attending over its own span (one
        call: ``decoder_layer.pair_fn``): the longest row alone, the rest together; None to
        score them as one. Returns the physical row where the longest row's group starts.

        Why: one group attends every row over the longest row's span, its masked keys read all
        the same, so beside a 2,000-token request a round of three short rows paid 1.6 ms a
        layer for attention against 0.5 ms split (SmolLM2-135M, 2-core CPU, compiled): the
        round cost about 2.4× what it did before that request came. Why the longest alone:
        one long request among short ones is the case that costs most, and a second group of
        one row needs three graphs more a batch size (warm_up: the round's width 1; at 2 or
        more those of score_pair serve), where one of any size would need about twelve.

        The rows must be packed (contiguous), pairing on, no hidden states kept, and (weights
        not prepacked) the tokens within PROJECT_ROWS, where the pair's graphs are warm. It
        splits where that spares ``split_keys`` keys or more (the other rows × the span they
        no longer attend; None, on a device not measured: never). The longest row is swapped
        to the top of the rows first where it is not there, once the same rows recur (as for
        packing): a copy of two rows' keys up to the longer one's length, as much as about
        two rounds spare at the least worthwhile split, and done again only when the order
        changes: a prompt admitted beside the rows takes the row above them (score_pair), so
        each admission beside a long request costs one such copy when it joins the rounds.
        Two long rows within split_keys / (rows − 1) slots of each other are not split (what
        it would spare is too small), so rows growing side by side do not take turns on
        top."""
        owner = self._owner
        if self.split_keys is None or not (self._pairing and owner.pack_rows and
                                           len(live) > 1 and not self._capture):
            return None
        width = max(counts[b] for b in live)
        if not self.prepacked and len(live) * width > PROJECT_ROWS:
            return None
        phys = owner._phys
        at = sorted(phys[b] for b in live)
        if at[-1] - at[0] + 1 != len(at):
            return None

        def span(b: int) -> int:  # the slots row b attends in this call, as _group pads them
            return -(-(self._lengths[b] + width) // SPAN_STEP) * SPAN_STEP

        longest = max(live, key=lambda b: (span(b), phys[b]))
        rest = max(span(b) for b in live if b != longest)
        if (len(live) - 1) * (span(longest) - rest) < self.split_keys:
            return None
        if phys[longest] != at[-1]:
            if self._recent.count(tuple(live)) < 2:  # a set fed once: not worth a swap
                return None
            self._swap(phys[longest], at[-1])
        return at[-1]

    @torch.inference_mode()
    def score_pair(self, tokens: Sequence[Sequence[int]], row: int, chunk: Sequence[int],
                   last: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``score(tokens)`` and, in the same call, ``chunk`` appended to ``row`` (a prompt
        being admitted, fed nothing in ``tokens``): returns (``score(tokens)``'s logits
        [B, T, V], the logits [V] after the chunk's last token). One call runs both groups
        (``decoder_layer.pair_fn``: the projections over all their tokens at once, each group's
        attention over its own span) where the round's rows are contiguous (packing), the
        chunk's row is right after them or can be swapped there, the chunk is at least 2
        tokens and the tokens fit PROJECT_ROWS (``pairs``); else, and for a runner that
        keeps hidden states, two calls (the chunk's, then the round's), as a scheduler
        without it would make. Logits are those of the two calls up to float rounding (other
        GEMM shapes). Not ``last`` (a chunk that does not complete its prompt, whose logits
        no one reads): None in their place, and in one call the head (the largest matrix:
        about 5 ms of a 60-ms step for SmolLM2 on the CPU) runs over the round's rows only
        (in two calls the chunk's call computes them all the same)."""
        self._require(len(tokens))
        live = [b for b, t in enumerate(tokens) if t]
        if tokens[row] or not chunk:
            raise ValueError("score_pair: the chunk's row is fed nothing else, and the chunk "
                             "is not empty")
        width = max(len(t) for t in tokens)
        pair = self.pairs(live, row, width, len(chunk))
        if pair:
            self._place(live)
            phys = self._owner._phys
            lo, hi = min(phys[b] for b in live), max(phys[b] for b in live)
            pair = (hi - lo + 1) * width + len(chunk) <= PROJECT_ROWS  # (not packed yet:
            if pair and phys[row] != hi + 1:  # the rows between count) the chunk's row goes
                pair = hi + 1 < len(phys) and not lo <= phys[row] <= hi  # right after the
                if pair:  # round's (a swap, once an admission: cheap at its first chunk)
                    self._swap(phys[row], hi + 1)
            if not pair:
                self._recent.pop()  # the round's score() below records its rows itself
        if not pair:
            feed: list[Sequence[int]] = [[] for _ in tokens]
            feed[row] = chunk
            after = self.score(feed, last_only=True)[row, 0]
            return (self.score(tokens) if live else
                    torch.zeros((len(tokens), 0, self._vocab), device=self.device)), \
                after if last else None
        feed = list(tokens)
        feed[row] = chunk
        ga, gb = self._group(feed, live), self._group(feed, [row])
        self.last_scored = len(ga.rows)
        self._room(max(ga.span, gb.span), max(ga.top, gb.top), max(ga.width, gb.width))
        try:
            (xa, xb), _ = self._run(ga, gb)
        except _PairFailed:
            return self.score_pair(tokens, row, chunk, last)  # two calls now: pairing is off
        logits = torch.zeros((len(tokens), ga.width, self._vocab), dtype=torch.float32,
                             device=self.device)
        if not last:
            self._logits([(ga, xa, logits, False)])
            after = None
        else:
            out = torch.zeros((len(tokens), 1, self._vocab), dtype=torch.float32,
                              device=self.device)
            self._logits([(ga, xa, logits, False), (gb, xb, out, True)])
            after = out[row, 0]
        for b in (*live, row):
            self._lengths[b] += len(feed[b])
        return logits, after

    def pairs(self, live: Sequence[int], row: int, width: int, chunk: int) -> bool:
        """Whether ``score_pair`` would score a round feeding the batch rows ``live`` (at most
        ``width`` tokens a row) and a ``chunk``-token chunk in ``row`` in one call (else it
        makes two): pairing on (off after a compiler failure of its graph), no hidden states
        kept, a chunk of 2 tokens or more, the tokens within PROJECT_ROWS (the rows the round
        spans counted, or its live rows where they can be packed: a skinny GEMM's rows where
        the weights are not prepacked; prepacked, past that many tokens the compute outweighs
        the one weight read a single call saves), and the chunk's row after the round's or
        free to be swapped there."""
        if not (self._pairing and live and chunk >= 2 and not self._capture):
            return False
        owner = self._owner
        phys = owner._phys
        at = sorted(phys[b] for b in live)
        rows = len(at) if owner.pack_rows else at[-1] - at[0] + 1
        if rows * width + chunk > PROJECT_ROWS:
            return False
        return owner.pack_rows or phys[row] == at[-1] + 1

    def _group(self, tokens: Sequence[Sequence[int]], live: list[int],
               width: int | None = None) -> _Group:
        """The inputs of one call's group of rows: the contiguous range of physical rows the
        batch rows ``live`` span (views of the cache, no copies), their tokens padded to the
        widest (or to ``width``), positions, slots and the causal mask over the slots
        attended."""
        phys = self._owner._phys
        counts = [len(tokens[b]) for b in range(len(tokens))]
        tb = width or max(counts[b] for b in live)
        rows = range(min(phys[b] for b in live), max(phys[b] for b in live) + 1)  # physical
        batch_row = [0] * len(phys)  # physical → batch row
        for b, at in enumerate(phys):
            batch_row[at] = b
        order = [batch_row[at] for at in rows]  # the batch row of each row scored
        start = torch.tensor([self._lengths[b] for b in order])  # [Bb]
        top = int(start.max())
        span = -(-(top + tb) // SPAN_STEP) * SPAN_STEP  # slots attended
        ids = torch.zeros((len(rows), tb), dtype=torch.long)
        for i, b in enumerate(order):
            ids[i, : counts[b]] = torch.as_tensor(list(tokens[b]), dtype=torch.long)
        slots = (start[:, None] + torch.arange(tb)).to(self.device)  # [Bb, Tb]
        mask = (torch.arange(span, device=self.device)[None, None, :]
                <= slots[:, :, None])[:, None]  # [Bb, 1, Tb, W]
        x = self._embed(ids.to(self.device))  # [Bb, Tb, hidden]
        cos, sin = self._rotary(x, slots)
        counted = torch.tensor([counts[b] for b in order], device=self.device)  # [Bb]
        return _Group(rows, order, tb, span, top, x, cos, sin, mask, slots, counted)

    def _room(self, span: int, top: int, width: int) -> None:
        """Room in the cache for a call that attends ``span`` slots, its longest row holding
        ``top`` tokens, ``width`` fed a row: now, or the next tensors of a reservation."""
        owner = self._owner
        if span > owner._capacity:  # needed now: all of it (and what is reserved) at once
            owner._grow_now(span)
        elif owner._pending > owner._capacity:  # reserved: a few tensors a call, spread over
            owner._grow_some((owner._capacity - top - width) // width)  # the calls

    def _run(self, first: _Group, second: _Group | None
             ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Every layer over one group (``second`` None) or two adjacent ones, compiled (the
        same math eagerly after a compiler failure); returns the last layer's output for
        each group and the kept layers' outputs (one group only)."""
        compiled = self.compiled
        if compiled:
            graphs = _graphs_compiled()
            try:
                out = self._layers(True, first, second)
                self.shapes.add((len(first.rows), first.width) if second is None else
                                (len(first.rows), first.width, len(second.rows), second.width))
                if self._owner._warmed and not self._owner._warming and \
                        _graphs_compiled() > graphs:
                    self._owner.late_compiles += 1  # a step waited for the compiler
                    if self._owner._watch and self._owner.late_compiles == 1:  # said once
                        self.warn(f"warning: compiled a graph after warm-up (rows "
                                  f"{len(first.rows)}, width {first.width}): the step that "
                                  "needed it waited for the compiler")
                return out
            except Exception as e:  # any compiler failure: the same math, eagerly (its
                if isinstance(e, MemoryError | torch.OutOfMemoryError):
                    raise  # not the compiler's: the caller's to handle (a request's, a round's)
                if second is not None:  # writes went to uncommitted slots only); the pair's
                    self._give_up_pairing(e)  # graph: no more pairs (score_pair makes two
                    raise _PairFailed from e  # compiled calls instead)
                self._give_up(e)
        return self._layers(False, first, second)

    def _give_up_pairing(self, error: Exception) -> None:
        first = (str(error).strip().splitlines() or [""])[0][:160]
        self.warn(f"warning: torch.compile failed for a round and a prompt's chunk in one "
                  f"call ({type(error).__name__}: {first}); scoring them in two calls from "
                  "now on")
        self._pairing = False

    def _logits(self, parts: Sequence[tuple[_Group, torch.Tensor, torch.Tensor, bool]]
                ) -> None:
        """The head over each group's last-layer output x [Bb, Tb, H], into its ``logits``
        by batch row: each row's last fed position only (its ``last_only``), or every
        position up to the logits' width; one projection for all the groups (the head is
        the largest matrix: read once a call)."""
        picked = []
        for group, x, logits, last_only in parts:
            if last_only:
                x = x[torch.arange(len(group.rows), device=self.device),
                      (group.counts - 1).clamp(min=0)][:, None]  # [Bb, 1, H]
            else:
                x = x[:, : logits.shape[1]]  # [Bb, T, H]
            picked.append(x)
        flat = torch.cat([x.reshape(-1, x.shape[-1]) for x in picked])[None]  # [1, N, H]
        scored = project(self._norm(flat), self._head_w, prepacked=self.prepacked)[0]
        scored = scored.float()[..., : self._vocab]  # [N, V]
        for (group, _, logits, _), x in zip(parts, picked, strict=True):
            nb, t = x.shape[:2]
            rows, scored = scored[: nb * t].reshape(nb, t, -1), scored[nb * t:]
            order = group.order
            if order == list(range(order[0], order[0] + nb)):  # in batch order: a slice
                logits[order[0]: order[0] + nb, :t] = rows
            else:
                logits[torch.tensor(order, device=self.device), :t] = rows

    @property
    def one_offs(self) -> int:
        """Work a call did once, not what a call costs: row swaps, cache tensors grown or
        shrunk, graphs compiled after warm-up (a timed round that did any is not typical)."""
        owner = self._owner
        return owner.swaps + owner.grows + owner.late_compiles

    def scored_rows(self, live: Sequence[int]) -> int:
        """The rows a call that feeds the batch rows ``live`` (ascending) scores: their
        number when packed, else the physical range they span."""
        if self._owner.pack_rows and not self._capture:
            return len(live)  # (a set fed once may be scored spread: at most this once)
        phys = self._owner._phys
        at = [phys[b] for b in live] if phys else list(live)
        return max(at) - min(at) + 1

    def _place(self, live: list[int]) -> None:
        """Make the physical rows of the batch rows ``live`` contiguous (packing), or, for a
        call that keeps hidden states, every row where its batch row is."""
        owner = self._owner
        phys = owner._phys
        if self._capture:
            for b in range(len(phys)):
                if phys[b] != b:
                    self._swap(phys[b], b)
            return
        at = sorted(phys[b] for b in live)
        n = len(at)
        fed, recent = tuple(live), self._recent
        recent.append(fed)
        if not owner.pack_rows or at[-1] - at[0] + 1 == n or recent.count(fed) < 2:
            return
        # the window of n physical rows that holds most of them already: fewest swaps
        lo = max(range(len(phys) - n + 1),
                 key=lambda w: (sum(w <= a < w + n for a in at), -abs(w - at[0])))
        holes = [r for r in range(lo, lo + n) if r not in at]
        for src, dst in zip([a for a in at if not lo <= a < lo + n], holes, strict=True):
            self._swap(src, dst)

    def _swap(self, p: int, q: int) -> None:
        """Exchange physical rows p and q: their keys and values up to what either row holds
        (this runner's length or its owner's: a shared-cache view writes past the owner's)
        in every layer, and the batch rows they belong to."""
        owner = self._owner
        phys = owner._phys
        a, b = phys.index(p), phys.index(q)
        held = max(self._lengths[a], self._lengths[b], owner._lengths[a], owner._lengths[b])
        held = min(held, owner._capacity)
        done: list[torch.Tensor] = []
        try:
            for t in (*owner.keys, *owner.values) if held else ():
                t[:held, [q, p]] = t[:held, [p, q]]  # [held, 2, Hkv, d]: the right side copies
                done.append(t)
        except BaseException:  # half swapped would hand rows each other's keys: undo it
            for t in done:
                t[:held, [q, p]] = t[:held, [p, q]]
            raise
        phys[a], phys[b] = q, p
        owner.swaps += 1

    def _layers(self, compiled: bool, first: _Group, second: _Group | None
                ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Every decoder layer over the group (or the two adjacent groups: ``pair_fn``);
        returns the last layer's output for each group and the outputs of the layers asked by
        capture_hidden, in their order."""
        groups = [first] if second is None else [first, second]
        sl = slice(first.rows.start, groups[-1].rows.stop)
        span = max(g.span for g in groups)
        if second is None:
            layer = self._graph if compiled else self._eager
        else:
            layer = self._pair_graph if compiled else self._pair
        keys, values = self._caches()
        xs = [g.x for g in groups]
        fixed: list[torch.Tensor] = []
        for name in ("cos", "sin", "mask", "slots"):
            fixed += [getattr(g, name) for g in groups]
        kept: dict[int, torch.Tensor] = {}
        for i, (w, k, v) in enumerate(zip(self._weights, keys, values, strict=True)):
            k, v = k[:span, sl], v[:span, sl]  # [W, Bb, Hkv, d]: strides free of capacity
            if compiled:  # one graph whatever the rows, width and span (size-1 dims specialise)
                for t in (*xs, *fixed, k, v):
                    for dim in (0, 2, 3) if t.dim() == 4 and t.dtype == torch.bool else (0, 1):
                        if t.shape[dim] > 1:
                            torch._dynamo.mark_dynamic(t, dim)
            out = layer(*xs, *fixed, k, v, *w)
            xs = [out] if second is None else list(out)
            if i in self._capture:
                kept[i] = xs[0]
        return xs, [kept[i] for i in self._capture]

    def _give_up(self, error: Exception) -> None:
        first = (str(error).strip().splitlines() or [""])[0][:160]
        self.warn(f"warning: torch.compile failed ({type(error).__name__}: {first}); running "
                  "the same decoder eagerly from now on")
        self.compiled = False

    def rollback(self, lengths: Sequence[int]) -> None:
        self._require(len(lengths))
        if any(n > have for n, have in zip(lengths, self._lengths, strict=True)):
            raise ValueError("cannot roll forward: a row holds fewer tokens than asked")
        self._lengths = list(lengths)

    def lengths(self) -> list[int]:
        return list(self._lengths)

    def warm_up(self, batch: int = 1, widths: Sequence[int] | None = None,
                watch: bool = False) -> float:
        """Compile (or load from inductor's cache) every graph a batch of ``batch`` rows can
        need; returns seconds. Widths 1 and 2 cover every width [default], and one past
        PROJECT_ROWS where the weights are not prepacked (project switches there); one row,
        two rows and the whole batch cover every row range (part of the batch has strides the
        whole batch lacks, and a one-row view's strides are those of this batch size); and a
        round of one row, two rows or all but one, one token a row or more, with a prompt's
        chunk in the row after it (score_pair), and rounds of two rows, three or the whole
        batch with the longest row in a group of its own (_split). It runs on scratch rows: a
        live KV cache is put back as it was. A batch size already warmed up returns at once; a
        view warms up its owner. With ``watch`` (a server) a graph compiled later is said
        (once): a request waited for it."""
        if self._owner is not self:
            return self._owner.warm_up(batch, widths, watch)
        self._watch |= watch
        began = time.perf_counter()
        if batch in self._warmed or not self.compiled:
            return 0.0
        if widths is None:
            widths = (1, 2) if self.prepacked else (1, 2, PROJECT_ROWS + 1)
        live = self.keys, self.values, self._lengths, self._capacity, self._phys, self._pending
        states = self.hidden, self.hidden_first, self.hidden_counts  # a proposer's, unread
        self._warming, self._capacity, self._pending = True, MIN_CAPACITY, 0  # a small scratch
        # cache, that no reservation grows
        try:
            self.prefill([[0]] * batch)
            for n in sorted({1, min(2, batch), batch}):
                for t in widths:
                    self.score([[0] * t] * n + [[]] * (batch - n))
                    self.rollback([1] * batch)
            pairs = set() if self._capture else {min(1, batch - 1), min(2, batch - 1),
                                                 batch - 1} - {0}  # a round and a chunk in
            for n in sorted(pairs):  # one call (score_pair, never where hidden states are
                # kept): the chunk's row after the round's
                for t in (1, 2):
                    self.score_pair([[0] * t] * n + [[]] * (batch - n), n, [0, 0])
                    self.rollback([1] * batch)
            splits = set() if self._capture or self.split_keys is None or not self._pairing \
                else {1, 2, batch - 1} & set(range(1, batch))  # a round's longest row in a
            # group of its own (_split), beside 1, 2 or all the other rows
            for n in sorted(splits):
                for t in (1, 2):
                    self._score([[0] * t] * (n + 1) + [[]] * (batch - n - 1), False, n)
                    self.rollback([1] * batch)
            self._warmed.add(batch)
        finally:
            self.keys, self.values, self._lengths, self._capacity, self._phys, \
                self._pending = live
            self.hidden, self.hidden_first, self.hidden_counts = states
            self._warming = False
        return time.perf_counter() - began

    def _allocate(self, batch: int, tokens: int) -> None:
        self._capacity = max(self._capacity, pow2(tokens, MIN_CAPACITY))
        shape = (self._capacity, batch, self._hkv, self._d)  # slot-major: see layer_fn
        self.keys = [torch.zeros(shape, dtype=self.dtype, device=self.device)
                     for _ in self._weights]
        self.values = [torch.zeros(shape, dtype=self.dtype, device=self.device)
                       for _ in self._weights]
        self._lengths = [0] * batch
        self._phys = list(range(batch))
        self._recent.clear()  # a new batch: no set has recurred yet, nothing is reserved
        self._pending = 0

    def _grow(self, span: int) -> None:
        """Room for ``span`` slots a row, checked first: CacheFull (nothing changed) when the
        grown cache would not fit in the memory that is free. Layer by layer, so at most one
        layer is held twice while it is copied."""
        capacity = pow2(span, MIN_CAPACITY)
        self._check_room(capacity)

        self._resize(lambda t: _grown(t, capacity))

    def _check_room(self, capacity: int) -> None:
        """CacheFull unless growing every layer to ``capacity`` slots a row fits in the
        memory that is free (FREE_USABLE of it), counting the one layer held twice while it
        is copied."""
        layer = self.keys[0][0].numel() * self.keys[0].element_size()  # one slot, one layer
        more = sum((capacity - t.shape[0]) * layer for t in (*self.keys, *self.values)
                   if t.shape[0] < capacity)
        need = more + capacity * layer  # the grown total, plus the one layer being copied
        free = free_bytes(self.device)
        if free is not None and need > FREE_USABLE * free:
            raise CacheFull(
                f"the KV cache would grow to {capacity} tokens a row ({len(self._lengths)} "
                f"rows: {more / 2**30:.2f} GiB more) but {free / 2**30:.2f} GiB are free")

    def _grow_now(self, span: int) -> None:
        """Room for ``span`` slots a row before this call runs, with what a gradual
        reservation still wants if that fits too; else the reservation is dropped (its prompt
        asks again when its chunk needs the room, and fails alone if it cannot have it)."""
        if self._pending > span:
            try:
                self._grow(self._pending)
                return
            except (MemoryError, RuntimeError):  # CacheFull; torch's out of memory
                self._pending = 0
        self._grow(span)

    def _grow_some(self, calls_left: int) -> None:
        """Grow the next of the cache's tensors to the gradual reservation (its memory
        checked when it was made): at least one a call, and what is short spread over
        ``calls_left``, the calls as wide as this one that fit the current capacity after it
        (one fewer than fit: a paced chunk may widen), so the prompt's chunk calls finish
        the growth before a chunk needs the room, and the streams' one-token calls each do
        one: each copy is a stall for every row, so a step pays for a few, not for all.
        The capacity is the smallest tensor's until all have grown. Growth that fails
        (memory taken since) drops the reservation and not this call: the call needs none
        of it."""
        short = [(cache, i) for cache in (self.keys, self.values)
                 for i, t in enumerate(cache) if t.shape[0] < self._pending]
        short = short[:-(-len(short) // max(1, calls_left))]
        try:
            for cache, i in short:
                cache[i] = _grown(cache[i], self._pending)
                self.grows += 1
        except (MemoryError, RuntimeError):  # torch's out-of-memory is a RuntimeError
            self._pending = 0
        finally:
            self._capacity = min(t.shape[0] for t in (*self.keys, *self.values))

    def _resize(self, resized: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Every layer's keys and values through ``resized``, one at a time; the capacity is
        then the smallest layer's, also when a copy fails part way (out of memory): a
        later call grows again what is short, and no slice reads past a layer's end."""
        try:
            for cache in (self.keys, self.values):
                for i, t in enumerate(cache):
                    cache[i] = resized(t)
                    self.grows += cache[i] is not t
        finally:
            self._capacity = min(t.shape[0] for t in (*self.keys, *self.values))

    def reserve(self, tokens: int, gradual: bool = False) -> None:
        """Room for ``tokens`` slots a row (CacheFull when memory is short): a prompt
        admitted in chunks grows the cache once, to its size, not by doubling chunk after
        chunk, each growth a copy of every layer. Now, or with ``gradual`` checked now and
        grown a few tensors a call from the next call on, spread over the calls until the
        room is needed (a call that needs it at once grows the rest then): the copies are
        spread over the steps that admit the prompt instead of stalling one."""
        span = -(-tokens // SPAN_STEP) * SPAN_STEP
        owner = self._owner
        if owner._capacity >= span:
            return
        if not gradual:
            owner._grow(span)
            return
        capacity = pow2(span, MIN_CAPACITY)
        if capacity > owner._pending:
            owner._check_room(capacity)
            owner._pending = capacity

    def fit_cache(self, reserved: int = 0) -> None:
        """Shrink the KV cache once the rows hold at most a quarter of it (a long request
        has left): its capacity is the power of two above the longest row, for every row, so
        one long request would otherwise keep every row's memory for good. The quarter is
        hysteresis: a cache that would soon grow again is left as it is. ``reserved``: tokens
        a row is about to hold (a prompt being admitted in chunks), kept room for."""
        if self._owner is not self or not self.keys:
            return
        capacity = pow2(max([*self._lengths, reserved]) + SPAN_STEP, MIN_CAPACITY)
        if capacity >= self._pending > self._capacity:
            return  # a gradual growth is under way for a prompt still being admitted
        self._pending = 0  # done, or its prompt left (cancelled): no more copies for it
        if capacity * 4 > max(t.shape[0] for t in (*self.keys, *self.values)):
            return
        self._resize(lambda t: t if t.shape[0] <= capacity else t[:capacity].clone())

    def _require(self, rows: int) -> None:
        if not self._owner.keys:
            raise RuntimeError("call prefill() before score() or rollback()")
        if rows != len(self._lengths):
            raise ValueError(f"got {rows} rows for a batch of {len(self._lengths)}")


def _grown(t: torch.Tensor, capacity: int) -> torch.Tensor:
    """``t`` [slots, …] with zeroed slots up to ``capacity`` (itself when it has them). A
    normal tensor even when grown inside a call (inference mode), as the cache is allocated:
    an inference tensor has another dispatch key set, which every compiled graph guards on,
    so a cache grown mid-call would have every graph compiled again, beside a waiting
    request."""
    if t.shape[0] >= capacity:
        return t
    with torch.inference_mode(False):
        return torch.cat([t, t.new_zeros((capacity - t.shape[0], *t.shape[1:]))])


def free_bytes(device: torch.device) -> int | None:
    """Memory a cache on ``device`` can still take: the host's available memory, or the
    GPU's free memory plus what torch's allocator holds unused; None when unknown."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    if device.type == "cpu":
        import psutil

        return int(psutil.virtual_memory().available)
    return None


class _PairFailed(Exception):
    """The pair graph failed to compile: score_pair scores its groups in two calls."""


@dataclass
class _Group:
    """One group of rows a call scores (CompiledRunner._group): the physical ``rows`` and
    the batch row of each (``order``), ``width`` tokens a row (padded), the slots attended
    (``span``), the longest row's length before the call (``top``) and the layer's inputs."""

    rows: range
    order: list[int]
    width: int
    span: int
    top: int
    x: torch.Tensor  # [Bb, Tb, hidden]
    cos: torch.Tensor  # [Bb, Tb, d]
    sin: torch.Tensor
    mask: torch.Tensor  # [Bb, 1, Tb, W]
    slots: torch.Tensor  # [Bb, Tb]
    counts: torch.Tensor  # [Bb]: tokens fed per row


def _graphs_compiled() -> int:
    """Graphs dynamo has compiled in this process (its own counter)."""
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]
