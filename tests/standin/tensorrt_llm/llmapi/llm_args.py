"""tensorrt_llm/llmapi/llm_args.py as 1.2.1 has it, for the names trtspec uses: every model
is a ``StrictBaseModel`` (extra="forbid"); ``speculative_config`` is the union discriminated by
``decoding_type``."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, TypeAdapter, model_validator


class StrictBaseModel(BaseModel):
    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=True)


class DecodingBaseConfig(StrictBaseModel):
    max_draft_len: int | None = Field(None, ge=0)
    max_total_draft_tokens: int | None = None
    speculative_model: str | Path | None = Field(
        None, validation_alias=AliasChoices("speculative_model", "speculative_model_dir"))
    max_concurrency: int | None = Field(None, ge=0)
    draft_len_schedule: dict[int, int] | None = None
    load_format: str | None = None
    acceptance_window: int | None = Field(None, ge=0)
    acceptance_length_threshold: float | None = Field(None, ge=0)
    allow_advanced_sampling: bool = False

    @model_validator(mode="after")
    def _schedule(self) -> DecodingBaseConfig:
        """1.2.1's validate_draft_len_schedule_and_sort: keys are lower bounds from 1."""
        v = self.draft_len_schedule
        if v is None:
            return self
        if any(k < 1 for k in v) or any(d < 0 for d in v.values()):
            raise ValueError("draft_len_schedule: batch sizes ≥ 1 and draft lengths ≥ 0")
        if 1 not in v:
            raise ValueError("draft_len_schedule must include batch_size=1. Add "
                             "{1: <max_draft_len>}")
        if self.max_draft_len is not None and v[1] != self.max_draft_len:
            raise ValueError("draft_len_schedule[1] must equal max_draft_len")
        if self.max_draft_len is not None and any(d > self.max_draft_len for d in v.values()):
            raise ValueError("draft_len_schedule values must be ≤ max_draft_len")
        self.draft_len_schedule = dict(sorted(v.items()))
        return self


def _needs_model(config: DecodingBaseConfig) -> None:
    if not config.max_draft_len:
        raise ValueError("max_draft_len must be > 0")
    if config.speculative_model is None:
        raise ValueError("speculative_model is required")


class DraftTargetDecodingConfig(DecodingBaseConfig):
    decoding_type: Literal["Draft_Target"] = "Draft_Target"

    @model_validator(mode="after")
    def _check(self) -> DraftTargetDecodingConfig:
        _needs_model(self)
        return self


class NGramDecodingConfig(DecodingBaseConfig):
    decoding_type: Literal["NGram"] = "NGram"
    max_matching_ngram_size: int = Field(2, gt=0)
    is_keep_all: bool = True
    is_use_oldest: bool = True
    is_public_pool: bool = True

    @model_validator(mode="after")
    def _check(self) -> NGramDecodingConfig:
        if not self.max_draft_len:
            raise ValueError("max_draft_len must be > 0")
        return self


class EagleDecodingConfig(DecodingBaseConfig):
    decoding_type: Literal["Eagle"] = "Eagle"
    eagle_choices: list[list[int]] | None = None
    greedy_sampling: bool | None = True
    posterior_threshold: float | None = None
    use_dynamic_tree: bool | None = False
    dynamic_tree_max_topK: int | None = None
    num_eagle_layers: int | None = None
    max_non_leaves_per_layer: int | None = None
    eagle3_one_model: bool | None = True
    eagle3_layers_to_capture: set[int] | None = None
    eagle3_model_arch: Literal["llama3", "mistral_large3"] = "llama3"

    @model_validator(mode="after")
    def _check(self) -> EagleDecodingConfig:
        _needs_model(self)
        return self


class Eagle3DecodingConfig(EagleDecodingConfig):
    decoding_type: Literal["Eagle3"] = "Eagle3"  # type: ignore[assignment]


