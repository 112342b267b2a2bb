"""Exact probabilities and goodness of fit for the sampler's tests (shared by the executor's,
the proposers' and the heads' tests)."""

from __future__ import annotations

from collections import Counter

import torch
from conftest import continuation_probs

from trtspec.analysis.gof import chi_square_gof
from trtspec.runtime.toy import MarkovLM
from trtspec.spec.executor import SpecExecutor
from trtspec.spec.sample.probs import SamplingParams, logits_to_probs

ALPHA = 1e-3
PROMPT = [1, 2]


def continuation_pvalue(executor: SpecExecutor, target: MarkovLM, n_tokens: int, trials: int,
                        **sampling) -> float:
    """Chi-square p-value of the executor's n-token continuations against exact probabilities."""
    params = [SamplingParams(max_tokens=n_tokens, seed=i, **sampling) for i in range(trials)]
    outs = executor.generate([PROMPT] * trials, params)
    assert all(len(c.token_ids) == n_tokens for c in outs)
    counts = Counter(tuple(c.token_ids) for c in outs)
    exact = continuation_probs(target, PROMPT, n_tokens, SamplingParams(**sampling))
    seqs = sorted(set(exact) | set(counts))
    return chi_square_gof([counts.get(s, 0) for s in seqs], [exact.get(s, 0.0) for s in seqs])[2]


def exact_two_token_probs(model, prompt: list[int], params: SamplingParams) -> torch.Tensor:
    """[V, V] exact P(t1, t2 | prompt) from full forward passes (no cache)."""
    vocab = model.config.vocab_size
    with torch.inference_mode():
        p1 = logits_to_probs(model(torch.tensor([prompt])).logits[0, -1], params)  # [V]
        both = torch.tensor([[*prompt, t] for t in range(vocab)])  # [V, L+1]
        p2 = logits_to_probs(model(both).logits[:, -1], params)  # [V, V]
    return p1[:, None] * p2
