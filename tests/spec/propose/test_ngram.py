"""Prompt lookup: the pure search and the point-mass proposer."""

from __future__ import annotations

import pytest
import torch

from trtspec.spec.propose.ngram import NgramProposer, find_continuation
from trtspec.spec.sample.probs import SamplingParams


@pytest.mark.parametrize(("tokens", "min_n", "max_n", "k", "expected"), [
    ([1, 2, 3, 4, 1, 2, 3, 9, 1, 2], 1, 3, 4, [3, 9, 1, 2]),  # latest "1 2" with 4 after it
    ([1, 2, 3, 4, 1, 2, 3, 9, 1, 2, 3], 1, 3, 4, [9, 1, 2, 3]),  # longest suffix "1 2 3" wins
    ([1, 2, 3, 4, 1, 2, 3, 9, 1, 2, 3], 1, 3, 1, [9]),
    ([5, 6, 7], 1, 3, 2, []),  # nothing repeats
    ([7, 7, 7, 7], 1, 2, 3, [7, 7]),  # no occurrence has 3 after it: take the earliest
    ([4, 1, 2, 8, 1, 2], 3, 3, 2, []),  # min_n 3: a 2-gram match is not enough
    ([9], 1, 3, 4, []),
])
def test_find_continuation(tokens, min_n, max_n, k, expected) -> None:
    assert find_continuation(tokens, min_n, max_n, k) == expected


def test_proposer_returns_point_mass_drafts_of_ragged_length() -> None:
    proposer = NgramProposer(1, 3)
    tokens = [[1, 2, 3, 4, 1, 2], [5, 6, 7], [1, 1, 1, 1, 1]]
    draft = proposer.propose(tokens, [3, 3, 0], [SamplingParams()] * 3, [None] * 3)
    assert draft.probs is None
    assert draft.num_draft.tolist() == [3, 0, 0]
    assert draft.token_ids[0].tolist() == [3, 4, 1] and bool((draft.token_ids[1:] == -1).all())
    with pytest.raises(ValueError):
        NgramProposer(3, 2)
    assert isinstance(draft.token_ids, torch.Tensor)
