"""Proposers: where draft tokens come from.

Implementations: ``draft_model`` (a second Runner), ``ngram`` (prompt lookup), ``suffix`` (suffix
tries over the request and earlier outputs), ``layer_skip``; ``medusa`` and ``eagle`` with the
real-model backends.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from trtspec.sampling import SamplingParams


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

    def admit(self, row: int, prompt: Sequence[int]) -> None:
        """A new request takes ``row`` of the running batch (continuous batching)."""
        ...

    def release(self, row: int) -> None:
        """``row``'s request has left: drop what it holds."""
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


def make_proposer(method: str, target: Any = None, *, draft_len: int = 4,
                  draft: Any = None, draft_layers: int | None = None, ngram_min: int = 1,
                  ngram_max: int = 3, suffix_max_depth: int = 24,
                  suffix_max_spec_factor: float = 1.0, suffix_min_token_prob: float = 0.1,
                  suffix_global_tokens: int = 65536, target_runner: Any = None
                  ) -> Proposer | None:
    """The proposer for a method name. ``target``/``draft`` are loaded models (trtspec.models)
    for the torch backend, or Runners for the toy backend; ``suffix_*`` are the fields of
    recipe.Suffix. A layer-skip draft is a view of ``target_runner`` when that runner has one
    (the compiled runner), else of the transformers model."""
    from trtspec.propose.draft_model import DraftModelProposer, check_vocab
    from trtspec.propose.ngram import NgramProposer

    match method:
        case "none":
            return None
        case "ngram":
            return NgramProposer(ngram_min, ngram_max)
        case "suffix":
            from trtspec.propose.suffix import SuffixProposer

            return SuffixProposer(suffix_max_depth, suffix_max_spec_factor,
                                  suffix_min_token_prob, suffix_global_tokens)
        case "layer_skip":
            from trtspec.runtime.hf import HFRunner, layer_skip_view

            model = target.model
            layers = draft_layers or max(1, len(model.get_decoder().layers) // 2)
            if hasattr(target_runner, "view"):  # a CompiledRunner: weights, graphs, KV cache
                return DraftModelProposer(target_runner.view(layers, share_cache=True),
                                          follows=target_runner)
            return DraftModelProposer(HFRunner(layer_skip_view(model, layers),
                                               eos_token_id=target.tokenizer.eos_token_id))
        case "draft_model":
            if draft is None:
                raise ValueError("method draft_model needs a draft model (--draft-model)")
            if hasattr(draft, "tokenizer"):  # a loaded HF model
                from trtspec.runtime.hf import HFRunner

                check_vocab(target.tokenizer, draft.tokenizer)
                vocab = target.model.get_output_embeddings().weight.shape[0]
                return DraftModelProposer(HFRunner(draft.model), target_vocab=vocab,
                                          fallback_id=draft.tokenizer.unk_token_id)
            return DraftModelProposer(draft)
        case _:
            raise ValueError(f"unknown method '{method}': use none, draft_model, layer_skip, "
                             "ngram or suffix")
