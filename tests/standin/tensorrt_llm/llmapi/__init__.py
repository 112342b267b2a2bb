"""tensorrt_llm.llmapi as 1.2.1 has it, for the names trtspec uses (see llm_args.py); ``LLM``
runs a toy Markov model registered in ``MODELS`` under the name passed as ``model``."""

from tensorrt_llm.llmapi.llm import LLM, MODELS, RequestOutput
from tensorrt_llm.llmapi.llm_args import (
    DraftTargetDecodingConfig,
    Eagle3DecodingConfig,
    EagleDecodingConfig,
    KvCacheConfig,
    MedusaDecodingConfig,
    MTPDecodingConfig,
    NGramDecodingConfig,
    TorchLlmArgs,
    UserProvidedDecodingConfig,
    parse_speculative_config,
)

__all__ = ["LLM", "MODELS", "DraftTargetDecodingConfig", "Eagle3DecodingConfig",
           "EagleDecodingConfig", "KvCacheConfig", "MTPDecodingConfig", "MedusaDecodingConfig",
           "NGramDecodingConfig", "RequestOutput", "TorchLlmArgs", "UserProvidedDecodingConfig",
           "parse_speculative_config"]
