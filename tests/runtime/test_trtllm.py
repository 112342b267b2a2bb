"""TensorRT-LLM's LLM API under trtspec, against the test-only stand-in in tests/standin/
(1.2.1's names, toy models; see its README): the exact mode verifies raw context logits with
trtspec's sampler (chi-square, with its power check); the drafter mode hands TensorRT-LLM log q
of trtspec's processed q, and the stand-in's rejection sampler, written from TensorRT-LLM's
documented algorithm, keeps the target's distribution with it, and not with unprocessed q."""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace

import pytest
import torch
from broken_verifiers import naive_resample_verify
from conftest import continuation_probs, unflag
from exactness import ALPHA, PROMPT, continuation_pvalue

import trtspec.runtime.trtllm as trtllm
import trtspec.spec.executor
from trtspec.analysis.gof import chi_square_gof
from trtspec.runtime.toy import MarkovLM, ToyRunner
from trtspec.runtime.trtllm import (
    ContextLogitsRunner,
    ContextLogitsShort,
    TrtllmMissing,
    exactness,
    make_drafter,
    require,
)
from trtspec.spec.executor import SpecExecutor
from trtspec.spec.propose.by_request import RequestDrafts
from trtspec.spec.propose.draft_model import DraftModelProposer
from trtspec.spec.sample.probs import SamplingParams


def test_without_tensorrt_llm_one_line_names_the_package_and_the_docs() -> None:
    if trtllm.tensorrt_llm is not None:
        pytest.skip("TensorRT-LLM is installed here")
    with pytest.raises(TrtllmMissing) as e:
        require()
    text = str(e.value)
    assert "\n" not in text and "trtspec[trtllm]" in text and "docs/gpu.md" in text


def test_the_standin_rejects_names_that_are_not_1_2_1s(trtllm_standin) -> None:
    standin = trtllm_standin
    from tensorrt_llm.llmapi import KvCacheConfig, parse_speculative_config

    ok = parse_speculative_config({"decoding_type": "Draft_Target", "max_draft_len": 4,
                                   "speculative_model_dir": "/d"})
    assert ok.speculative_model == "/d"  # the alias 1.2.1 keeps
    for bad in ({"decoding_type": "DraftTarget", "max_draft_len": 4, "speculative_model": "/d"},
                {"decoding_type": "NGram", "max_draft_len": 4, "use_rejection_sampling": True},
                {"decoding_type": "NGram", "max_draft_len": 4, "draft_len_schedule": {4: 4}}):
        with pytest.raises(ValueError):
            parse_speculative_config(bad)
    with pytest.raises(ValueError):
        KvCacheConfig(enable_block_reuses=True)
    with pytest.raises(TypeError):
        standin.SamplingParams(return_context_logit=True)


# ---- exact: trtspec verifies TensorRT-LLM's raw context logits ----

def exact_executor(standin, target: MarkovLM, draft: MarkovLM, d: int, **kv) -> SpecExecutor:
    from tensorrt_llm.llmapi import MODELS, KvCacheConfig

    MODELS["toy"] = target
    llm = standin.LLM("toy", kv_cache_config=KvCacheConfig(**kv))
    runner = ContextLogitsRunner(llm, target.vocab_size)
    return SpecExecutor(runner, DraftModelProposer(ToyRunner(draft)), d, clip_draft=False)


@pytest.mark.parametrize("kv", [{}, {"enable_partial_reuse": False, "tokens_per_block": 2}],
                         ids=["partial-reuse", "whole-blocks"])
def test_exact_mode_keeps_the_target_distribution(trtllm_standin, kv: dict) -> None:
    target = MarkovLM(vocab_size=6, order=2, seed=41)
    executor = exact_executor(trtllm_standin, target, target.diverged(0.6, seed=42), 3, **kv)
    pval = continuation_pvalue(executor, target, 3, 8_000, temperature=0.8)
    assert pval > ALPHA, pval
    rows = executor.target.llm.context_rows
    assert min(rows) < max(rows)  # block reuse returned tails, and the runner took their ends


