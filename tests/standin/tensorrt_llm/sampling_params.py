"""``SamplingParams`` with 1.2.1's fields (tensorrt_llm/sampling_params.py): a kw-only
dataclass, so an unknown name is a TypeError as in the real one."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(slots=True, kw_only=True)
class SamplingParams:
    end_id: int | None = None
    pad_id: int | None = None
    max_tokens: int = 32
    bad: Any = None
    bad_token_ids: Any = None
    stop: Any = None
    stop_token_ids: Any = None
    include_stop_str_in_output: bool = False
    embedding_bias: Any = None
    logits_processor: Any = None
    apply_batched_logits_processor: bool = False
    n: int = 1
    best_of: int | None = None
    use_beam_search: bool = False
    top_k: int | None = None
    top_p: float | None = None
    top_p_min: float | None = None
    top_p_reset_ids: int | None = None
    top_p_decay: float | None = None
    seed: int | None = None
    temperature: float | None = None
    min_tokens: int | None = None
    beam_search_diversity_rate: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    length_penalty: float | None = None
    early_stopping: int | None = None
    no_repeat_ngram_size: int | None = None
    min_p: float | None = None
    beam_width_array: Any = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    return_context_logits: bool = False
    return_generation_logits: bool = False
    exclude_input_from_output: bool = True
    return_encoder_output: bool = False
    return_perf_metrics: bool = False
    additional_model_outputs: list[str] | None = None
    lookahead_config: Any = None
    guided_decoding: Any = None
    ignore_eos: bool = False
    detokenize: bool = True
    add_special_tokens: bool = True
    truncate_prompt_tokens: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True

    def __post_init__(self) -> None:
        if self.top_p is not None and not 0 <= self.top_p <= 1:
            raise ValueError(f"require 0 <= top_p <= 1, got {self.top_p}")
        if self.top_k is not None and self.top_k < 0:
            raise ValueError(f"require top_k >= 0, got {self.top_k}")
        if self.temperature is not None and self.temperature < 0:
            raise ValueError(f"require temperature >= 0, got {self.temperature}")

    @property
    def greedy(self) -> bool:
        """1.2.1's params_imply_greedy_decoding."""
        return (self.temperature is None and self.top_p is None and self.top_k is None) \
            or self.top_k == 1 or self.top_p == 0.0 or self.temperature == 0