class MTPDecodingConfig(DecodingBaseConfig):
    decoding_type: Literal["MTP"] = "MTP"
    num_nextn_predict_layers: int = Field(1, gt=0)
    use_relaxed_acceptance_for_thinking: bool = False
    relaxed_topk: int = 1
    relaxed_delta: float = 0.0
    use_mtp_vanilla: bool = False
    mtp_eagle_one_model: bool = True
    begin_thinking_phase_token: int = 128798
    end_thinking_phase_token: int = 128799

    @model_validator(mode="after")
    def _check(self) -> MTPDecodingConfig:
        self.max_draft_len = self.num_nextn_predict_layers
        return self


class MedusaDecodingConfig(DecodingBaseConfig):
    decoding_type: Literal["Medusa"] = "Medusa"
    medusa_choices: list[list[int]] | None = None
    num_medusa_heads: int | None = None


class UserProvidedDecodingConfig(DecodingBaseConfig):
    decoding_type: Literal["User_Provided"] = "User_Provided"
    drafter: object
    resource_manager: object = None

    @model_validator(mode="after")
    def _check(self) -> UserProvidedDecodingConfig:
        self.max_total_draft_tokens = self.max_draft_len
        return self


SpeculativeConfig = Annotated[
    DraftTargetDecodingConfig | EagleDecodingConfig | Eagle3DecodingConfig | MTPDecodingConfig
    | MedusaDecodingConfig | NGramDecodingConfig | UserProvidedDecodingConfig,
    Field(discriminator="decoding_type")]


def parse_speculative_config(data: dict[str, Any]) -> Any:
    """A ``speculative_config`` mapping (YAML) as 1.2.1 parses it."""
    return TypeAdapter(SpeculativeConfig).validate_python(data)


class KvCacheConfig(StrictBaseModel):
    enable_block_reuse: bool = True
    max_tokens: int | None = None
    max_attention_window: list[int] | None = None
    sink_token_length: int | None = None
    free_gpu_memory_fraction: float | None = Field(0.9, ge=0, le=1)
    host_cache_size: int | None = None
    onboard_blocks: bool = True
    cross_kv_cache_fraction: float | None = None
    secondary_offload_min_priority: int | None = None
    event_buffer_max_size: int = 0
    attention_dp_events_gather_period_ms: int = 5
    enable_partial_reuse: bool = True
    copy_on_partial_reuse: bool = True
    use_uvm: bool = False
    max_gpu_total_bytes: int = 0
    dtype: str = "auto"
    mamba_ssm_cache_dtype: str = "auto"
    tokens_per_block: int = 32
    use_kv_cache_manager_v2: bool = False
    max_util_for_resume: float = 0.95


class TorchLlmArgs(StrictBaseModel):
    """The BaseLlmArgs and TorchLlmArgs fields trtspec may write (a subset of 1.2.1's: a name
    outside it fails, which is the point)."""

    model: str | Path
    tokenizer: Any = None
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    context_parallel_size: int = 1
    kv_cache_config: KvCacheConfig = Field(default_factory=KvCacheConfig)
    speculative_config: SpeculativeConfig | None = None
    max_batch_size: int | None = 2048
    max_input_len: int | None = 1024
    max_seq_len: int | None = None
    max_beam_width: int | None = 1
    max_num_tokens: int | None = 8192
    gather_generation_logits: bool = False
    return_perf_metrics: bool = False
    perf_metrics_max_requests: int = 0
    disable_overlap_scheduler: bool = False
    sampler_type: Literal["TRTLLMSampler", "TorchSampler", "auto"] = "auto"
    enable_iter_perf_stats: bool = False
    enable_iter_req_stats: bool = False
    enable_chunked_prefill: bool = False
    attn_backend: str = "TRTLLM"
    disable_flashinfer_sampling: bool = False
    backend: Literal["pytorch"] = "pytorch"
    trust_remote_code: bool = False