def test_power_exact_mode_with_a_broken_verifier_fails(trtllm_standin,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(trtspec.spec.executor, "verify", naive_resample_verify)
    target = MarkovLM(vocab_size=6, order=2, seed=41)
    executor = exact_executor(trtllm_standin, target, target.diverged(0.6, seed=42), 3)
    assert continuation_pvalue(executor, target, 3, 8_000, temperature=0.8) < ALPHA


def test_too_few_context_rows_is_a_clear_error_naming_block_reuse(trtllm_standin) -> None:
    short = SimpleNamespace(context_logits=torch.zeros(1, 6))

    class Llm:
        def generate(self, prompts, params, use_tqdm=True, cache_salt=None):
            return [short for _ in prompts]

    runner = ContextLogitsRunner(Llm(), 6)
    runner.prefill([[1, 2]])
    with pytest.raises(ContextLogitsShort, match="block reuse"):
        runner.score([[3, 4, 5]])


# ---- drafter: trtspec drafts, TensorRT-LLM rejection-samples ----

TRIALS = 8_000
SAMPLING = {"temperature": 0.7}


def drafter_counts(standin, target: MarkovLM, draft: MarkovLM, d: int, broken: str = ""
                   ) -> Counter:
    """Continuations through the drafter mode; ``broken``: "q" hands q of the draft's raw
    logits (no temperature), "flag" leaves py_draft_use_greedy_sampling off, so TorchSampler
    applies the temperature to log q a second time."""
    from tensorrt_llm.llmapi import MODELS, UserProvidedDecodingConfig

    MODELS["toy"] = target
    chunk = 100
    drafts = RequestDrafts(DraftModelProposer(ToyRunner(draft)), slots=chunk)
    propose = drafts
    if broken == "q":
        def propose(requests, n):
            out = drafts(requests, n)
            raw = []
            for r, (ids, _) in zip(requests, out, strict=True):
                seq = list(r.tokens)
                rows = []
                for tok in ids:
                    rows.append(torch.softmax(draft.next_logits(seq), -1))
                    seq.append(tok)
                raw.append((ids, torch.stack(rows) if rows else None))
            return raw
    drafter = make_drafter(propose, lambda batch: d, d, target.vocab_size)
    if broken == "flag":
        unflag(drafter)
    llm = standin.LLM("toy", max_batch_size=chunk, speculative_config=UserProvidedDecodingConfig(
        drafter=drafter, max_draft_len=d))
    counts: Counter = Counter()
    for start in range(0, TRIALS, chunk):
        params = [standin.SamplingParams(max_tokens=3, seed=i, **SAMPLING)
                  for i in range(start, start + chunk)]
        for out in llm.generate([PROMPT] * chunk, params):
            counts[tuple(out.outputs[0].token_ids)] += 1
    return counts


def drafter_pvalue(counts: Counter, target: MarkovLM) -> float:
    exact = continuation_probs(target, PROMPT, 3, SamplingParams(**SAMPLING))
    seqs = sorted(set(exact) | set(counts))
    return chi_square_gof([counts.get(s, 0) for s in seqs], [exact.get(s, 0.0) for s in seqs])[2]


def test_drafter_mode_hands_processed_q_and_keeps_the_target_distribution(trtllm_standin) -> None:
    target = MarkovLM(vocab_size=6, order=2, seed=43)
    counts = drafter_counts(trtllm_standin, target, target.diverged(0.5, seed=44), 3)
    assert drafter_pvalue(counts, target) > ALPHA


@pytest.mark.parametrize("broken", ["q", "flag"])
def test_power_a_drafter_handing_unprocessed_q_fails(trtllm_standin, broken: str) -> None:
    target = MarkovLM(vocab_size=6, order=2, seed=43)
    counts = drafter_counts(trtllm_standin, target, target.diverged(0.5, seed=44), 3, broken)
    assert drafter_pvalue(counts, target) < ALPHA


def test_exactness_per_mode_as_the_sources_read() -> None:
    assert exactness("exact", None, 0.8).exact == "yes"
    assert exactness("drafter", None, 0.8).exact == "yes"
    assert exactness("native", "MTP", 0.8).exact == "no"
    assert exactness("native", "Eagle3", 0.0).exact == "yes"
    assert exactness("native", "Draft_Target", 0.8).exact == "audit"


def standin_runner(standin, target: MarkovLM) -> ContextLogitsRunner:
    from tensorrt_llm.llmapi import MODELS

    MODELS["toy"] = target
    return ContextLogitsRunner(standin.LLM("toy"), target.vocab_size)


def test_a_kept_prompt_gets_a_fresh_salt_so_no_old_continuation_is_reused(
        trtllm_standin) -> None:
    """A slot keeps its prompt for the next request (the scheduler's kept prompt): the old
    request's continuation is cached there, and the new request may repeat it. The row's salt
    changes, so every row the executor must verify comes back."""
    from trtspec.runtime import admit_row

    target = MarkovLM(vocab_size=6, order=2, seed=41)
    runner = standin_runner(trtllm_standin, target)
    prompt = [1, 2, 3, 4, 5, 1, 2, 3]
    runner.prefill([prompt])
    runner.score([[0, 1, 2]])
    runner.rollback([len(prompt)])
    admit_row(runner, 0, prompt, kept=len(prompt) - 1)
    logits = runner.score([[0, 1, 2]])[0]  # the old request's very tokens, again: all scored
    want = torch.stack([target.next_logits(prompt + [0, 1, 2][: i + 1]) for i in range(3)])
    assert torch.equal(logits, want)


def test_positions_reuse_serves_from_the_cache_come_from_the_rows_last_call(
        trtllm_standin) -> None:
    """Within a request, a token block reuse serves (a numerical edge: the emitted token equals
    the draft it replaced) takes its logits from the row's previous call, checked by prefix."""
    target = MarkovLM(vocab_size=6, order=2, seed=41)
    runner = standin_runner(trtllm_standin, target)
    runner.prefill([[1, 2, 3]])
    runner.score([[4, 5, 0]])
    runner.rollback([4])  # keeps 4 (committed), drops the drafts 5, 0
    logits = runner.score([[5, 1]])[0]  # 5 again: reused, its row from the last call
    want = torch.stack([target.next_logits([1, 2, 3, 4, 5]),
                        target.next_logits([1, 2, 3, 4, 5, 1])])
    assert torch.equal(logits, want)
    assert runner.llm.context_rows[-1] == 1  # one row recomputed, one from the last call


def test_drafter_mode_keeps_the_drafts_cache_in_step_greedy_acceptance_equals_in_process(
        trtllm_standin) -> None:
    """The drafter learns each step's acceptance one step late, from how far a request's
    tokens grew, and rolls its draft model back by it. Greedy, the draft proposes its argmax
    from that cache: a wrong count would change the proposals, and with them how many are
    accepted (a count one too many keeps a rejected draft in its cache and breaks the next
    feed; one too few only makes it re-read a token). Through TensorRT-LLM's batch (the
    stand-in) and in-process, the same."""
    from tensorrt_llm.llmapi import MODELS, UserProvidedDecodingConfig

    target = MarkovLM(vocab_size=12, order=2, seed=45)
    draft = target.diverged(0.4, seed=46)
    prompts = [[1, 2], [3, 4, 5], [6], [7, 8, 9, 10], [11, 1, 2]]
    d, n = 3, 20
    executor = SpecExecutor(ToyRunner(target), DraftModelProposer(ToyRunner(draft)), d,
                            clip_draft=False)
    done = executor.generate(prompts, SamplingParams(temperature=0, max_tokens=n))
    in_process = sum(c.stats.accepted_draft_tokens for c in done)

    proposer = DraftModelProposer(ToyRunner(draft))
    MODELS["toy"] = target
    drafter = make_drafter(RequestDrafts(proposer, slots=8), lambda batch: d, d,
                           target.vocab_size)
    llm = trtllm_standin.LLM("toy", speculative_config=UserProvidedDecodingConfig(
        drafter=drafter, max_draft_len=d))
    outs = llm.generate(prompts, trtllm_standin.SamplingParams(max_tokens=n, temperature=0))
    assert [o.outputs[0].token_ids for o in outs] == [c.token_ids for c in done]
    assert llm.accepted_drafts == in_process > 0


def test_padding_drafts_keeps_q_a_distribution_per_row() -> None:
    from trtspec.runtime.trtllm import log_q, pad_point_masses

    q = torch.tensor([[0.5, 0.5, 0.0, 0.0]])
    padded = pad_point_masses(log_q([1], q, 4), 3)  # [3, 4]
    probs = padded.softmax(-1)
    assert torch.allclose(probs[0], q[0]) and torch.equal(probs[1:], torch.tensor(
        [[1.0, 0.0, 0.0, 0.0]] * 2))  # the pads: point masses at token 0
    assert pad_point_masses(padded, 2).shape == (3, 4)  # never cut
