"""LayerSkipProposer: the target's first layers drafting over the target's own KV cache."""

from __future__ import annotations

from conftest import tiny_llama

from trtspec.runtime.compiled import CompiledRunner
from trtspec.serve.scheduler import Scheduler
from trtspec.spec.executor import SpecExecutor
from trtspec.spec.propose.layer_skip import LayerSkipProposer
from trtspec.spec.sample.probs import SamplingParams


def test_requests_that_end_before_any_draft_round_leave_the_proposer_working() -> None:
    """start / admit / release hold before the first proposal: requests of 1 and 2 tokens
    (admitted, finished, released before anything was drafted), then longer ones, on the
    scheduler; greedy output equals plain decoding."""
    model = tiny_llama(vocab=48, layers=3, seed=5, logit_scale=20.0)
    target = CompiledRunner(model, compile=False)
    proposer = LayerSkipProposer(target.layer_skip(2))
    assert target.layer_skip(2).shares_cache and not target.shares_cache
    scheduler = Scheduler(SpecExecutor(target, proposer, 3), slots=2)
    params = [SamplingParams(temperature=0, max_tokens=n) for n in (1, 2, 1, 9, 12)]
    prompts = [[1, 2, 3], [4, 5], [6], [7, 8, 9, 7, 8], [3, 3, 3]]
    tickets = [scheduler.submit(p, s) for p, s in zip(prompts, params, strict=True)]
    scheduler.run_until_idle()
    plain = SpecExecutor(CompiledRunner(model, compile=False))
    for ticket, prompt, p in zip(tickets, prompts, params, strict=True):
        assert ticket.token_ids == plain.generate([prompt], p)[0].token_ids
    assert sum(t.stats.proposed_tokens for t in tickets) > 0
    own = proposer.draft_runner  # for timing a draft step: a cache of its own
    assert not own.shares_cache
    own.prefill([[1, 2]])
