"""Proposers: where draft tokens come from.

Implementations: ``draft_model`` (a second Runner), ``ngram`` (prompt lookup), ``suffix`` (suffix
tries over the request and earlier outputs), ``layer_skip``, and heads that read the target's
hidden states: ``medusa`` (Medusa-1) and ``eagle`` (EAGLE-3, chain drafting).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

from trtspec.runtime import Runner
from trtspec.spec.sample.probs import SamplingParams

if TYPE_CHECKING:
    from trtspec.spec.methods import Method


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

    def forget(self) -> None:
        """Drop what outlives requests (suffix's cross-request tree): warm-up outputs are not
        there to be drafted from."""
        ...

    @property
    def draft_runner(self) -> Runner | None:
        """The model that drafts, with a cache of its own, for timing a draft step (the
        adaptive draft length's cost); None when no model drafts."""
        ...


def make_proposer(method: Method | None, target: Runner | None = None, *, draft: Any = None,
                  target_tokenizer: Any = None) -> Proposer | None:
    """The proposer for a recipe method (None: plain decoding). ``target`` is the target's
    Runner (a layer-skip draft is its ``layer_skip`` view: over its KV cache on the compiled
    runner, with a cache of its own elsewhere; heads read its hidden states); ``draft`` is a
    draft model's loaded checkpoint (trtspec.runtime.models; its tokenizer is checked against
    ``target_tokenizer``), a Runner (the toy backend) or loaded Medusa / EAGLE-3 heads."""
    from trtspec.spec.methods import DraftModel, Eagle, LayerSkip, Medusa, Ngram, Suffix
    from trtspec.spec.propose.draft_model import DraftModelProposer, check_vocab

    match method:
        case None:
            return None
        case Ngram():
            from trtspec.spec.propose.ngram import NgramProposer

            return NgramProposer(method.min_n, method.max_n)
        case Suffix():
            from trtspec.spec.propose.suffix import SuffixProposer

            return SuffixProposer(method.max_depth, method.max_spec_factor,
                                  method.min_token_prob, method.global_tokens,
                                  scope=method.scope)
        case LayerSkip():
            if target is None:
                raise ValueError("method layer_skip needs the target's runner")
            view = target.layer_skip(method.layers)
            if view.shares_cache:
                from trtspec.spec.propose.layer_skip import LayerSkipProposer

                return LayerSkipProposer(view)
            return DraftModelProposer(view)
        case DraftModel():
            if draft is None:
                raise ValueError("method draft_model needs a draft model (--draft-model)")
            from trtspec.runtime.models import LoadedModel

            if isinstance(draft, LoadedModel):
                from trtspec.runtime.hf import HFRunner

                if target_tokenizer is not None:
                    check_vocab(target_tokenizer, draft.tokenizer)
                return DraftModelProposer(HFRunner(draft.model), target_vocab=target.vocab_size
                                          if target is not None else None,
                                          fallback_id=draft.tokenizer.unk_token_id)
            return DraftModelProposer(draft)
        case Medusa() | Eagle():
            if target is None or draft is None:
                raise ValueError(f"method {method.method} needs the target's runner and its "
                                 "loaded heads")
            if isinstance(method, Medusa):
                from trtspec.spec.propose.heads.medusa import MedusaProposer

                return MedusaProposer(target, draft)
            from trtspec.spec.propose.heads.eagle import EagleProposer

            return EagleProposer(target, draft)
        case _:
            raise ValueError(f"method {method.method} runs on TensorRT-LLM builds only")


def method_named(name: str, *, draft_model: str = "", layers: int = 1, ngram_min: int = 1,
                 ngram_max: int = 3) -> Method | None:
    """A method object from a name and the CLI's knobs (``trtspec generate``, the toy server);
    ``none`` is None."""
    from trtspec.spec.methods import DraftModel, LayerSkip, Ngram, Suffix

    match name:
        case "none":
            return None
        case "ngram":
            return Ngram(method="ngram", min_n=ngram_min, max_n=ngram_max)
        case "suffix":
            return Suffix(method="suffix")
        case "layer_skip":
            return LayerSkip(method="layer_skip", layers=layers)
        case "draft_model":
            return DraftModel(method="draft_model", model=draft_model or "(given)")
    raise ValueError(f"unknown method '{name}': use none, draft_model, layer_skip, ngram or "
                     "suffix")
