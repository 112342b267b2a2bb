"""A layer-skip draft that reads the target's own KV cache (the compiled runner's view).

The draft is the target's first L layers, final norm and head. Its keys and values for every
committed token are the ones the target's forwards already wrote into those L layers (same
weights, same inputs), so the draft never prefills, never catches up after plain steps, and
holds no per-request state: it feeds each row's last emitted token and then its own drafts,
writing only at slots at or past the target's committed length, which the target overwrites
before it reads them. q is exactly what those L layers compute, so sampling stays exact.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from trtspec.spec.propose.draft_model import sample_drafts
from trtspec.spec.propose.proposer import Draft
from trtspec.spec.sample.probs import SamplingParams

if TYPE_CHECKING:
    from trtspec.runtime.compiled import CompiledRunner


class LayerSkipProposer:
    """Drafts with ``view`` (a compiled runner's view made by ``layer_skip``, whose
    ``shares_cache`` is true). Admission, release and rollback are the target's: this proposer
    keeps nothing per row, so start / admit / release / observe work at any time, before the
    first proposal too."""

    def __init__(self, view: CompiledRunner) -> None:
        if not view.shares_cache:
            raise ValueError("LayerSkipProposer needs a view over the target's KV cache; a "
                             "draft with its own cache is a DraftModelProposer")
        self.runner = view

    @property
    def draft_runner(self) -> CompiledRunner:
        """For timing a draft step: the same layers with a cache of their own (a shared-cache
        view cannot prefill)."""
        return self.runner.detached()

    def start(self, prompts: Sequence[Sequence[int]]) -> None:
        """The target prefills the shared cache."""

    def admit(self, row: int, prompt: Sequence[int], kept: int = 0) -> None:
        """The target admitted the row into the shared cache (a kept prompt's first layers
        are the ones the target kept)."""

    def release(self, row: int, keep: int = 0) -> None:
        """The target's rollback released the row."""

    def forget(self) -> None:
        """Nothing outlives a request here."""

    def observe(self, num_accepted: Sequence[int]) -> None:
        """Nothing to roll back: the next proposal follows the target's lengths again."""

    def undo(self) -> None:
        """Nothing to put back: the next proposal follows the target's lengths again."""

    def propose(self, tokens: Sequence[Sequence[int]], draft_len: Sequence[int],
                params: Sequence[SamplingParams], generators: Sequence[torch.Generator]) -> Draft:
        if max(draft_len, default=0) == 0:
            return Draft.empty(len(tokens))
        self.runner.follow()  # all but each row's last token are in the shared cache
        held = self.runner.lengths()
        feed = [list(t[h:]) if n else [] for t, h, n in zip(tokens, held, draft_len,
                                                           strict=True)]
        return sample_drafts(self.runner, feed, draft_len, params, generators,
                             self.runner.vocab_size)
