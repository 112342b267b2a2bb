"""SpecExecutor end to end on toy models: exactness of whole continuations, greedy identity,
batch independence, stop handling and the counters."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch
from broken_verifiers import naive_resample_verify
from exactness import ALPHA, PROMPT, continuation_pvalue

import trtspec.spec.executor
from trtspec.runtime.toy import MarkovLM, ToyRunner
from trtspec.spec.counters import SpecStats
from trtspec.spec.executor import SpecExecutor
from trtspec.spec.propose.draft_model import DraftModelProposer
from trtspec.spec.propose.proposer import Draft
from trtspec.spec.sample.probs import SamplingParams


def spec(target: MarkovLM, draft: MarkovLM | None, d: int, clip: bool = True) -> SpecExecutor:
    proposer = DraftModelProposer(ToyRunner(draft)) if draft is not None else None
    return SpecExecutor(ToyRunner(target), proposer, draft_len=d, clip_draft=clip)


SAMPLINGS = {"t1": {}, "t0.7_top_p0.9": {"temperature": 0.7, "top_p": 0.9}}


@pytest.mark.parametrize("sampling", list(SAMPLINGS))
@pytest.mark.parametrize("d", [1, 3, 5])
def test_three_token_continuations_match_target_exactly(d: int, sampling: str) -> None:
    """V = 8, order 2: 512 sequences; clip_draft=False so every round really proposes D."""
    target = MarkovLM(vocab_size=8, order=2, seed=d)
    draft = target.diverged(0.6, seed=d + 1)
    executor = spec(target, draft, d, clip=False)
    pval = continuation_pvalue(executor, target, 3, 30_000, **SAMPLINGS[sampling])
    assert pval > ALPHA, f"D={d} {sampling}: p-value {pval:.2e}"


def test_deep_continuations_exercise_every_draft_position() -> None:
    """V = 3, six tokens (729 sequences), D = 5: acceptance at positions 1..5 shapes the output."""
    target = MarkovLM(vocab_size=3, order=2, seed=21)
    executor = spec(target, target.diverged(0.5, seed=22), 5, clip=False)
    assert continuation_pvalue(executor, target, 6, 30_000) > ALPHA


def test_clipped_drafts_are_exact_too() -> None:
    target = MarkovLM(vocab_size=8, order=2, seed=31)
    executor = spec(target, target.diverged(0.6, seed=32), 4)
    assert continuation_pvalue(executor, target, 3, 30_000, temperature=0.9, top_k=6) > ALPHA


def test_power_executor_with_broken_verifier_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(trtspec.spec.executor, "verify", naive_resample_verify)
    target = MarkovLM(vocab_size=8, order=2, seed=3)
    executor = spec(target, target.diverged(0.6, seed=4), 3, clip=False)
    assert continuation_pvalue(executor, target, 3, 30_000) < ALPHA


@pytest.mark.parametrize("divergence", [0.0, 0.4, 1.0])
def test_greedy_spec_equals_plain_greedy_for_every_d(divergence: float) -> None:
    target = MarkovLM(vocab_size=16, order=2, seed=5, eos_token_id=15)
    prompts = [[1], [2, 3], [4, 5, 6], [7, 8, 9, 10], [11, 12]]
    params = SamplingParams(temperature=0, max_tokens=40)
    plain = [c.token_ids for c in spec(target, None, 0).generate(prompts, params)]
    for d in range(1, 8):
        for clip in (True, False):
            ex = spec(target, target.diverged(divergence, seed=6), d, clip)
            out = ex.generate(prompts, params)
            assert [c.token_ids for c in out] == plain, (d, clip)


def test_request_output_is_identical_alone_and_in_a_batch_of_8() -> None:
    target = MarkovLM(vocab_size=12, order=2, seed=7, eos_token_id=11)
    mine = SamplingParams(temperature=0.8, top_p=0.95, seed=1234, max_tokens=30)
    others = [SamplingParams(temperature=t, seed=s, max_tokens=m) for t, s, m in
              [(1.0, 1, 5), (0.0, 2, 40), (1.2, 3, 17), (0.5, 4, 2), (1.0, 5, 33), (0.7, 6, 9),
               (1.0, 7, 25)]]
    prompts = [[1, 2, 3], [4], [5, 6], [7, 8, 9, 10, 1], [2], [3, 3], [4, 4, 4]]
    for draft in (None, target.diverged(0.5, seed=8)):
        alone = spec(target, draft, 4).generate([[9, 8]], [mine])[0]
        batch = spec(target, draft, 4).generate([*prompts[:3], [9, 8], *prompts[3:]],
                                                [*others[:3], mine, *others[3:]])[3]
        assert batch.token_ids == alone.token_ids
        assert _counters(batch.stats) == _counters(alone.stats)


# ---- counters on constructed cases -------------------------------------------------------------

def greedy_chain(model: MarkovLM, prompt: Sequence[int], n: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(n):
        tokens.append(int(model.next_logits(tokens).argmax()))
    return tokens[len(prompt):]


class ScriptedProposer:
    """Point-mass drafts from a function of the committed tokens (oracle or saboteur)."""

    def __init__(self, continue_fn) -> None:
        self.continue_fn = continue_fn
        self.observed: list[list[int]] = []

    def start(self, prompts: Sequence[Sequence[int]]) -> None:
        pass

    def propose(self, tokens, draft_len, params, generators) -> Draft:
        k = max(draft_len)
        ids = torch.full((len(tokens), k), -1, dtype=torch.long)
        for b, (t, n) in enumerate(zip(tokens, draft_len, strict=True)):
            if n:
                ids[b, :n] = torch.tensor(self.continue_fn(t, n))
        return Draft(ids, torch.tensor(list(draft_len)), None)

    def observe(self, num_accepted: Sequence[int]) -> None:
        self.observed.append(list(num_accepted))


def _counters(stats: SpecStats) -> tuple[int, int, int, int, int]:
    return (stats.proposed_tokens, stats.accepted_draft_tokens, stats.emitted_tokens,
            stats.verification_rounds, stats.discarded_tokens)


GREEDY_MODEL = MarkovLM(vocab_size=16, order=2, seed=9)


def oracle(tokens: Sequence[int], n: int) -> list[int]:
    return greedy_chain(GREEDY_MODEL, tokens, n)


def saboteur(tokens: Sequence[int], n: int) -> list[int]:
    return [(t + 1) % 16 for t in greedy_chain(GREEDY_MODEL, tokens, n)]


def run_scripted(fn, d: int, max_tokens: int, clip: bool = True, eos: int | None = None,
                 stop: tuple[int, ...] = ()):
    model = MarkovLM(vocab_size=16, order=2, seed=9, eos_token_id=eos)
    proposer = ScriptedProposer(fn)
    ex = SpecExecutor(ToyRunner(model), proposer, draft_len=d, clip_draft=clip)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, stop_token_ids=stop)
    return ex.generate([PROMPT], params)[0], proposer


def test_counters_all_accepted_with_bonus() -> None:
    out, proposer = run_scripted(oracle, d=4, max_tokens=11)  # 1 (prefill) + 2 rounds × 5
    assert _counters(out.stats) == (8, 8, 10, 2, 0)
    assert out.stats.al_pooled == 5.0 and out.stats.acceptance_rate == 1.0
    assert out.token_ids == greedy_chain(GREEDY_MODEL, PROMPT, 11)
    assert out.stats.accepted_per_position == [2, 2, 2, 2]
    assert proposer.observed == [[4], [4]]


def test_counters_every_draft_rejected() -> None:
    out, _ = run_scripted(saboteur, d=3, max_tokens=5)  # clip: budgets 4,3,2,1 → drafts 3,2,1,0
    assert _counters(out.stats) == (6, 0, 4, 4, 0)
    assert out.stats.al_pooled == 1.0 and out.stats.acceptance_rate == 0.0
    assert out.stats.proposed_per_position == [3, 2, 1]
    assert out.stats.accepted_per_position == []


def test_counters_eos_inside_an_accepted_run() -> None:
    chain = greedy_chain(GREEDY_MODEL, PROMPT, 12)
    eos = chain[3]  # 2nd token of round 1 (tokens: prefill, then round 1 = chain[1:6])
    assert eos not in chain[:3]
    out, _ = run_scripted(oracle, d=4, max_tokens=12, eos=eos)
    # round 1 verifies 4 drafts + bonus = chain[1:6]; EOS at chain[3] keeps 3, drops 2
    assert out.token_ids == chain[:4] and out.finish_reason == "stop"
    assert _counters(out.stats) == (4, 4, 3, 1, 2)
    assert out.stats.emitted_tokens + out.stats.discarded_tokens == 4 + 1


def test_counters_stop_token_ids_and_ignore_eos() -> None:
    chain = greedy_chain(GREEDY_MODEL, PROMPT, 12)
    assert chain[5] not in chain[:5]  # the bonus token of round 1 is a stop token
    out, _ = run_scripted(oracle, d=4, max_tokens=12, stop=(chain[5],))
    assert out.token_ids == chain[:6] and _counters(out.stats) == (4, 4, 5, 1, 0)
    model = MarkovLM(vocab_size=16, order=2, seed=9, eos_token_id=chain[5])
    ex = SpecExecutor(ToyRunner(model), ScriptedProposer(oracle), draft_len=4)
    ignore = ex.generate([PROMPT], SamplingParams(temperature=0, max_tokens=12,
                                                   ignore_eos=True))[0]
    assert ignore.token_ids == chain and ignore.finish_reason == "length"


def test_counters_max_tokens_cuts_the_bonus_token() -> None:
    out, _ = run_scripted(oracle, d=4, max_tokens=5, clip=False)  # budget 4 after prefill
    assert out.finish_reason == "length" and len(out.token_ids) == 5
    assert _counters(out.stats) == (4, 4, 4, 1, 1)  # the bonus token is the discarded one


def test_clipped_last_round_proposes_only_what_can_be_emitted() -> None:
    out, _ = run_scripted(oracle, d=4, max_tokens=8)  # budget 7: round of 4 (+1), then 1 (+1)
    assert _counters(out.stats) == (5, 5, 7, 2, 0)


def test_prefill_token_can_finish_a_request() -> None:
    chain = greedy_chain(GREEDY_MODEL, PROMPT, 3)
    out, proposer = run_scripted(oracle, d=4, max_tokens=10, eos=chain[0])
    assert out.token_ids == chain[:1] and out.finish_reason == "stop"
    assert _counters(out.stats) == (0, 0, 0, 0, 0) and proposer.observed == []
    one, _ = run_scripted(oracle, d=4, max_tokens=1)
    assert one.finish_reason == "length" and len(one.token_ids) == 1


def test_al_pooled_and_per_request_mean_differ_and_are_named() -> None:
    model = GREEDY_MODEL
    ex = SpecExecutor(ToyRunner(model), ScriptedProposer(oracle), draft_len=4)
    # request A: 1 + 2 rounds of 5 (AL 5); request B: 1 + 1 round with clip → 1 draft (AL 2)
    outs = ex.generate([PROMPT, [3, 4]], [SamplingParams(temperature=0, max_tokens=11),
                                          SamplingParams(temperature=0, max_tokens=3)])
    total = SpecStats.merge(c.stats for c in outs)
    assert total.request_al == [5.0, 2.0]
    assert total.al_pooled == pytest.approx(12 / 3)
    assert total.al_request_mean == pytest.approx(3.5)


def test_plain_decoding_is_the_baseline() -> None:
    target = MarkovLM(vocab_size=8, order=2, seed=10)
    runner = ToyRunner(target)
    out = SpecExecutor(runner).generate([PROMPT], SamplingParams(max_tokens=20, seed=3))[0]
    assert _counters(out.stats) == (0, 0, 19, 19, 0) and out.stats.al_pooled == 1.0
    assert runner.score_calls == 1 + 19  # prefill + one decode step per further token


def test_stream_yields_prefill_then_rounds() -> None:
    target = MarkovLM(vocab_size=8, order=2, seed=12)
    ex = spec(target, target.diverged(0.3, seed=13), 3)
    events = list(ex.stream([PROMPT, [3]], SamplingParams(max_tokens=9, seed=1)))
    assert [d.index for d in events[0]] == [0, 1] and all(len(d.token_ids) == 1 for d in events[0])
    per_request: dict[int, list[int]] = {0: [], 1: []}
    for step in events:
        for d in step:
            per_request[d.index] += d.token_ids
    assert all(len(t) == 9 for t in per_request.values())
    assert [d.finish_reason for d in events[-1]][-1] == "length"


def test_bad_requests_get_clear_errors() -> None:
    ex = spec(MarkovLM(vocab_size=8), None, 0)
    with pytest.raises(ValueError, match="prompt 0 is empty"):
        ex.generate([[]])
    with pytest.raises(ValueError, match=r"outside 0\.\.7"):
        ex.generate([[3, 8]])
    with pytest.raises(ValueError, match="2 SamplingParams for 1 prompts"):
        ex.generate([[1]], [SamplingParams(), SamplingParams()])
    with pytest.raises(ValueError, match="draft_len must be"):
        SpecExecutor(ToyRunner(MarkovLM()), None, draft_len=-1)
