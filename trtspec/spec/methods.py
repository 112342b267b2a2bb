"""The speculation methods a recipe can name (a discriminated union on ``method``) and the strict
base every recipe model shares. They live beside the proposers they configure
(``make_proposer`` matches on them); :mod:`trtspec.build.recipe` re-exports them."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


Dtype = Literal["auto", "float32", "bfloat16", "float16", "fp8"]


class DraftModel(Strict):
    method: Literal["draft_model"] = Field(description="a smaller model drafts")
    model: str = Field(description="the draft checkpoint (same tokenizer as the target)")
    dtype: Dtype = Field("auto", description="the draft's dtype, as target.dtype")


class LayerSkip(Strict):
    method: Literal["layer_skip"] = Field(
        description="the target's first layers draft (self-speculation; torch backend)")
    layers: int = Field(ge=1, description="target layers the draft keeps")


class Ngram(Strict):
    method: Literal["ngram"] = Field(description="prompt lookup: drafts the tokens that "
                                     "followed an earlier occurrence of the latest n-gram")
    min_n: int = Field(1, ge=1, description="shortest n-gram matched (torch backend)")
    max_n: int = Field(3, ge=1, description="longest n-gram matched, tried first "
                       "(TensorRT-LLM max_matching_ngram_size)")

    @model_validator(mode="after")
    def _order(self) -> Ngram:
        if self.min_n > self.max_n:
            raise ValueError(f"min_n ({self.min_n}) must be ≤ max_n ({self.max_n})")
        return self


class Suffix(Strict):
    method: Literal["suffix"] = Field(description="suffix decoding: drafts the most frequent "
                                      "continuation of the longest matching suffix, from tries "
                                      "over the request's text and earlier outputs (torch "
                                      "backend)")
    max_depth: int = Field(24, ge=2, le=256, description="longest substring the tries count: "
                           "matches take up to max_depth − 1 tokens")
    max_spec_factor: float = Field(1.0, gt=0, le=64, description="drafts at most ⌈factor × "
                                   "match length⌉ tokens (at least 1; D caps it)")
    min_token_prob: float = Field(0.1, ge=0, le=1, description="stop drafting where the "
                                  "continuation's running frequency falls below this")
    global_tokens: int = Field(65536, ge=0, description="tokens of finished outputs the global "
                               "trie keeps, oldest evicted first; 0: no global trie (scope "
                               "server; moot with scope request)")
    scope: Literal["request", "server"] = Field(
        "server", description="what drafts come from: request = the request's own prompt and "
        "output only, nothing shared across requests; server = also the global trie of every "
        "client's finished outputs, which raises acceptance on repetitive multi-user traffic "
        "but lets one client's text shape another's drafts, and so its latency (a timing side "
        "channel). The default, server, suits one tenant (and is what evals measure); set "
        "request when clients must not influence each other")


class Medusa(Strict):
    method: Literal["medusa"] = Field(description="Medusa-1 heads on the target's last hidden "
                                      "state draft one token each (torch backend; TensorRT-LLM "
                                      "engine workflow)")
    heads: str = Field(description="directory of the trained Medusa heads (config.json + "
                       "medusa_lm_head.safetensors|.pt; `trtspec distill --method medusa` "
                       "writes one)")
    num_heads: int = Field(4, ge=1, le=8, description="Medusa heads used (`--num_medusa_heads`)")


class Eagle(Strict):
    method: Literal["eagle"] = Field(description="EAGLE draft heads over the target's hidden "
                                     "states (torch backend: EAGLE-3, chain drafting; "
                                     "TensorRT-LLM)")
    model: str = Field(description="the EAGLE draft (heads / EAGLE-3 model directory; "
                       "`trtspec distill --method eagle` writes one)")
    version: Literal[1, 2, 3] = Field(3, description="EAGLE-1, 2 or 3 (EAGLE-3: pytorch "
                                      "workflow and torch backend only)")
    num_layers: int = Field(4, ge=1, description="EAGLE-1/2 engine tree depth (num_eagle_layers)")
    max_non_leaves_per_layer: int = Field(10, ge=1, description="EAGLE-1/2 engine: nodes "
                                          "expanded per tree layer")


Method = Annotated[DraftModel | LayerSkip | Ngram | Suffix | Medusa | Eagle,
                   Field(discriminator="method")]
