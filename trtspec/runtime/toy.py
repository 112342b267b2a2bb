"""Toy language models whose next-token distributions are known exactly.

An order-n Markov model over a small vocabulary keeps its logits in an explicit table indexed by
the last n tokens, so the exact probability of any continuation is a product of table rows. That
is what the exactness tests compare the executor against (``continuation_probs`` in the tests'
conftest). :meth:`MarkovLM.diverged` makes a draft
whose logits move away from the target's by a chosen amount (0 = identical, 1 = unrelated).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class MarkovLM:
    """Order-``order`` Markov LM: logits = table[last ``order`` tokens], left-padded with 0."""

    def __init__(self, vocab_size: int = 8, order: int = 2, seed: int = 0, scale: float = 2.0,
                 eos_token_id: int | None = None, table: torch.Tensor | None = None) -> None:
        if vocab_size < 2 or order < 1:
            raise ValueError("MarkovLM needs vocab_size ≥ 2 and order ≥ 1")
        self.vocab_size, self.order, self.eos_token_id = vocab_size, order, eos_token_id
        if table is None:
            g = torch.Generator().manual_seed(seed)
            table = torch.randn((vocab_size**order, vocab_size), generator=g) * scale
        self.table = table.float()  # [V**order, V]
        self._powers = vocab_size ** torch.arange(order - 1, -1, -1)  # [order]

    def diverged(self, divergence: float, seed: int = 1) -> MarkovLM:
        """A draft: logits (1 − δ)·target + δ·independent, same vocabulary, order and EOS."""
        if not 0.0 <= divergence <= 1.0:
            raise ValueError("divergence must be in [0, 1]")
        other = MarkovLM(self.vocab_size, self.order, seed=seed + 7919,
                         scale=float(self.table.std()))
        table = (1 - divergence) * self.table + divergence * other.table
        return MarkovLM(self.vocab_size, self.order, eos_token_id=self.eos_token_id, table=table)

    def logits_for(self, history: torch.Tensor) -> torch.Tensor:
        """history [B, order−1+T] (last order−1 context tokens, then T new) → logits [B, T, V]."""
        windows = history.unfold(1, self.order, 1)  # [B, T, order]
        return self.table[(windows * self._powers).sum(-1)]  # [B, T, V]

    def next_logits(self, tokens: Sequence[int]) -> torch.Tensor:
        """Logits [V] for the token after ``tokens``."""
        return self.table[_index(tokens, self.order, self.vocab_size)]


class ToyRunner:
    """A :class:`~trtspec.runtime.Runner` over a :class:`MarkovLM`; the 'KV cache' is the tokens."""

    def __init__(self, model: MarkovLM) -> None:
        self.model = model
        self._seqs: list[list[int]] = []
        self.score_calls = 0  # verification calls when this runner is the target

    @property
    def vocab_size(self) -> int:
        return self.model.vocab_size

    @property
    def eos_token_id(self) -> int | None:
        return self.model.eos_token_id

    def prefill(self, prompts: Sequence[Sequence[int]]) -> torch.Tensor:
        self._seqs = [[] for _ in prompts]
        return self.score(prompts, last_only=True)[:, 0]

    def score(self, tokens: Sequence[Sequence[int]], last_only: bool = False) -> torch.Tensor:
        if len(tokens) != len(self._seqs):
            raise ValueError(f"score got {len(tokens)} rows for a batch of {len(self._seqs)}")
        self.score_calls += 1
        n = self.model.order - 1
        width = max((len(t) for t in tokens), default=0)
        if width == 0:
            return torch.zeros((len(tokens), 0, self.vocab_size))
        rows = []
        for seq, new in zip(self._seqs, tokens, strict=True):
            context = _context(seq, n) if n else []
            rows.append(context + list(new) + [0] * (width - len(new)))
            seq.extend(new)
        logits = self.model.logits_for(torch.tensor(rows, dtype=torch.long).view(len(rows), -1))
        if last_only:
            last = torch.tensor([max(len(t) - 1, 0) for t in tokens])
            logits = logits[torch.arange(len(tokens)), last][:, None]
        return logits

    def rollback(self, lengths: Sequence[int]) -> None:
        for seq, n in zip(self._seqs, lengths, strict=True):
            if n > len(seq):
                raise ValueError(f"cannot roll forward: row holds {len(seq)} tokens, asked {n}")
            del seq[n:]

    def lengths(self) -> list[int]:
        return [len(s) for s in self._seqs]

    @property
    def shares_cache(self) -> bool:
        return False

    def layer_skip(self, num_layers: int, share_cache: bool = True) -> ToyRunner:
        raise ValueError("the toy backend has no layers to skip")

    def capture_hidden(self, layers: Sequence[int]) -> None:
        if layers:
            raise ValueError("the toy backend has no hidden states (heads need a real model)")

    def warm_up(self, batch: int, watch: bool = False) -> float:
        return 0.0  # nothing is compiled


def _context(tokens: Sequence[int], n: int) -> list[int]:
    """The last n tokens, left-padded with token 0."""
    tail = list(tokens[-n:]) if n else []
    return [0] * (n - len(tail)) + tail


def _index(tokens: Sequence[int], order: int, vocab_size: int) -> int:
    index = 0
    for tok in _context(tokens, order):
        index = index * vocab_size + tok
    return index


def parse_token_ids(text: str) -> list[int]:
    """A toy prompt: token ids separated by spaces or commas ("1 2 3")."""
    try:
        return [int(t) for t in text.replace(",", " ").split()]
    except ValueError:
        raise ValueError("toy prompts are token ids, e.g. '1 2 3'") from None
