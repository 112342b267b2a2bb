"""logits_to_probs, the shared sampler and per-row uniforms."""

from __future__ import annotations

import pytest
import torch

from trtspec.analysis.gof import chi_square_gof
from trtspec.spec.sample.probs import (
    SAMPLE_BLOCK,
    SamplingParams,
    argmax,
    logits_to_probs,
    make_generator,
    rows_to_probs,
    sample,
    uniforms,
)

LOGITS = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])


def test_plain_softmax_and_temperature() -> None:
    assert torch.allclose(logits_to_probs(LOGITS, SamplingParams()), torch.softmax(LOGITS, -1))
    hot = logits_to_probs(LOGITS, SamplingParams(temperature=0.5))
    assert torch.allclose(hot, torch.softmax(LOGITS / 0.5, -1))
    assert logits_to_probs(LOGITS.half(), SamplingParams()).dtype == torch.float32


def test_greedy_is_one_hot_argmax() -> None:
    probs = logits_to_probs(torch.stack([LOGITS, LOGITS.flip(0)]), SamplingParams(temperature=0))
    assert probs.tolist() == [[1, 0, 0, 0, 0, 0], [0, 0, 0, 0, 0, 1]]


def test_top_k_zeroes_the_rest_exactly() -> None:
    probs = logits_to_probs(LOGITS, SamplingParams(top_k=2))
    expected = torch.softmax(LOGITS[:2], -1)
    assert torch.allclose(probs[:2], expected) and probs[2:].eq(0).all()
    assert torch.equal(logits_to_probs(LOGITS, SamplingParams(top_k=100)),
                       logits_to_probs(LOGITS, SamplingParams()))


def test_top_p_keeps_the_smallest_nucleus() -> None:
    full = torch.softmax(LOGITS, -1)  # ≈ .55 .20 .12 .07 .03 .003
    probs = logits_to_probs(LOGITS, SamplingParams(top_p=0.7))  # .55 < .7 ≤ .75: keep two
    assert torch.allclose(probs[:2], full[:2] / full[:2].sum()) and probs[2:].eq(0).all()
    assert logits_to_probs(LOGITS, SamplingParams(top_p=0.01))[0] == 1.0  # top token always kept
    combo = logits_to_probs(LOGITS, SamplingParams(temperature=2.0, top_k=4, top_p=0.8))
    assert combo[4:].eq(0).all() and combo.sum().item() == pytest.approx(1.0)


def test_params_validate() -> None:
    with pytest.raises(ValueError):
        SamplingParams(top_p=0)
    with pytest.raises(ValueError):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError):
        SamplingParams(bogus=1)


def test_rows_to_probs_groups_by_shape_not_seed() -> None:
    logits = torch.randn(4, 3, 6)
    params = [SamplingParams(seed=1), SamplingParams(temperature=0.5, seed=2),
              SamplingParams(seed=3), SamplingParams(top_k=2)]
    out = rows_to_probs(logits, params)
    for row, p in enumerate(params):
        assert torch.allclose(out[row], logits_to_probs(logits[row], p))


def test_sample_matches_probs_and_never_returns_zero_probability_tokens() -> None:
    probs = torch.tensor([0.0, 0.5, 0.0, 0.3, 0.2, 0.0])
    n = 50_000
    u = torch.rand(n, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    ids = sample(probs.expand(n, -1), u)
    counts = torch.bincount(ids, minlength=6)
    assert counts[[0, 2, 5]].sum() == 0
    assert chi_square_gof(counts.tolist(), probs.tolist())[2] > 1e-3
    edge = sample(probs.expand(4, -1), torch.tensor([0.0, 1 - 2**-53, 0.4999, 0.5],
                                                    dtype=torch.float64))
    assert edge.tolist() == [1, 4, 1, 3]  # u → 1 never runs past the last positive token


def test_two_level_sampler_matches_a_full_cdf_beyond_one_block() -> None:
    """V = 2·SAMPLE_BLOCK + 37: several blocks, a ragged tail, zero-probability stretches."""
    vocab = 2 * SAMPLE_BLOCK + 37
    g = torch.Generator().manual_seed(2)
    probs = torch.rand(vocab, generator=g) ** 8  # a few heavy tokens, a long light tail
    probs[SAMPLE_BLOCK - 5: SAMPLE_BLOCK + 300] = 0.0  # empty across a block boundary
    probs[-20:] = 0.0
    probs[-25] = 0.05  # mass in the ragged tail block
    probs /= probs.sum()
    n = 100_000
    u = torch.rand(n, generator=g, dtype=torch.float64)
    ids = sample(probs.expand(n, -1), u)
    reference = torch.searchsorted(probs.double().cumsum(0), u * probs.double().sum(),
                                   right=True)
    assert float((ids != reference).float().mean()) < 1e-3  # only rounding-boundary draws
    assert bool((probs[ids] > 0).all())
    counts = torch.bincount(ids, minlength=vocab)
    assert chi_square_gof(counts.tolist(), probs.tolist())[2] > 1e-3


@pytest.mark.parametrize("vocab", [7, 1024, 2048, 3000])
def test_blocked_argmax_is_torch_argmax_with_first_occurrence_ties(vocab: int) -> None:
    x = torch.randn(3, 4, vocab, generator=torch.Generator().manual_seed(vocab))
    assert torch.equal(argmax(x), x.argmax(-1))
    ties = torch.zeros(2, vocab)
    ties[0, [vocab - 1, vocab // 2]] = 5.0  # first occurrence wins, across blocks
    ties[1, -1] = 1.0  # maximum in the ragged tail
    assert argmax(ties).tolist() == [vocab // 2, vocab - 1]


def test_power_a_shifted_sampler_fails_the_same_test() -> None:
    probs = torch.tensor([0.1, 0.2, 0.3, 0.4])
    u = torch.rand(20_000, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    shifted = (sample(probs.expand(20_000, -1), u) + 1) % 4
    assert chi_square_gof(torch.bincount(shifted, minlength=4).tolist(), probs.tolist())[2] < 1e-3


def test_uniforms_per_row_generators_are_batch_independent() -> None:
    alone = uniforms([3], [make_generator(7)])
    batch = uniforms([5, 3, 0, 2], [make_generator(1), make_generator(7), make_generator(2),
                                    make_generator(3)])
    assert batch.shape == (4, 5)
    assert torch.equal(batch[1, :3], alone[0]) and batch[1, 3:].eq(0).all()
    assert batch[2].eq(0).all()
    assert uniforms([2, 2], torch.Generator().manual_seed(0)).shape == (2, 2)
    with pytest.raises(ValueError, match="2 generators for a batch of 3"):
        uniforms([1, 1, 1], [make_generator(0), make_generator(1)])
