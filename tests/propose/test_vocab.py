"""Separate draft checkpoints: vocabulary compatibility and padded-prefix draft logits."""

from __future__ import annotations

import pytest
import torch
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from transformers import PreTrainedTokenizerFast

from trtspec.propose.draft_model import DraftModelProposer, check_vocab
from trtspec.runtime.toy import MarkovLM, ToyRunner
from trtspec.sampling import SamplingParams, make_generator


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
