"""The EAGLE-3 draft network: one decoder layer over the target's own hidden states, in the public
Llama layout (SafeAILab's EAGLE3-LLaMA3.1 checkpoints, SpecForge's ``LlamaForCausalLMEagle3``,
which TensorRT-LLM's Eagle3 decoding and vLLM load), with reading, writing and an init from the
target. The proposer that drives it is :mod:`trtspec.spec.propose.heads.eagle`.

Terms (H: hidden size, V: the target's vocabulary, Vd: the draft's, Vd ≤ V):

* aux states    outputs of three target decoder layers (low, middle, high; the residual stream
                before the final norm) at one position, concatenated: [.., 3H]. Which layers:
                ``eagle_config.eagle_aux_hidden_state_layer_ids`` [default: 1, L/2 − 1, L − 4,
                what SpecForge and TensorRT-LLM capture]
* fuse          ``fc``: aux [.., 3H] → h [.., H], the draft's view of one target position
* pair t        (h_t, e_t): a hidden state and the embedding of the token after position t,
                run at RoPE position t. The first draft step's h is the fused target state;
                later steps feed the draft's own output g (not fused)
* midlayer      x = [input_layernorm(e), hidden_norm(h)] [.., 2H]; a = h + o(attn(x)) with RoPE
                and q/k/v over 2H inputs; g = a + mlp(post_attention_layernorm(a)) (pre-norm).
                RoPE is computed in float32 whatever the weights' dtype (as the target's)
* logits        lm_head(norm(g)) over the draft vocabulary [.., Vd]; draft id i is target id
                i + d2t[i]; :meth:`Eagle3Draft.target_logits` puts them at their target ids,
                −inf elsewhere, so q is exactly 0 on ids the draft cannot propose
* embeddings    the target's input embeddings unless the checkpoint has ``embed_tokens.weight``

Weights (``model.safetensors`` or ``pytorch_model.bin``): ``fc.weight`` [H, 3H];
``midlayer.{input_layernorm,hidden_norm,post_attention_layernorm}.weight`` [H];
``midlayer.self_attn.{q,k,v}_proj.weight`` [heads·d, 2H], ``o_proj`` [H, heads·d];
``midlayer.mlp.{gate,up}_proj.weight`` [I, H], ``down_proj`` [H, I]; ``norm.weight`` [H];
``lm_head.weight`` [Vd, H]; ``d2t`` int [Vd]; ``t2d`` bool [V]; optional ``embed_tokens.weight``
[V, H]. ``layers.0.`` for ``midlayer.`` and a leading ``model.`` are accepted (TensorRT-LLM
remaps them the same way). config.json is read and checked by :mod:`trtspec.spec.propose.
eagle_config`.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from trtspec.spec.propose.heads import HeadsError, llama_decoder, read_config, read_weights, take
from trtspec.spec.propose.heads.eagle_config import Eagle3Config, default_aux_layers

WEIGHT_FILES = ["model.safetensors", "pytorch_model.bin"]
MIDLAYER = ("midlayer.", "layers.0.", "model.midlayer.", "model.layers.0.")  # accepted prefixes
TOP = ("", "model.")

__all__ = ["DraftCache", "Eagle3Config", "Eagle3Draft", "default_aux_layers", "load_eagle3",
           "rope", "save_eagle3"]


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(size)), eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) \
            * self.weight


class DraftCache:
    """The draft's own KV cache: row b's pair t at slot t (= its RoPE position) of one
    [B, Hkv, capacity, d] buffer each for keys and values; ``lengths[b]`` pairs are valid.
    Rollback only lowers a length. Padded or rejected writes are harmless (as in RowCache): a
    query at slot s sees slots ≤ s, all written in order before it, and a later real write
    overwrites the rest."""

    def __init__(self, batch: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device, capacity: int = 64) -> None:
        shape = (batch, kv_heads, capacity, head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        self.lengths = [0] * batch

    def write(self, rows: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """k/v [b, Hkv, T, d] to rows [b] at slots [b, T]; returns the rows' keys and values
        [b, Hkv, W, d] up to the highest slot written (W = that slot + 1)."""
        width = int(slots.max()) + 1
        if width > self.keys.shape[2]:
            grow = max(width, 2 * self.keys.shape[2]) - self.keys.shape[2]
            self.keys = F.pad(self.keys, (0, 0, 0, grow))
            self.values = F.pad(self.values, (0, 0, 0, grow))
        r = rows[:, None].expand_as(slots)  # [b, T]
        self.keys[r, :, slots] = k.transpose(1, 2)  # [b, T, Hkv, d]
        self.values[r, :, slots] = v.transpose(1, 2)
        return self.keys[rows, :, :width], self.values[rows, :, :width]


class Attention(nn.Module):
    def __init__(self, c: Eagle3Config) -> None:
        super().__init__()
        self.hq, self.hkv, self.d = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.q_proj = nn.Linear(2 * c.hidden_size, self.hq * self.d, bias=False)
        self.k_proj = nn.Linear(2 * c.hidden_size, self.hkv * self.d, bias=False)
        self.v_proj = nn.Linear(2 * c.hidden_size, self.hkv * self.d, bias=False)
        self.o_proj = nn.Linear(self.hq * self.d, c.hidden_size, bias=False)


class MLP(nn.Module):
    def __init__(self, c: Eagle3Config) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Midlayer(nn.Module):
    def __init__(self, c: Eagle3Config) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn, self.mlp = Attention(c), MLP(c)


class Eagle3Draft(nn.Module):
    """The EAGLE-3 head; module names are the checkpoint's tensor names (see the module
    docstring), so ``state_dict()`` is the public layout."""

    def __init__(self, config: Eagle3Config, own_embeddings: bool = False) -> None:
        super().__init__()
        c = self.config = config
        self.fc = nn.Linear(3 * c.hidden_size, c.hidden_size, bias=False)
        self.midlayer = Midlayer(c)
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = nn.Linear(c.hidden_size, c.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(c.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.ones(c.vocab_size, dtype=torch.bool)
                             if c.draft_vocab_size == c.vocab_size else
                             torch.zeros(c.vocab_size, dtype=torch.bool))
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size) if own_embeddings else None
        self.rotary_emb = Rotary(c)  # float32 buffers, non-persistent: not saved

    @property
    def aux_layers(self) -> list[int]:
        return list(self.config.aux_layers)

    @property
    def target_ids(self) -> torch.Tensor:
        """[Vd] the target id of each draft id."""
        return torch.arange(len(self.d2t), device=self.d2t.device) + self.d2t

    def fuse(self, aux: torch.Tensor) -> torch.Tensor:
        """aux states [.., 3H] → h [.., H]."""
        return self.fc(aux)

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                cache: DraftCache | None = None, rows: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Pairs (hidden [B, T, H], embeds [B, T, H]) at RoPE ``positions`` [B, T] →
        (g [B, T, H], draft logits [B, T, Vd]). Without ``cache``: a whole sequence per row
        (training), causal over T. With one: each pair is written at slot = position of cache
        row ``rows[b]`` and attends to that row's slots ≤ its position."""
        g = self.layer(embeds, hidden, positions, cache, rows)
        return g, self.draft_logits(g)

    def draft_logits(self, g: torch.Tensor) -> torch.Tensor:
        """g [.., H] → draft logits [.., Vd]."""
        return self.lm_head(self.norm(g))

    def layer(self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
              cache: DraftCache | None = None, rows: torch.Tensor | None = None
              ) -> torch.Tensor:
        """:meth:`forward` without the logits: g [B, T, H] (a prompt's pairs need no logits)."""
        m, a = self.midlayer, self.midlayer.self_attn
        b, t, _ = hidden.shape
        x = torch.cat([m.input_layernorm(embeds), m.hidden_norm(hidden)], dim=-1)  # [B, T, 2H]
        q = a.q_proj(x).view(b, t, a.hq, a.d).transpose(1, 2)  # [B, Hq, T, d]
        k = a.k_proj(x).view(b, t, a.hkv, a.d).transpose(1, 2)  # [B, Hkv, T, d]
        v = a.v_proj(x).view(b, t, a.hkv, a.d).transpose(1, 2)
        cos, sin = self.rotary_emb(x, positions)  # [B, T, d]
        q, k = rope(q, cos[:, None], sin[:, None]), rope(k, cos[:, None], sin[:, None])
        if cache is None:
            index = torch.arange(t, device=x.device)
            keys, values, mask = k, v, (index[None, :] <= index[:, None])[None, None]
        else:
            assert rows is not None
            keys, values = cache.write(rows, positions, k, v)  # [B, Hkv, W, d]
            slots = torch.arange(keys.shape[2], device=x.device)
            mask = (slots[None, None, :] <= positions[:, :, None])[:, None]  # [B, 1, T, W]
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask,
                                             enable_gqa=a.hq != a.hkv)  # [B, Hq, T, d]
        h = hidden + a.o_proj(out.transpose(1, 2).reshape(b, t, a.hq * a.d))
        return h + m.mlp(m.post_attention_layernorm(h))

    def target_logits(self, draft_logits: torch.Tensor) -> torch.Tensor:
        """[.., Vd] → [.., V]: each at its target id, −inf on ids the draft lacks."""
        out = draft_logits.new_full((*draft_logits.shape[:-1], self.config.vocab_size),
                                    float("-inf"))
        return out.index_copy_(-1, self.target_ids, draft_logits)

    def new_cache(self, batch: int) -> DraftCache:
        p = self.lm_head.weight
        return DraftCache(batch, self.config.num_key_value_heads, self.config.head_dim,
                          p.dtype, p.device)

    @classmethod
    def from_target(cls, model: nn.Module, aux_layers: list[int] | None = None,
                    draft_vocab: torch.Tensor | None = None) -> Eagle3Draft:
        """A head to train (``trtspec distill``) that starts as the target's last layer, final
        norm and LM head over the states of ``aux_layers`` [default: default_aux_layers]:
        ``fc`` = [0, 0, I] passes the high state through; q/k/v's hidden half (their inputs
        H … 2H) is the last layer's q/k/v and their embedding half is zero, so the head starts
        as that layer applied to the high state, a known function, and the token's influence
        is learned (a zero weight still gets a gradient: δ·eᵀ); ``hidden_norm`` is the last
        layer's input norm, ``input_layernorm`` ones. ``draft_vocab``: the target ids kept,
        sorted [default: all]; lm_head takes those rows. The target's embeddings are used."""
        from trtspec.runtime.hf import layer_indices

        decoder = llama_decoder(model, "eagle3")
        tc, layers = model.config, decoder.layers
        head = model.get_output_embeddings().weight  # [V, H]
        vocab, hidden = head.shape
        keep = torch.arange(vocab) if draft_vocab is None else draft_vocab.long().cpu()
        if len(keep) == 0 or keep.min() < 0 or keep.max() >= vocab or \
                bool((keep[1:] <= keep[:-1]).any()):
            raise ValueError(f"draft_vocab must be sorted distinct ids in 0 … {vocab - 1}")
        rope = dict(getattr(tc, "rope_parameters", None) or getattr(tc, "rope_scaling", None)
                    or {})
        theta = rope.pop("rope_theta", None) or getattr(tc, "rope_theta", None) or 10000.0
        heads = tc.num_attention_heads
        config = Eagle3Config(
            hidden, tc.intermediate_size, heads, getattr(tc, "num_key_value_heads", heads),
            getattr(tc, "head_dim", None) or hidden // heads, vocab, len(keep),
            layer_indices(len(layers), aux_layers or default_aux_layers(len(layers))),
            float(tc.rms_norm_eps), float(theta),
            rope if rope.get("rope_type", "default") != "default" else None,
            int(getattr(tc, "max_position_embeddings", 2048)))
        draft = cls(config).to(device=head.device, dtype=head.dtype)
        last, m = layers[-1], draft.midlayer
        with torch.no_grad():
            draft.fc.weight.zero_()[:, 2 * hidden:] = torch.eye(hidden)
            for name in ("q_proj", "k_proj", "v_proj"):
                w = getattr(m.self_attn, name).weight.zero_()
                w[:, hidden:] = getattr(last.self_attn, name).weight
            m.self_attn.o_proj.weight.copy_(last.self_attn.o_proj.weight)
            for name in ("gate_proj", "up_proj", "down_proj"):
                getattr(m.mlp, name).weight.copy_(getattr(last.mlp, name).weight)
            m.hidden_norm.weight.copy_(last.input_layernorm.weight)
            m.post_attention_layernorm.weight.copy_(last.post_attention_layernorm.weight)
            draft.norm.weight.copy_(decoder.norm.weight)
            draft.lm_head.weight.copy_(head[keep.to(head.device)])
            draft.set_vocab(keep)
        return draft

    def set_vocab(self, keep: torch.Tensor) -> None:
        """Draft id i ↦ target id keep[i] (sorted, distinct): d2t and t2d."""
        keep = keep.to(self.d2t.device).long()
        self.d2t.copy_(keep - torch.arange(len(keep), device=keep.device))
        self.t2d.zero_()[keep] = True


