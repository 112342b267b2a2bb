"""HFRunner: the model's own logits through a per-row cache, ragged batches, exact rollback."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_llama

from trtspec.runtime.hf import HFRunner, layer_skip_view


def full_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(torch.tensor([ids])).logits[0].float()


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_ragged_batch_scores_like_separate_full_forwards(attn: str) -> None:
    model = tiny_llama(vocab=64, attn=attn)
    prompts = [[1, 2, 3, 4, 5], [6], [7, 8, 9]]
    runner = HFRunner(model)
    first = runner.prefill(prompts)
    for b, p in enumerate(prompts):
        assert torch.allclose(first[b], full_logits(model, p)[-1], atol=1e-5)
    new = [[10, 11, 12], [], [13]]
    logits = runner.score(new)
    assert logits.shape == (3, 3, 64) and runner.lengths() == [8, 1, 4]
    assert torch.allclose(logits[0], full_logits(model, prompts[0] + new[0])[-3:], atol=1e-5)
    assert torch.allclose(logits[2, 0], full_logits(model, prompts[2] + new[2])[-1], atol=1e-5)


def test_rollback_then_score_equals_fresh_prefill_on_smollm2(smollm2) -> None:
    model, tok = smollm2.model, smollm2.tokenizer
    prompt = tok("Speculative decoding verifies several draft tokens in one pass")["input_ids"]
    runner = HFRunner(model)
    runner.prefill([prompt, prompt[:5]])
    runner.score([[11, 12, 13, 14, 15], [16, 17]])  # a verification round
    runner.rollback([len(prompt) + 2, 5 + 1])  # reject after 1 and 0 accepted drafts
    after = runner.score([[99], [98, 97]], last_only=True)[:, 0]
    fresh = HFRunner(model)
    ref = fresh.prefill([prompt + [11, 12, 99], prompt[:5] + [16, 98, 97]])
    diff = (after - ref).abs().max().item()
    assert diff <= 1e-4, diff
    with pytest.raises(ValueError, match="cannot roll forward"):
        runner.rollback([10_000, 1])


def test_identical_prompts_are_prefilled_once_and_then_diverge() -> None:
    model = tiny_llama(vocab=64)
    prompts = [[1, 2, 3], [4, 5], [1, 2, 3], [1, 2, 3]]
    runner = HFRunner(model)
    first = runner.prefill(prompts)
    assert runner.cache.keys[0].shape[0] == 4 and runner.lengths() == [3, 2, 3, 3]
    for b, p in enumerate(prompts):
        assert torch.allclose(first[b], full_logits(model, p)[-1], atol=1e-5)
    logits = runner.score([[7], [8], [9, 10], [11]])  # the copies are separate rows now
    for b, new in enumerate([[7], [8], [9, 10], [11]]):
        ref = full_logits(model, prompts[b] + new)[-len(new):]
        assert torch.allclose(logits[b, : len(new)], ref, atol=1e-5)


def test_cache_grows_past_its_first_capacity() -> None:
    model = tiny_llama(vocab=64)
    runner = HFRunner(model)
    runner.prefill([[1, 2]])
    capacity = runner.cache.capacity
    seq = [1, 2]
    for i in range(capacity):
        runner.score([[i % 64]])
        seq.append(i % 64)
    assert runner.cache.capacity > capacity
    last = runner.score([[5]], last_only=True)[0, 0]
    assert torch.allclose(last, full_logits(model, [*seq, 5])[-1], atol=1e-4)


def test_layer_skip_view_shares_weights_and_keeps_the_original_intact() -> None:
    model = tiny_llama(vocab=64, layers=4)
    view = layer_skip_view(model, 2)
    assert len(view.get_decoder().layers) == 2 and len(model.get_decoder().layers) == 4
    assert model.config.num_hidden_layers == 4 and view.config.num_hidden_layers == 2
    assert view.lm_head.weight.data_ptr() == model.lm_head.weight.data_ptr()
    assert view.get_decoder().layers[1] is model.get_decoder().layers[1]
    draft, target = HFRunner(view), HFRunner(model)
    d, t = draft.prefill([[1, 2, 3]]), target.prefill([[1, 2, 3]])
    assert not torch.allclose(d, t)
    with torch.inference_mode():  # the view is a real 2-layer model
        ref = view(torch.tensor([[1, 2, 3]])).logits[0, -1]
    assert torch.allclose(d[0], ref, atol=1e-5)
    with pytest.raises(ValueError, match="1 ≤ draft layers < 4"):
        layer_skip_view(model, 4)


def test_errors_before_prefill_and_on_batch_mismatch() -> None:
    runner = HFRunner(tiny_llama())
    with pytest.raises(RuntimeError, match="prefill"):
        runner.score([[1]])
    runner.prefill([[1], [2]])
    with pytest.raises(ValueError, match="1 rows for a batch of 2"):
        runner.score([[1]])
