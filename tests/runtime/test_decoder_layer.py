"""project: the w · hᵀ form equals F.linear at every row count, the padded single row included;
the layer's attention with a key/value head's query heads grouped equals each head alone."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from trtspec.runtime import decoder_layer
from trtspec.runtime.decoder_layer import PROJECT_ROWS, project


@pytest.mark.parametrize("shape", [(1, 1), (1, 2), (2, 3), (3, 1), (1, PROJECT_ROWS + 1)])
def test_project_equals_linear(shape: tuple[int, int]) -> None:
    g = torch.Generator().manual_seed(0)
    h = torch.randn(*shape, 24, generator=g)  # [B, T, in]
    w = torch.randn(40, 24, generator=g)  # [out, in]
    out = project(h, w)
    assert out.shape == (*shape, 40) and out.is_contiguous()
    torch.testing.assert_close(out, F.linear(h, w), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("hq,hkv", [(6, 2), (4, 4)])
@pytest.mark.parametrize("t", [1, 3, PROJECT_ROWS // 2, PROJECT_ROWS // 2 + 1])
def test_grouped_query_heads_attend_as_each_head_alone(monkeypatch: pytest.MonkeyPatch,
                                                       hq: int, hkv: int, t: int) -> None:
    """A key/value head's query heads attending as one head of g·T queries (up to
    PROJECT_ROWS tokens a call on a CPU) gives what SDPA's own grouped-query form gives (each
    query head over its key/value head), on a cache of two rows with different spans (the mask
    keeps each query from later slots); past PROJECT_ROWS, or with as many key/value heads as
    query heads, the query heads attend apart."""
    d, hidden, inter, b, span = 8, 16, 24, 2, 48
    g = torch.Generator().manual_seed(1)
    x = torch.randn(b, t, hidden, generator=g)  # [B, T, hidden]
    cos, sin = torch.randn(b, t, d, generator=g), torch.randn(b, t, d, generator=g)
    slots = torch.tensor([[3], [9]]) + torch.arange(t)  # [B, T]
    mask = (torch.arange(span + t)[None, None, :] <= slots[:, :, None])[:, None]  # [B,1,T,W]
    cache = torch.randn(span + t, b, hkv, d, generator=g)  # [W, R, Hkv, d]
    weights = (torch.ones(hidden), torch.randn((hq + 2 * hkv) * d, hidden, generator=g), None,
               torch.randn(hidden, hq * d, generator=g), torch.ones(hidden),
               torch.randn(2 * inter, hidden, generator=g), torch.randn(hidden, inter, generator=g))
    layer = decoder_layer.layer_fn(hq, hkv, d, 1e-5)
    sdpa, queries = F.scaled_dot_product_attention, []

    def spy(q, *args, **kwargs):
        queries.append(q.shape[1:3])  # [heads, query rows]
        return sdpa(q, *args, **kwargs)

    monkeypatch.setattr(decoder_layer.F, "scaled_dot_product_attention", spy)
    grouped = layer(x, cos, sin, mask, slots, cache.clone(), (-cache).clone(), *weights)
    monkeypatch.setattr(decoder_layer, "GROUP_HEADS", False)  # SDPA's enable_gqa
    alone = layer(x, cos, sin, mask, slots, cache.clone(), (-cache).clone(), *weights)
    torch.testing.assert_close(grouped, alone, rtol=1e-5, atol=1e-4)
    groups = hq // hkv if b * t <= PROJECT_ROWS else 1
    assert queries == [(hq // groups, groups * t), (hq, t)]
