"""project: the w · hᵀ form equals F.linear at every row count, the padded single row included;
a prepacked weight (oneDNN) gives the same product, eagerly and inside a compiled graph; what
is not prepacked is said, not guessed."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from trtspec.runtime.decoder_layer import PROJECT_ROWS, prepack, prepacks, project


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
