"""Separate draft checkpoints: vocabulary compatibility and padded-prefix draft logits."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from broken_verifiers import naive_resample_verify
from conftest import tiny_llama
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from transformers import PreTrainedTokenizerFast

import trtspec.spec.executor
from trtspec.analysis.gof import chi_square_gof
from trtspec.runtime.hf import HFRunner
from trtspec.runtime.toy import MarkovLM, ToyRunner
from trtspec.spec.executor import SpecExecutor
from trtspec.spec.propose.draft_model import DraftModelProposer, check_vocab
from trtspec.spec.sample.probs import SamplingParams, make_generator, rows_to_probs


def tokenizer(words: list[str], name: str) -> PreTrainedTokenizerFast:
    vocab = {w: i for i, w in enumerate(words)}
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel(vocab, unk_token=words[0])))
    tok.name_or_path = name
    return tok


BASE = ["<unk>", "a", "b", "c", "d", "e"]


def test_identical_and_padded_prefix_vocabularies_are_accepted() -> None:
    check_vocab(tokenizer(BASE, "target"), tokenizer(BASE, "draft"))
    check_vocab(tokenizer([*BASE, "<pad1>", "<pad2>"], "target"), tokenizer(BASE, "draft"))


def test_mismatched_vocabulary_is_refused_naming_both_tokenizers() -> None:
    target = tokenizer(BASE, "org/target-8b")
    draft = tokenizer(["<unk>", "b", "a", "c", "d", "e"], "org/draft-1b")
    with pytest.raises(ValueError) as err:
        check_vocab(target, draft)
    assert str(err.value) == (
        "draft tokenizer 'org/draft-1b' (vocab 6) does not match target tokenizer "
        "'org/target-8b' (vocab 6): 2 draft tokens have another id or are missing in the "
        "target; a draft must share the target's vocabulary (identical, or a prefix of it)")
    longer_draft = tokenizer([*BASE, "f"], "org/draft-big")
    with pytest.raises(ValueError, match="'org/draft-big' \\(vocab 7\\) does not match"):
        check_vocab(target, longer_draft)


def test_prefix_draft_logits_are_padded_so_q_is_zero_on_target_only_ids() -> None:
    draft_runner = ToyRunner(MarkovLM(vocab_size=6, order=1, seed=0))
    proposer = DraftModelProposer(draft_runner, target_vocab=8)  # 6 draft ids, target has 8
    proposer.start([[1, 2]])
    out = proposer.propose([[1, 2, 3]], [3], [SamplingParams()], [make_generator(0)])
    assert out.probs.shape == (1, 3, 8)
    assert torch.equal(out.probs[0, :, 6:], torch.zeros(3, 2))
    assert torch.allclose(out.probs.sum(-1), torch.ones(1, 3))


def test_target_only_ids_in_the_committed_tokens_reach_the_draft_as_the_fallback_id() -> None:
    """Prompt and committed output come from the target: ids ≥ the draft's vocabulary would index
    past its embedding table, so the draft reads them as the fallback id (0 by default)."""
    draft = MarkovLM(vocab_size=6, order=1, seed=0)  # order 1: logits = table[last token]
    proposer = DraftModelProposer(ToyRunner(draft), target_vocab=8)
    params = SamplingParams()
    proposer.start([[6, 1, 7], [2, 3]])  # row 0: bad ids in the prompt (start)
    out = proposer.propose([[6, 1, 7, 3], [2, 3, 7]], [2, 2], [params] * 2,  # row 1: in feed
                           [make_generator(0), make_generator(1)])
    assert out.probs.shape == (2, 2, 8)
    assert torch.equal(out.probs[..., 6:], torch.zeros(2, 2, 2))
    assert torch.allclose(out.probs.sum(-1), torch.ones(2, 2))
    assert out.token_ids.lt(6).all() and out.token_ids.ge(0).all()
    assert torch.allclose(out.probs[0, 0, :6], torch.softmax(draft.next_logits([3]), -1))
    assert torch.allclose(out.probs[1, 0, :6], torch.softmax(draft.next_logits([0]), -1))
    custom = DraftModelProposer(ToyRunner(draft), target_vocab=8, fallback_id=4)  # e.g. <unk>
    custom.start([[7]])
    out = custom.propose([[7, 6]], [1], [params], [make_generator(0)])
    assert torch.allclose(out.probs[0, 0, :6], torch.softmax(draft.next_logits([4]), -1))


def prefix_draft_pvalue(trials: int = 4000) -> float:
    """Chi-square p-value of (x₀, x₁) from a target with 40 ids speculating with a draft with 32
    (a prefix) against the exact target joint, on a prompt with target-only ids."""
    target = tiny_llama(vocab=40, seed=1, logit_scale=10.0)
    draft = tiny_llama(vocab=32, seed=2, logit_scale=10.0)
    prompt, vocab = [3, 35, 7, 38], 40
    executor = SpecExecutor(HFRunner(target), DraftModelProposer(HFRunner(draft), target_vocab=40),
                            draft_len=2, clip_draft=False)  # clipping would draft nothing for x₁
    reqs = [SamplingParams(temperature=1.0, max_tokens=2, seed=i, ignore_eos=True)
            for i in range(trials)]
    outs = executor.generate([prompt] * trials, reqs)
    pairs = Counter(tuple(c.token_ids) for c in outs)
    assert sum(n for (x0, _), n in pairs.items() if x0 >= 32) > 0.05 * trials  # fed to the draft
    assert sum(c.stats.accepted_draft_tokens == 0 for c in outs) > 0.3 * trials  # rejections
    params = SamplingParams(temperature=1.0)
    with torch.inference_mode():
        p0 = rows_to_probs(target(torch.tensor([prompt])).logits[:, -1], [params])[0]
        both = torch.tensor([[*prompt, t] for t in range(vocab)])
        p1 = rows_to_probs(target(both).logits[:, -1], [params] * vocab)
    exact = (p0[:, None] * p1).flatten().tolist()
    counts = [pairs.get((a, b), 0) for a in range(vocab) for b in range(vocab)]
    return chi_square_gof(counts, exact)[2]


def test_prefix_vocabulary_draft_sampling_is_exact() -> None:
    assert prefix_draft_pvalue() >= 1e-3


def test_power_broken_verifier_fails_with_a_prefix_vocabulary_draft(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(trtspec.spec.executor, "verify", naive_resample_verify)
    assert prefix_draft_pvalue() < 1e-3
