"""Toy Markov models: exact probabilities, divergence knob, runner cache semantics."""

from __future__ import annotations

import itertools

import pytest
import torch
from conftest import continuation_probs

from trtspec.runtime.toy import MarkovLM, ToyRunner
from trtspec.spec.sample.probs import SamplingParams, logits_to_probs


def test_continuation_probs_are_a_distribution() -> None:
    model = MarkovLM(vocab_size=5, order=2, seed=0)
    for params in (SamplingParams(), SamplingParams(temperature=0.5, top_k=3, top_p=0.9)):
        probs = continuation_probs(model, [1, 2], 3, params)
        assert sum(probs.values()) == pytest.approx(1.0, abs=1e-5)
    greedy = continuation_probs(model, [1, 2], 3, SamplingParams(temperature=0))
    assert list(greedy.values()) == [1.0]


def test_divergence_knob_moves_acceptance_monotonically() -> None:
    target = MarkovLM(vocab_size=16, order=1, seed=1)
    p = logits_to_probs(target.table, SamplingParams())
    rates = []
    for d in (0.0, 0.25, 0.5, 0.75, 1.0):
        q = logits_to_probs(target.diverged(d, seed=2).table, SamplingParams())
        rates.append(float(torch.minimum(p, q).sum(-1).mean()))  # expected acceptance
    assert rates[0] == pytest.approx(1.0)
    assert all(a > b for a, b in itertools.pairwise(rates))
    with pytest.raises(ValueError):
        target.diverged(1.5)


def test_runner_scores_like_the_model_and_rolls_back() -> None:
    model = MarkovLM(vocab_size=7, order=2, seed=3)
    runner = ToyRunner(model)
    first = runner.prefill([[1, 2, 3], [4]])
    assert torch.equal(first[0], model.next_logits([1, 2, 3]))
    assert torch.equal(first[1], model.next_logits([4]))
    logits = runner.score([[5, 6], []])
    assert logits.shape == (2, 2, 7)
    assert torch.equal(logits[0, 1], model.next_logits([1, 2, 3, 5, 6]))
    assert runner.lengths() == [5, 1]
    runner.rollback([4, 1])
    again = runner.score([[0], [2]], last_only=True)
    assert torch.equal(again[0, 0], model.next_logits([1, 2, 3, 5, 0]))
    assert torch.equal(again[1, 0], model.next_logits([4, 2]))
    with pytest.raises(ValueError, match="cannot roll forward"):
        runner.rollback([99, 1])
    with pytest.raises(ValueError, match="score got 1 rows for a batch of 2"):
        runner.score([[1]])
