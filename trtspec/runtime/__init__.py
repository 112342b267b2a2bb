"""Runners: a model that holds a batch of sequences (its KV cache) and scores new tokens.

Implementations: ``toy`` (exact Markov models), ``hf`` (transformers, any architecture) and
``compiled`` (trtspec's Llama-family decoder under torch.compile).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch


class CacheFull(MemoryError):
    """The KV cache would have to grow past the memory that is free: raised before anything
    is allocated or written, so the batch is as it was and the caller can refuse the request
    that needed the room (or let it wait) while the others go on."""


class Runner(Protocol):
    """A batch of B sequences kept by a model between calls.

    Rows keep their index for the life of a batch. A row given no tokens in :meth:`score` is left
    alone (finished or idle requests), so callers never need to shrink the batch.
    """

    @property
    def vocab_size(self) -> int: ...

    @property
    def eos_token_id(self) -> int | None: ...

    def prefill(self, prompts: Sequence[Sequence[int]]) -> torch.Tensor:
        """Start a new batch from the prompts; return logits [B, V] for each prompt's next token."""
        ...

    def score(self, tokens: Sequence[Sequence[int]], last_only: bool = False) -> torch.Tensor:
        """Append tokens[b] to row b; return logits [B, T, V] (T = max len, or 1 if last_only).

        logits[b, t] predicts the token after tokens[b][t]; positions past len(tokens[b]) are
        padding with unspecified values.
        """
        ...

    def rollback(self, lengths: Sequence[int]) -> None:
        """Truncate row b to its first lengths[b] tokens (prompt included); no recompute."""
        ...

    def lengths(self) -> list[int]:
        """Tokens held per row, prompt included."""
        ...

    @property
    def shares_cache(self) -> bool:
        """Whether this runner reads another runner's KV cache (a layer-skip view of the
        compiled runner): it never prefills, and its owner writes the committed tokens."""
        ...

    def layer_skip(self, num_layers: int, share_cache: bool = True) -> Runner:
        """A draft of this model's first ``num_layers`` layers, final norm and head, sharing
        its weights. Its KV cache is this runner's where the runner can share it (then its
        ``shares_cache`` is true) and ``share_cache`` asks for it, else its own. ValueError
        when the model has no layers to skip."""
        ...

    def capture_hidden(self, layers: Sequence[int]) -> None:
        """From now on every prefill/score also keeps the outputs of decoder ``layers``
        (0-based, negative from the end; before the final norm) at every position it is fed,
        from the same forward: ``hidden`` [n, T, len(layers)·H] for the n contiguous batch rows
        from ``hidden_first`` that the call scored (T: the most tokens a row was fed, with
        ``last_only`` too; rows fed nothing and positions past a row's count are padding) and
        ``hidden_counts`` (tokens fed per batch row). Medusa and EAGLE heads read them (see
        trtspec.spec.propose.heads.captured); an empty list stops keeping them; ValueError where a
        runner has no layers (toy)."""
        ...

    def warm_up(self, batch: int, watch: bool = False) -> float:
        """Prepare every kernel a batch of ``batch`` rows can need, so no request waits for a
        compiler; returns seconds. A live KV cache is kept as it was. ``watch`` (a server):
        say when a later step compiles anyway. A no-op for eager runners."""
        ...


def admit_row(runner: Runner, row: int, prompt: Sequence[int], kept: int = 0
              ) -> torch.Tensor:
    """Put a new sequence in ``row`` of a running batch, the other rows untouched: drop the
    row's tokens past the first ``kept`` (which must be this prompt's: a kept prompt), then
    score the rest of the prompt there alone. Returns logits [V] for its next token. Any
    Runner can do it: a row given no tokens is left alone by score()."""
    lengths = runner.lengths()
    lengths[row] = kept
    runner.rollback(lengths)
    feed: list[list[int]] = [[] for _ in lengths]
    feed[row] = list(prompt[kept:])
    return runner.score(feed, last_only=True)[row, 0]
