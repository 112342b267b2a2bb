"""Proposers: where draft tokens come from.

Implementations: ``draft_model`` (a second Runner), ``ngram`` (prompt lookup), ``suffix`` (suffix
tries over the request and earlier outputs), ``layer_skip``, and heads that read the target's
hidden states: ``heads.medusa`` (Medusa-1) and ``heads.eagle`` (EAGLE-3, chain drafting). What
they share is in ``proposer`` (the protocol and the ``Draft`` it returns); this module builds
one from a recipe's method (``make_proposer``), the one place methods become proposers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from trtspec.runtime import Runner
from trtspec.spec.propose.proposer import Proposer

if TYPE_CHECKING:
    from trtspec.spec.methods import Method


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
