"""The exactness audit passes the real sampler and flags deliberately broken ones (its power)."""

from __future__ import annotations

import pytest
from broken_verifiers import accept_if_p_ge_q_verify, naive_resample_verify
from conftest import tiny_llama

import trtspec.executor
from trtspec.audit import PROMPTS, audit_method, audit_params, audit_prompt
from trtspec.executor import SpecExecutor
from trtspec.propose import make_proposer, method_named
from trtspec.runtime.hf import HFRunner
from trtspec.sampling import SamplingParams

PARAMS = SamplingParams(temperature=1.0, seed=7)
PROMPT = [3, 5, 7, 3, 5, 7, 3, 5]  # repetitive: n-gram lookup proposes after most x₀


SAMPLES = {"draft_model": 3000, "ngram": 10000}  # ngram proposes only after x₀ ∈ {3, 5, 7}


def tiny_executor(method: str, draft_len: int = 2) -> SpecExecutor:
    target = HFRunner(tiny_llama(vocab=32, seed=0, logit_scale=25.0))
    draft = HFRunner(tiny_llama(vocab=32, seed=1, logit_scale=25.0)) \
        if method == "draft_model" else None
    return SpecExecutor(target, make_proposer(method_named(method), target, draft=draft),
                        draft_len)


@pytest.mark.parametrize("method", ["draft_model", "ngram"])
def test_audit_passes_the_real_sampler(method: str) -> None:
    result = audit_prompt(tiny_executor(method), PROMPT, PARAMS, SAMPLES[method], batch=2000)
    assert result.p_value >= 1e-3, result
    assert result.dof >= 10 and result.speculated > 0.15 and result.rejected > 0.1, result


@pytest.mark.parametrize("method", ["draft_model", "ngram"])
@pytest.mark.parametrize("broken", [naive_resample_verify, accept_if_p_ge_q_verify])
def test_audit_flags_a_broken_verifier(method: str, broken, monkeypatch) -> None:
    monkeypatch.setattr(trtspec.executor, "verify", broken)
    result = audit_prompt(tiny_executor(method), PROMPT, PARAMS, SAMPLES[method], batch=2000)
    assert result.p_value < 1e-6, result


def test_method_verdict_uses_bonferroni_and_flags_weak_audits(monkeypatch) -> None:
    executor = tiny_executor("draft_model")
    good = audit_method("draft_model", executor, [PROMPT], ["p"], PARAMS, 2000, alpha=1e-3,
                        tests=4, batch=2000)
    assert good.passed and not good.weak and good.threshold == pytest.approx(2.5e-4)
    never = audit_method("ngram", tiny_executor("ngram"), [[31]], ["one token"], PARAMS, 300,
                         alpha=1e-3, tests=1, batch=300)  # n-gram lookup rarely matches
    assert never.prompts[0].rejected * 300 < 50 and never.weak
    monkeypatch.setattr(trtspec.executor, "verify", naive_resample_verify)
    bad = audit_method("draft_model", executor, [PROMPT], ["p"], PARAMS, 2000, alpha=1e-3,
                       tests=4, batch=2000)
    assert not bad.passed and bad.p_value < bad.threshold


def test_audit_needs_a_distribution() -> None:
    with pytest.raises(ValueError, match="temperature > 0"):
        audit_prompt(tiny_executor("ngram"), PROMPT, SamplingParams(temperature=0), 10)
    assert audit_params(SamplingParams(temperature=0, top_k=5)).temperature == 1.0
    assert audit_params(SamplingParams(temperature=0.7)).temperature == 0.7


def test_audit_on_smollm2_ngram_passes_real_and_flags_naive(smollm2, monkeypatch) -> None:
    """The actual model: n-gram lookup on the built-in copy prompt."""
    from trtspec.models import encode

    ids = encode(smollm2.tokenizer, PROMPTS[0], chat=False)
    runner = HFRunner(smollm2.model, eos_token_id=smollm2.tokenizer.eos_token_id)
    executor = SpecExecutor(runner, make_proposer(method_named("ngram")), 1)
    real = audit_prompt(executor, ids, PARAMS, samples=600, batch=300)
    assert real.p_value >= 1e-3 and real.rejected > 0.1, real
    monkeypatch.setattr(trtspec.executor, "verify", naive_resample_verify)
    broken = audit_prompt(executor, ids, PARAMS, samples=600, batch=300)
    assert broken.p_value < 1e-6, broken
