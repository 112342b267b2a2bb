"""project: the w · hᵀ form equals F.linear at every row count, the padded single row included;
a prepacked weight (oneDNN) gives the same product, eagerly and inside a compiled graph; what
is not prepacked is said, not guessed. A layer's grouped-query attention packed (PACK_GQA)
gives what torch's enable_gqa gives, cache writes included."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from trtspec.runtime import decoder_layer
from trtspec.runtime.decoder_layer import PROJECT_ROWS, layer_fn, prepack, prepacks, project


@pytest.mark.parametrize("shape", [(1, 1), (1, 2), (2, 3), (3, 1), (1, PROJECT_ROWS + 1)])
@pytest.mark.parametrize("prepacked", [False, True])
def test_project_equals_linear(shape: tuple[int, int], prepacked: bool) -> None:
    g = torch.Generator().manual_seed(0)
    h = torch.randn(*shape, 24, generator=g)  # [B, T, in]
    w = torch.randn(40, 24, generator=g)  # [out, in]
    if prepacked:
        if not prepacks(w):  # fp32 on a CPU whose torch runs oneDNN (CI's does)
            pytest.skip("this torch does not run oneDNN's prepacked GEMM")
        w_packed = prepack(w)
        assert w_packed.is_mkldnn
        out = project(h, w_packed, prepacked=True)
    else:
        out = project(h, w)
    assert out.shape == (*shape, 40) and out.is_contiguous()
    torch.testing.assert_close(out, F.linear(h, w), rtol=1e-5, atol=1e-5)


def test_a_prepacked_weight_runs_in_a_compiled_graph_at_dynamic_rows() -> None:
    """The graph takes the prepacked weight as an input (as the runner's layer graph does) and
    must call oneDNN with it, not a dense GEMM (a traced graph sees a plain tensor in its
    place: the caller says it is prepacked)."""
    g = torch.Generator().manual_seed(1)
    w = torch.randn(48, 16, generator=g)
    if not prepacks(w):
        pytest.skip("this torch does not run oneDNN's prepacked GEMM")

    def f(h: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return F.silu(project(h, weight, prepacked=True))

    graph = torch.compile(f, dynamic=False, fullgraph=True)
    for rows in (2, 5, 9):
        h = torch.randn(1, rows, 16, generator=g)
        torch._dynamo.mark_dynamic(h, 1)
        torch.testing.assert_close(graph(h, prepack(w)), F.silu(F.linear(h, w)), rtol=1e-5,
                                   atol=1e-5)


def test_what_is_not_prepacked_is_refused_not_guessed() -> None:
    half = torch.randn(8, 4, dtype=torch.float16)
    assert not prepacks(half) and not prepacks(torch.randn(8, 4, device="meta"))
    assert not prepacks(torch.randn(8))
    with pytest.raises(ValueError, match="not prepacked here"):
        prepack(half)


@pytest.mark.parametrize("rows,width", [(1, 1), (1, 2), (3, 2), (3, 5), (2, 9)])
def test_packed_grouped_query_attention_equals_enable_gqa(monkeypatch, rows: int, width: int
                                                          ) -> None:
    """Query heads 0-2 share key/value head 0 and 3-5 head 1 (as enable_gqa pairs them), each
    row attends its own causal span over keys already in the cache; packing the heads as rows
    must change no output. One token a row is never packed: its call asks for enable_gqa."""
    hq, hkv, d, inter, n_slots, cache_rows = 6, 2, 8, 32, 24, 4
    hidden = hq * d
    rng = torch.Generator().manual_seed(rows * 10 + width)
    weights = (torch.rand(hidden, generator=rng) + 0.5,
               torch.randn((hq + 2 * hkv) * d, hidden, generator=rng) / hidden ** 0.5, None,
               torch.randn(hidden, hq * d, generator=rng) / hidden ** 0.5,
               torch.rand(hidden, generator=rng) + 0.5,
               torch.randn(2 * inter, hidden, generator=rng) / hidden ** 0.5,
               torch.randn(hidden, inter, generator=rng) / inter ** 0.5)
    start = torch.tensor([5, 11, 2][:rows])  # [B]: tokens each row already holds
    slots = start[:, None] + torch.arange(width)  # [B, T]
    span = int(slots.max()) + 1
    mask = (torch.arange(span)[None, None, :] <= slots[:, :, None])[:, None]  # [B, 1, T, W]
    angle = slots[..., None].float() / 7 + torch.arange(d) / d  # [B, T, d]
    x = torch.randn(rows, width, hidden, generator=rng)  # [B, T, hidden]
    keys = torch.randn(n_slots, cache_rows, hkv, d, generator=rng)  # [W′, R, Hkv, d]
    values = torch.randn(n_slots, cache_rows, hkv, d, generator=rng)
    sdpa, asked = F.scaled_dot_product_attention, []

    def spy(*args, **kwargs):
        asked.append(kwargs.get("enable_gqa", False))
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(decoder_layer.F, "scaled_dot_product_attention", spy)
    outs = {}
    for packed in (False, True):
        monkeypatch.setattr(decoder_layer, "PACK_GQA", packed)
        k, v = keys.clone(), values.clone()
        out = layer_fn(hq, hkv, d, 1e-5)(x, angle.cos(), angle.sin(), mask, slots, k, v,
                                          *weights)
        outs[packed] = out, k, v
    (plain, k0, v0), (packed, k1, v1) = outs[False], outs[True]
    torch.testing.assert_close(packed, plain, rtol=1e-5, atol=1e-5)
    assert torch.equal(k0, k1) and torch.equal(v0, v1)
    assert not torch.equal(k0, keys)  # the new tokens' keys were written
    assert asked == [True, width == 1]  # unpacked, then packed unless one token a row


def test_packs_attention_is_the_branch_a_wide_call_takes(monkeypatch) -> None:
    """packs_attention (what a build records) is _attend's branch for 2+ tokens a row: grouped
    heads on a CPU with PACK_GQA on; heads not grouped, another device or PACK_GQA off: not."""
    assert decoder_layer.packs_attention(6, 2, "cpu")
    assert not decoder_layer.packs_attention(4, 4, "cpu")  # nothing to pack
    assert not decoder_layer.packs_attention(6, 2, "cuda")
    monkeypatch.setattr(decoder_layer, "PACK_GQA", False)
    assert not decoder_layer.packs_attention(6, 2, "cpu")
