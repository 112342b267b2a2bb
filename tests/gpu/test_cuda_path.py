"""The same exactness and identity checks with every tensor on a CUDA device (skipped without)."""

from __future__ import annotations

import pytest
import torch

from trtspec.analysis.gof import chi_square_gof
from trtspec.runtime.hf import HFRunner, layer_skip_view
from trtspec.spec.executor import SpecExecutor
from trtspec.spec.propose.draft_model import DraftModelProposer
from trtspec.spec.propose.ngram import NgramProposer
from trtspec.spec.sample.probs import SamplingParams, logits_to_probs
from trtspec.spec.sample.verify import verify

pytestmark = pytest.mark.gpu


def test_first_token_exact_on_cuda() -> None:
    g = torch.Generator().manual_seed(0)
    v, n = 16, 20_000
    p = logits_to_probs(torch.randn(v, generator=g) * 1.5, SamplingParams()).cuda()
    q = logits_to_probs(torch.randn(v, generator=g) * 1.5, SamplingParams()).cuda()
    ids = torch.multinomial(q.expand(n, v), 1, replacement=True)
    out = verify(p.expand(n, 2, v), ids, q.expand(n, 1, v), torch.ones(n, dtype=torch.long), g)
    assert out.token_ids.device.type == "cuda"
    counts = torch.bincount(out.token_ids[:, 0].cpu(), minlength=v)
    assert chi_square_gof(counts.tolist(), p.cpu().tolist())[2] > 1e-3


def test_greedy_spec_equals_plain_on_cuda(smollm2) -> None:
    model = smollm2.model.to("cuda", torch.float32)
    try:
        prompts = [smollm2.tokenizer(t)["input_ids"] for t in
                   ("the cat sat on the mat. the cat sat on", "def add(a, b):\n    return")]
        params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
        plain = SpecExecutor(HFRunner(model)).generate(prompts, params)
        for proposer in (NgramProposer(), DraftModelProposer(HFRunner(layer_skip_view(model, 20)))):
            spec = SpecExecutor(HFRunner(model), proposer, 4).generate(prompts, params)
            assert [c.token_ids for c in spec] == [c.token_ids for c in plain]
    finally:
        smollm2.model.to("cpu")
