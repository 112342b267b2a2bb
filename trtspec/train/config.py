"""How to distill: the method, budgets and the settings a resume must match, and the one-line
error for settings no run can use. Apart from the data and the trainers (both read it) so that
neither imports the other, and the CLI checks settings before torch loads."""

from __future__ import annotations

from dataclasses import dataclass

METHODS = ("eagle", "medusa")
TOP_K = 32  # teacher probabilities kept per position: full rows of V would not fit in memory


class DistillError(ValueError):
    """A distill problem with the input (method, prompts, budget, output folder): one line."""


@dataclass
class DistillConfig:
    """How to distill. Every field but the budgets, ``epochs``, ``lr``, ``depth`` and
    ``gen_batch`` is part of the digest a resume must match."""

    method: str
    epochs: int = 8
    lr: float = 1e-3
    minutes: float | None = 15.0  # training wall-clock budget of this invocation
    tokens: int | None = None  # training-token budget of this invocation
    max_new_tokens: int = 128
    max_len: int = 512
    batch_tokens: int = 2048  # tokens per training step (fewer when the vocabulary is large)
    gen_batch: int = 32  # prompts generated together
    top_k: int = TOP_K
    holdout: float = 0.1
    seed: int = 0
    draft_vocab: int = 16384  # EAGLE
    num_heads: int = 4  # Medusa
    head_layers: int = 1  # Medusa: residual blocks per head
    shared_head: bool = False  # Medusa: heads project through the target's (frozen) LM head
    hidden_weight: float = 0.1  # EAGLE: the SmoothL1 term
    depth: int = 4  # D of the expected AL

    def check(self) -> None:
        """DistillError (one line) for settings no run can use."""
        if self.method not in METHODS:
            raise DistillError(f"unknown method '{self.method}': use eagle or medusa")
        for name, value in (("--minutes", self.minutes), ("--tokens", self.tokens)):
            if value is not None and value <= 0:
                raise DistillError(f"{name} must be > 0, got {value}")
        if self.epochs < 1 or not 0 < self.holdout < 1:
            raise DistillError("--epochs must be ≥ 1 and the held-out share between 0 and 1")
