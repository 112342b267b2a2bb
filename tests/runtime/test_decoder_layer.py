"""project: the w · hᵀ form equals F.linear at every row count, the padded single row included."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from trtspec.runtime.decoder_layer import PROJECT_ROWS, project


@pytest.mark.parametrize("shape", [(1, 1), (1, 2), (2, 3), (3, 1), (1, PROJECT_ROWS + 1)])
def test_project_equals_linear(shape: tuple[int, int]) -> None:
    g = torch.Generator().manual_seed(0)
    h = torch.randn(*shape, 24, generator=g)  # [B, T, in]
    w = torch.randn(40, 24, generator=g)  # [out, in]
    out = project(h, w)
    assert out.shape == (*shape, 40) and out.is_contiguous()
    torch.testing.assert_close(out, F.linear(h, w), rtol=1e-5, atol=1e-5)
