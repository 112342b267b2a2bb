"""The executor on transformers models: greedy identity on SmolLM2, sampling exactness on a tiny
random Llama through the real HF code path (with a power check)."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from broken_verifiers import naive_resample_verify
from conftest import tiny_llama
from exactness import exact_two_token_probs

import trtspec.spec.executor
from trtspec.analysis.gof import chi_square_gof
from trtspec.runtime.compiled import CompiledRunner
from trtspec.runtime.hf import HFRunner, layer_skip_view
from trtspec.runtime.models import encode
from trtspec.spec.executor import SpecExecutor
from trtspec.spec.propose.draft_model import DraftModelProposer
from trtspec.spec.propose.layer_skip import LayerSkipProposer
from trtspec.spec.propose.ngram import NgramProposer
from trtspec.spec.sample.probs import SamplingParams

PROMPTS = [
    "Repeat this sentence twice: the cat sat on the mat and looked at the door.",
    "Fix the typo and return the code: def add(a, b):\n    retrun a + b",
    "Summarise in one line: Speculative decoding drafts tokens with a small model and "
    "verifies them with the large model in one pass, keeping the large model's distribution.",
    "List the days of the week.",
    "Write a short poem about the sea.",
    "What is 17 times 3? Explain step by step.",
    "Translate to French: good morning, how are you?",
    "Tell me a fun fact about octopuses.",
]
NEW_TOKENS = 64
NEAR_TIE = 1e-4


def top2_gaps(model, prompt: list[int], output: list[int]) -> list[float]:
    """The reference's top-2 logit gap at each output position (teacher-forced)."""
    with torch.inference_mode():
        logits = model(torch.tensor([prompt + output])).logits[0, len(prompt) - 1: -1].float()
    top2 = logits.topk(2, dim=-1).values
    return (top2[:, 0] - top2[:, 1]).tolist()


def test_greedy_spec_equals_plain_greedy_on_smollm2(smollm2) -> None:
    model, tok = smollm2.model, smollm2.tokenizer
    prompts = [encode(tok, p) for p in PROMPTS]
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    plain = [c.token_ids for c in SpecExecutor(HFRunner(model)).generate(prompts, params)]
    gaps = [top2_gaps(model, p, o) for p, o in zip(prompts, plain, strict=True)]
    total = len(prompts) * NEW_TOKENS
    proposers = {
        "ngram": lambda: NgramProposer(1, 3),
        "layer_skip": lambda: DraftModelProposer(HFRunner(layer_skip_view(model, 20))),
    }
    for name, make in proposers.items():
        for d in (2, 4):
            out = SpecExecutor(HFRunner(model), make(), d).generate(prompts, params)
            excluded = 0
            for ref, got, gap in zip(plain, [c.token_ids for c in out], gaps, strict=True):
                for i, (a, b) in enumerate(zip(ref, got, strict=True)):
                    if gap[i] < NEAR_TIE:
                        excluded += 1
                        if a != b:  # a near-tie flipped: the rest is another (valid) sequence
                            excluded += len(ref) - i - 1
                            break
                    else:
                        assert a == b, f"{name} D={d}: mismatch at position {i}, gap {gap[i]:.2e}"
            print(f"{name} D={d}: {excluded}/{total} positions excluded as near-ties "
                  f"(top-2 logit gap < {NEAR_TIE})")
            assert excluded <= 0.01 * total
            assert sum(c.stats.accepted_draft_tokens for c in out) > 0


def two_token_pvalue(target, draft_layers: int, params: SamplingParams, trials: int,
                     d: int = 3, shared: bool = False) -> float:
    """With ``shared``, the target runs on trtspec's decoder (eager) and the draft is its
    layer-skip view over the target's own KV cache."""
    prompt = [3, 1, 4, 1, 5]
    if shared:
        runner = CompiledRunner(target, compile=False)
        proposer = LayerSkipProposer(runner.view(draft_layers, share_cache=True))
    else:
        runner = HFRunner(target)
        proposer = DraftModelProposer(HFRunner(layer_skip_view(target, draft_layers)))
    executor = SpecExecutor(runner, proposer, d, clip_draft=False)
    reqs = [params.model_copy(update={"seed": i, "max_tokens": 2}) for i in range(trials)]
    outs = executor.generate([prompt] * trials, reqs)
    vocab = target.config.vocab_size
    counts = Counter(c.token_ids[0] * vocab + c.token_ids[1] for c in outs)
    exact = exact_two_token_probs(target, prompt, params).flatten()
    return chi_square_gof([counts.get(i, 0) for i in range(vocab * vocab)], exact.tolist())[2]


SAMPLINGS = [SamplingParams(), SamplingParams(temperature=0.7, top_k=12, top_p=0.9)]


@pytest.mark.parametrize("params", SAMPLINGS, ids=["t1", "t0.7_topk12_topp0.9"])
def test_layer_skip_sampling_is_exact_through_transformers(params: SamplingParams) -> None:
    target = tiny_llama(vocab=32, layers=2, seed=1, logit_scale=6.0)
    assert two_token_pvalue(target, 1, params, trials=30_000) > 1e-3


def test_layer_skip_on_the_target_s_own_cache_is_exact() -> None:
    target = tiny_llama(vocab=32, layers=2, seed=1, logit_scale=6.0)
    assert two_token_pvalue(target, 1, SamplingParams(), trials=30_000, shared=True) > 1e-3


def test_power_broken_verifier_fails_on_the_shared_cache(monkeypatch: pytest.MonkeyPatch
                                                         ) -> None:
    monkeypatch.setattr(trtspec.spec.executor, "verify", naive_resample_verify)
    target = tiny_llama(vocab=32, layers=2, seed=1, logit_scale=6.0)
    assert two_token_pvalue(target, 1, SamplingParams(), trials=30_000, shared=True) < 1e-3


def test_power_broken_verifier_fails_through_transformers(monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    monkeypatch.setattr(trtspec.spec.executor, "verify", naive_resample_verify)
    target = tiny_llama(vocab=32, layers=2, seed=1, logit_scale=6.0)
    assert two_token_pvalue(target, 1, SamplingParams(), trials=30_000) < 1e-3
