"""One Llama-family decoder layer as a pure function, for CompiledRunner to compile once and run
for every layer (its weights are graph inputs), and the projection it computes every GEMM with.

Why a function of its own: the same math serves the compiled graph and the eager fallback (a
compiler failure must change nothing but speed), and a layer-skip draft of the same model reuses
the one graph.

On a CPU the weights are prepacked once into oneDNN's blocked layout (``prepack``) and every GEMM
runs there (``prepacked_linear``). A one-off timing on this project's 2-core CPU (SmolLM2-135M's
four layer weights × 30 layers, fp32; the runner's own t(T) is in reports/bench-cpu.md): at 8
rows 15 ms against 28 ms for MKL's w · hᵀ and 37 ms for F.linear, at 16 rows 20 against 38 and
46, at 512 rows 376 against 714 (F.linear); one row 9 ms against 12. The rows of a verify round
(a few rows × D + 1) and a prompt's chunk are exactly where MKL's small-GEMM kernels were
slowest. A whole compiled decode step of 3 rows took 18 ms prepacked against 28 ms before.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

PROJECT_ROWS = 128  # up to this many rows, project computes w · hᵀ (weights not prepacked)
# Grouped-query attention with several new tokens a row, on a CPU: the g = Hq/Hkv query heads
# that share a key/value head attend as g·T rows of one head (query head h is key/value head
# h // g's, as enable_gqa pairs them; the mask repeated g times along the rows), so each
# key/value block is read once for all of them, not once per query head. The same sums, in
# another order at most (1e-7 apart here). On the 2-core CPU (SmolLM2: 9 query heads, 3
# key/value heads, d 64; torch's CPU flash kernel, timed alone, median of 25): a verify
# round's attention at 8 rows × 2 tokens over 256 slots took 0.56× the time with
# enable_gqa, 3 rows × 3 tokens 0.46×, a prompt's chunk of 4 tokens at 2,048 slots 0.67×;
# 0.4–0.8× from 2 to 9 tokens at 64–2,048 slots and 1–8 rows, about even at 16–64 tokens and
# 1.04–1.31× at 512–2,048 (a whole prompt's call, whose projections take seconds: packed all
# the same, as a bound on T would be a guard on the graphs' dynamic T and compile each graph
# once more; the repeated mask is g× the bytes, 12 MB of bools at 2,048 × 2,048). One token a
# row (plain decoding) was 0.86–2.3× slower packed, so it keeps enable_gqa. Not measured on a
# GPU, whose kernels take grouped heads as they are: CPU only.
PACK_GQA = True


def packs_attention(hq: int, hkv: int, device_type: str) -> bool:
    """Whether a call of two tokens or more a row attends packed (PACK_GQA): grouped heads
    (``hq`` query heads over ``hkv`` key/value heads, fewer) on a CPU. A build records it
    beside its cost curve, which it changes (a verify round's cost most at long contexts)."""
    return PACK_GQA and hq != hkv and device_type == "cpu"


@torch.library.custom_op("trtspec::prepacked_linear", mutates_args=())
def prepacked_linear(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """h [M, in] · wᵀ for w a weight [out, in] prepacked by ``prepack``: [M, out]. An op of
    its own so that a compiled graph calls oneDNN's prepacked GEMM as it is: inductor's own
    lowering of it takes only weights it froze itself, and here the weights are graph inputs
    (one graph serves every layer). It has no autograd formula: the runner runs under
    ``inference_mode`` only. A call goes through Python dispatch (about 120 a decode step for
    SmolLM2); the step time in the module docstring includes it."""
    return torch.ops.mkldnn._linear_pointwise(h, w, None, "none", [], "")


@prepacked_linear.register_fake
def _(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    torch._check(h.dim() == 2 and w.dim() == 2, lambda: "prepacked_linear: h [M, in], w [out, in]")
    torch._check(h.shape[1] == w.shape[1], lambda: "prepacked_linear: h and w disagree on in")
    torch._check(h.dtype == w.dtype, lambda: "prepacked_linear: h and w disagree on dtype")
    return h.new_empty(h.shape[0], w.shape[0])


@functools.cache
def _onednn_runs(dtype: torch.dtype) -> bool:
    """Whether this torch and CPU run a prepacked GEMM in ``dtype``: tried once on a tiny one,
    as the ops are torch's private ones (a torch that changed them falls back, not fails)."""
    if not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return False  # emulated bf16 GEMMs run slower than the w · hᵀ form
    try:
        w = torch.ones(8, 4, dtype=dtype)
        out = torch.ops.mkldnn._linear_pointwise(
            torch.ones(3, 4, dtype=dtype), torch.ops.mkldnn._reorder_linear_weight(w), None,
            "none", [], "")
        return tuple(out.shape) == (3, 8) and bool((out.float() == 4).all())
    except Exception:  # any failure: not this torch's ops, so not prepacked
        return False


def prepacks(w: torch.Tensor) -> bool:
    """Whether ``prepack`` prepacks this weight: a 2-D CPU tensor in float32, or bfloat16 where
    the CPU runs it natively (float16 and the rest keep the w · hᵀ form, which MKL runs), on a
    torch whose oneDNN ops run (``_onednn_runs``)."""
    return (w.device.type == "cpu" and w.dim() == 2
            and w.dtype in (torch.float32, torch.bfloat16) and _onednn_runs(w.dtype))


def prepack(w: torch.Tensor) -> torch.Tensor:
    """w [out, in] in oneDNN's blocked layout for ``prepacked_linear``: a copy. Only for a
    weight ``prepacks`` accepts (a caller prepacks all of a model's weights or none)."""
    if not prepacks(w):
        raise ValueError(f"prepack: a {w.dtype} weight on {w.device} is not prepacked here")
    return torch.ops.mkldnn._reorder_linear_weight(w.detach())


def project(h: torch.Tensor, w: torch.Tensor, *, prepacked: bool = False) -> torch.Tensor:
    """h [B, T, in] · wᵀ for w [out, in]: [B, T, out]. A ``prepacked`` weight (``prepack``;
    said by the caller: a traced graph sees a plain tensor in its place) runs in oneDNN at any
    row count. Else, for up to PROJECT_ROWS rows on a CPU, computed as w · hᵀ, a tall-skinny
    GEMM: measured with MKL, with the weights streaming from memory, 2–8 rows run 2–4× faster
    than h · wᵀ (F.linear) and one row padded to two 1.5× faster than any GEMV of it. Past
    ~128 rows (a prefill) F.linear is as fast or faster (10–35 % at 512), and on a GPU cuBLAS
    runs skinny GEMMs well as they are."""
    b, t, k = h.shape
    m = b * t
    if prepacked:
        return prepacked_linear(h.reshape(m, k), w).reshape(b, t, w.shape[0])
    if h.is_cuda or m > PROJECT_ROWS:
        return F.linear(h, w)
    rows = h.reshape(m, k)
    if m == 1:
        rows = F.pad(rows, (0, 0, 0, 1))  # [2, in]
    out = torch.mm(w, rows.t())[:, :m].t()  # w·hᵀ [out, M′] → [M, out], made row-major below:
    return out.contiguous().reshape(b, t, w.shape[0])  # a changed input stride would recompile


def gemm_weights(layer: nn.Module) -> list[torch.Tensor]:
    """The layer's GEMM weights as the model has them (what ``layer_weights`` fuses): to ask
    ``prepacks`` of each before prepacking any."""
    a, m = layer.self_attn, layer.mlp
    return [a.q_proj.weight, a.k_proj.weight, a.v_proj.weight, a.o_proj.weight,
            m.gate_proj.weight, m.up_proj.weight, m.down_proj.weight]


def layer_weights(layer: nn.Module, *, prepacked: bool = False
                  ) -> tuple[torch.Tensor | None, ...]:
    """The layer's weights as the compiled layer takes them, [out, in] (see project), with
    q|k|v fused and gate|up fused: one GEMM each; with ``prepacked``, every GEMM's weight
    prepacked (``prepack``). The fused and prepacked ones are copies: the model itself is left
    as it was, for transformers."""
    a = layer.self_attn
    q, k, v, o, gate, up, down = gemm_weights(layer)
    biases = [a.q_proj.bias, a.k_proj.bias, a.v_proj.bias]
    bias = None if biases[0] is None else torch.cat(biases)
    gemms = [torch.cat([q, k, v]), o, torch.cat([gate, up]), down]
    if prepacked:
        gemms = [prepack(w) for w in gemms]
    qkv, o, gate_up, down = gemms
    return (layer.input_layernorm.weight, qkv, bias, o,
            layer.post_attention_layernorm.weight, gate_up, down)


def _norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * w


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def _attend(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor,
            slots: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, first: int,
            hq: int, hkv: int, d: int) -> torch.Tensor:
    """One group of rows' attention: qkv [B, T, (Hq + 2 Hkv) d] (before rotary); cos/sin
    [B, T, d]; mask [B, 1, T, W]; slots [B, T]; the group's rows are the cache's rows
    first … first + B. Writes the group's keys and values, returns [B, T, Hq·d].
    k_cache/v_cache [W′, R, Hkv, d] are slot-major so that growing the capacity never changes
    a view's strides (no recompile); row b's token t goes to slot slots[b, t]."""
    b, t = slots.shape
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    q = q.reshape(b, t, hq, d).transpose(1, 2)  # [B, Hq, T, d]
    k = k.reshape(b, t, hkv, d).transpose(1, 2)  # [B, Hkv, T, d]
    v = v.reshape(b, t, hkv, d).transpose(1, 2)
    q, k = _rope(q, cos[:, None], sin[:, None]), _rope(k, cos[:, None], sin[:, None])
    rows = first + torch.arange(b, device=slots.device)[:, None].expand(b, t)  # [B, T]
    k_cache.index_put_((slots, rows), k.transpose(1, 2))  # k [B, Hkv, T, d]
    v_cache.index_put_((slots, rows), v.transpose(1, 2))
    w = mask.shape[-1]
    keys = k_cache[:w, first:first + b].permute(1, 2, 0, 3)  # [B, Hkv, W, d]
    values = v_cache[:w, first:first + b].permute(1, 2, 0, 3)
    if t > 1 and packs_attention(hq, hkv, q.device.type):
        g = hq // hkv  # query heads a key/value head serves: theirs as rows (PACK_GQA)
        out = F.scaled_dot_product_attention(  # [B, Hkv, g·T, d]
            q.reshape(b, hkv, g * t, d), keys, values,
            attn_mask=mask.repeat(1, 1, g, 1)).reshape(b, hq, t, d)  # [B, Hq, T, d]
    else:
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask,
                                             enable_gqa=hq != hkv)  # [B, Hq, T, d]
    return out.transpose(1, 2).reshape(b, t, hq * d)


def layer_fn(hq: int, hkv: int, d: int, eps: float, *, prepacked: bool = False
             ) -> Callable[..., torch.Tensor]:
    """One decoder layer as a pure function of its inputs (shapes next to tensors);
    ``prepacked``: its GEMM weights are ``prepack``'s."""

    def proj(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return project(h, w, prepacked=prepacked)

    def layer(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor,
              slots: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
              w_in: torch.Tensor, w_qkv: torch.Tensor, b_qkv: torch.Tensor | None,
              w_o: torch.Tensor, w_post: torch.Tensor, w_gate_up: torch.Tensor,
              w_down: torch.Tensor) -> torch.Tensor:
        # x [B, T, hidden]; cos/sin [B, T, d]; mask [B, 1, T, W]
        qkv = proj(_norm(x, w_in, eps), w_qkv)  # [B, T, (Hq + 2 Hkv) d]
        if b_qkv is not None:
            qkv = qkv + b_qkv
        x = x + proj(_attend(qkv, cos, sin, mask, slots, k_cache, v_cache, 0, hq, hkv, d),
                     w_o)
        gate, up = proj(_norm(x, w_post, eps), w_gate_up).chunk(2, dim=-1)  # [B, T, I]
        return x + proj(F.silu(gate) * up, w_down)

    return layer


def pair_fn(hq: int, hkv: int, d: int, eps: float, *, prepacked: bool = False
            ) -> Callable[..., tuple[torch.Tensor, ...]]:
    """One decoder layer over two groups of rows in one call: every projection runs over both
    groups' tokens packed together (one GEMM each: the weights stream from memory once), and
    each group attends over its own span only. Why: a round of short rows and a long prompt's
    chunk scored by one padded call would attend every row over the prompt's span; scored by
    two calls, each pays the call's fixed cost (the weights read again). Group a is the
    cache's rows 0 … A − 1, group b the rows A … A + B − 1 (the runner passes a view that
    holds both, adjacent). ``prepacked``: as for ``layer_fn``."""

    def proj(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return project(h, w, prepacked=prepacked)

    def layer(xa: torch.Tensor, xb: torch.Tensor, cos_a: torch.Tensor, cos_b: torch.Tensor,
              sin_a: torch.Tensor, sin_b: torch.Tensor, mask_a: torch.Tensor,
              mask_b: torch.Tensor, slots_a: torch.Tensor, slots_b: torch.Tensor,
              k_cache: torch.Tensor, v_cache: torch.Tensor,
              w_in: torch.Tensor, w_qkv: torch.Tensor, b_qkv: torch.Tensor | None,
              w_o: torch.Tensor, w_post: torch.Tensor, w_gate_up: torch.Tensor,
              w_down: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        (a, ta, hidden), (b, tb, _) = xa.shape, xb.shape  # xa [A, Ta, H]; xb [B, Tb, H]
        na, nb = a * ta, b * tb
        x = torch.cat([xa.reshape(na, hidden), xb.reshape(nb, hidden)])[None]  # [1, N, H]
        qkv = proj(_norm(x, w_in, eps), w_qkv)[0]  # [N, (Hq + 2 Hkv) d]
        if b_qkv is not None:
            qkv = qkv + b_qkv
        outs = []
        for (rows, t, first, cos, sin, mask, slots), part in zip(
                ((a, ta, 0, cos_a, sin_a, mask_a, slots_a),
                 (b, tb, a, cos_b, sin_b, mask_b, slots_b)),
                qkv.split([na, nb]), strict=True):
            out = _attend(part.reshape(rows, t, -1), cos, sin, mask, slots, k_cache, v_cache,
                          first, hq, hkv, d)  # [rows, t, Hq·d]
            outs.append(out.reshape(rows * t, hq * d))
        x = x + proj(torch.cat(outs)[None], w_o)  # [1, N, H]
        gate, up = proj(_norm(x, w_post, eps), w_gate_up).chunk(2, dim=-1)  # [1, N, I]
        x = (x + proj(F.silu(gate) * up, w_down))[0]  # [N, H]
        return x[:na].reshape(a, ta, hidden), x[na:].reshape(b, tb, hidden)

    return layer
