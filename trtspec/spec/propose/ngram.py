"""Prompt lookup: draft the tokens that followed the latest earlier occurrence of the suffix.

No model runs, so drafts are point masses (``probs=None``): verify accepts each with p(x).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from numpy.lib.stride_tricks import sliding_window_view

from trtspec.spec.propose.proposer import Draft
from trtspec.spec.sample.probs import SamplingParams


def find_continuation(tokens: Sequence[int], min_n: int, max_n: int, k: int) -> list[int]:
    """Up to k tokens that followed an earlier occurrence of the longest suffix n-gram (n from
    max_n down to min_n) of ``tokens``; [] when none occurred.

    The occurrence is the most recent one with k tokens after it (recent text predicts best),
    else the earliest (the longest continuation available).
    """
    if not 1 <= min_n <= max_n:
        raise ValueError(f"need 1 ≤ min_n ≤ max_n, got {min_n}, {max_n}")
    arr = np.asarray(tokens, dtype=np.int64)
    for n in range(min(max_n, len(arr) - 1), min_n - 1, -1):
        windows = sliding_window_view(arr[:-1], n)  # starts 0 … L−1−n: each has a successor
        hits = np.flatnonzero((windows == arr[-n:]).all(axis=1))
        if hits.size:
            full = hits[hits + n + k <= len(arr)]
            start = int(full[-1] if full.size else hits[0]) + n
            return arr[start: start + k].tolist()
    return []


class NgramProposer:
    """Point-mass drafts from :func:`find_continuation`; stateless, so nothing to roll back."""

    def __init__(self, min_n: int = 1, max_n: int = 3) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"ngram needs 1 ≤ min_n ≤ max_n, got {min_n}, {max_n}")
        self.min_n, self.max_n = min_n, max_n

    def start(self, prompts: Sequence[Sequence[int]]) -> None:
        pass

    def admit(self, row: int, prompt: Sequence[int], kept: int = 0) -> None:
        pass  # no state: drafts come from each row's own tokens

    def release(self, row: int, keep: int = 0) -> None:
        pass

    def forget(self) -> None:
        pass  # nothing outlives a request

    @property
    def draft_runner(self) -> None:
        return None  # no model drafts: a draft step costs no forward

    def propose(self, tokens: Sequence[Sequence[int]], draft_len: Sequence[int],
                params: Sequence[SamplingParams], generators: Sequence[torch.Generator]) -> Draft:
        found = [find_continuation(t, self.min_n, self.max_n, n) if n else []
                 for t, n in zip(tokens, draft_len, strict=True)]
        width = max((len(f) for f in found), default=0)
        ids = torch.full((len(tokens), width), -1, dtype=torch.long)
        for b, f in enumerate(found):
            ids[b, : len(f)] = torch.as_tensor(f, dtype=torch.long)
        return Draft(ids, torch.tensor([len(f) for f in found], dtype=torch.long), None)

    def observe(self, num_accepted: Sequence[int]) -> None:
        pass

    def undo(self) -> None:
        pass  # proposing leaves no state
