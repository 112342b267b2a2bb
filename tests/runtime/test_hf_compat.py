"""HFRunner on every transformers line trtspec supports: 5.x (.venv) and 4.x (TensorRT-LLM 1.2's
pin; `make test-tf4` runs this file on a 4.57 overlay). The test ids name the version it ran on."""

from __future__ import annotations

import os

import pytest
import torch
import transformers
from conftest import tiny_llama

from trtspec.runtime.hf import HFRunner

TF = f"transformers-{transformers.__version__}"
ATTN = pytest.mark.parametrize("attn", ["sdpa", "eager"], ids=lambda a: f"{a}-{TF}")


def full_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(torch.tensor([ids])).logits[0].float()


def test_runs_on_the_expected_transformers() -> None:
    """`make test-tf4` sets TRTSPEC_EXPECT_TRANSFORMERS, so a broken overlay cannot pass as 4.x."""
    expected = os.environ.get("TRTSPEC_EXPECT_TRANSFORMERS")
    if expected:
        assert transformers.__version__ == expected, f"ran on {TF}, expected {expected}"


@ATTN
def test_prefill_ragged_score_and_rollback_match_full_forwards(attn: str) -> None:
    model = tiny_llama(vocab=64, attn=attn)
    prompts = [[1, 2, 3, 4, 5], [6], [7, 8, 9], [1, 2, 3, 4, 5]]  # row 3 copies row 0's prefill
    seqs = [list(p) for p in prompts]
    runner = HFRunner(model)
    first = runner.prefill(prompts)
    for b, p in enumerate(prompts):
        assert torch.allclose(first[b], full_logits(model, p)[-1], atol=1e-5), b

    drafts = [[10, 11, 12], [], [13], [14, 15]]  # ragged, with an idle row
    logits = runner.score(drafts)
    assert runner.lengths() == [8, 1, 4, 7]
    for b, new in enumerate(drafts):
        if new:
            ref = full_logits(model, seqs[b] + new)[-len(new):]
            assert torch.allclose(logits[b, : len(new)], ref, atol=1e-5), b

    accepted = [1, 0, 1, 0]  # the rejected keys stay in the cache: only the mask hides them
    runner.rollback([len(s) + a for s, a in zip(seqs, accepted, strict=True)])
    seqs = [s + new[:a] for s, new, a in zip(seqs, drafts, accepted, strict=True)]
    assert runner.lengths() == [len(s) for s in seqs]

    nxt = [[20, 21], [22, 23, 24], [25], [26]]
    last = runner.score(nxt, last_only=True)[:, 0]
    for b, new in enumerate(nxt):
        seqs[b] += new
        assert torch.allclose(last[b], full_logits(model, seqs[b])[-1], atol=1e-5), b