class Rotary(nn.Module):
    """The target's rotary embedding (transformers' LlamaRotaryEmbedding, every rope_scaling it
    knows), its buffers kept in float32 whatever dtype the head is cast to: a bf16 inv_freq
    is off by up to 0.3 in cos at position 2000. ``rotary_emb(x, positions)`` → (cos, sin)
    [B, T, d], computed in float32 and cast to x's dtype (as the target's own)."""

    def __init__(self, c: Eagle3Config) -> None:
        super().__init__()
        from transformers import LlamaConfig
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        scaling = dict(c.rope_scaling) if c.rope_scaling else None  # LlamaConfig edits it
        config = LlamaConfig(hidden_size=c.hidden_size, num_attention_heads=c.num_attention_heads,
                             head_dim=c.head_dim, rope_theta=c.rope_theta, rope_scaling=scaling,
                             max_position_embeddings=c.max_position_embeddings)
        self.inner = LlamaRotaryEmbedding(config=config)
        for module in self.modules():
            for key, buf in module._buffers.items():
                if buf is not None and buf.is_floating_point():
                    module._buffers[key] = buf.float()

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True
               ) -> Rotary:
        """``.to()``, ``.half()``, ``.cuda()`` …: move the buffers where ``fn`` puts them,
        never cast them."""
        for module in self.modules():
            for key, buf in module._buffers.items():
                if buf is not None:
                    module._buffers[key] = buf.to(fn(buf).device)
        return self

    def forward(self, x: torch.Tensor, positions: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.inner(x, positions)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding, as the target's attention applies it (half-split rotation)."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def load_eagle3(folder: str | Path, target_model: nn.Module) -> Eagle3Draft:
    """An EAGLE-3 head folder (config.json + model.safetensors or pytorch_model.bin) checked
    against ``target_model`` and cast to its dtype and device; HeadsError (one line) otherwise."""
    folder = Path(folder).expanduser()
    raw = read_config(folder)
    tensors, where = read_weights(folder, WEIGHT_FILES)
    tc = target_model.config
    head = target_model.get_output_embeddings().weight
    config = Eagle3Config.from_json(raw, folder / "config.json",
                                    len(llama_decoder(target_model, "eagle3").layers))
    if config.hidden_size != tc.hidden_size:
        raise HeadsError(f"{folder}: head hidden_size {config.hidden_size} ≠ the target's "
                         f"{tc.hidden_size}")
    if config.vocab_size != head.shape[0] or config.draft_vocab_size > config.vocab_size:
        raise HeadsError(f"{folder}: head vocab_size {config.vocab_size} (draft "
                         f"{config.draft_vocab_size}) does not fit the target's {head.shape[0]}")
    own = any(p + "embed_tokens.weight" in tensors for p in TOP)
    try:
        draft = Eagle3Draft(config, own_embeddings=own)
    except (KeyError, TypeError, ValueError) as e:  # what transformers' RoPE setup rejects
        raise HeadsError(f"{folder / 'config.json'}: rope_scaling {config.rope_scaling!r} is not "
                         f"usable ({type(e).__name__}: {(str(e).splitlines() or [''])[0][:120]})"
                         ) from None
    state = {}
    for name, t in draft.state_dict().items():
        if name in ("d2t", "t2d") and not any(p + name in tensors for p in TOP) and \
                config.draft_vocab_size == config.vocab_size:
            state[name] = t  # the identity map: TensorRT-LLM needs none either
        elif name.startswith("midlayer."):
            state[name] = take(tensors, name[len("midlayer."):], tuple(t.shape), where,
                               prefixes=MIDLAYER)
        else:
            state[name] = take(tensors, name, tuple(t.shape), where, prefixes=TOP)
    ids = state["d2t"].long() + torch.arange(config.draft_vocab_size)
    if ids.min() < 0 or ids.max() >= config.vocab_size or len(ids.unique()) != len(ids):
        raise HeadsError(f"{where}: d2t maps draft ids outside the target vocabulary or two to "
                         "one id")
    t2d = state["t2d"].bool()
    if int(t2d.sum()) != len(ids) or not bool(t2d[ids].all()):
        raise HeadsError(f"{where}: t2d does not mark exactly the target ids d2t maps to")
    state["d2t"], state["t2d"] = state["d2t"].long(), t2d
    draft.load_state_dict(state)
    return draft.to(device=head.device, dtype=head.dtype).eval()


def save_eagle3(draft: Eagle3Draft, folder: str | Path) -> None:
    """Write ``draft`` as config.json + model.safetensors (the layout load_eagle3 reads)."""
    from safetensors.torch import save_file

    folder = Path(folder).expanduser()
    folder.mkdir(parents=True, exist_ok=True)
    config = draft.config.to_json()
    config["torch_dtype"] = str(draft.lm_head.weight.dtype).removeprefix("torch.")
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file({k: v.detach().contiguous().cpu() for k, v in draft.state_dict().items()},
              str(folder / "model.safetensors"), metadata={"format": "pt"})
