"""The Proposer protocol and the Draft a proposer returns: what the executor relies on, and all
that each proposer module needs of the others (so none imports the package that builds them)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from trtspec.runtime import Runner
from trtspec.spec.sample.probs import SamplingParams


@dataclass
class Draft:
    """One round's proposals for a batch; rows with num_draft 0 propose nothing."""

    token_ids: torch.Tensor  # [B, K] int64, padded with -1
    num_draft: torch.Tensor  # [B] int64, ≤ K
    probs: torch.Tensor | None  # [B, K, V] fp32 q the tokens were sampled from; None = point mass

    @classmethod
    def empty(cls, batch: int) -> Draft:
        return cls(torch.full((batch, 0), -1, dtype=torch.long),
                   torch.zeros(batch, dtype=torch.long), None)


class Proposer(Protocol):
    """Proposes draft tokens for a batch whose rows keep their index (like a Runner's)."""

    def start(self, prompts: Sequence[Sequence[int]]) -> None:
        """A new batch begins with these prompts."""
        ...

    def admit(self, row: int, prompt: Sequence[int], kept: int = 0) -> None:
        """A new request takes ``row`` of the running batch (continuous batching), right
        after the target scored ``prompt[kept:]`` there: with ``kept`` > 0 the row kept the
        first ``kept`` tokens of this very prompt from its last request (``release`` with
        ``keep``; the scheduler's kept prompt)."""
        ...

    def release(self, row: int, keep: int = 0) -> None:
        """``row``'s request has left: drop what it holds, except what the first ``keep``
        tokens of its prompt left behind (a kept prompt: the next request has the same)."""
        ...

    def propose(self, tokens: Sequence[Sequence[int]], draft_len: Sequence[int],
                params: Sequence[SamplingParams], generators: Sequence[torch.Generator]) -> Draft:
        """Propose up to draft_len[b] tokens continuing tokens[b] (prompt + output so far).

        A proposer that samples must use ``logits_to_probs`` with params[b] and return the
        distribution it sampled from; randomness comes from generators[b] only.
        """
        ...

    def observe(self, num_accepted: Sequence[int]) -> None:
        """How many of each row's drafts were accepted: roll back state, adapt."""
        ...

    def undo(self) -> None:
        """The round that asked for the last proposal failed before anything was committed:
        return to the state before that ``propose`` (a partly run one included), as if it had
        not been asked. RuntimeError where the state cannot be put back (then the batch
        cannot go on)."""
        ...

    def forget(self) -> None:
        """Drop what outlives requests (suffix's cross-request tree): warm-up outputs are not
        there to be drafted from."""
        ...

    @property
    def draft_runner(self) -> Runner | None:
        """The model that drafts, with a cache of its own, for timing a draft step (the
        adaptive draft length's cost); None when no model drafts."""
        ...
