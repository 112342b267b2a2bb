"""A stand-in for TensorRT-LLM 1.2.1, for tests only (see tests/standin/README.md): the public
names trtspec uses, with 1.2.1's fields and nothing else, over trtspec's toy Markov models."""

__version__ = "1.2.1"

from tensorrt_llm.llmapi import LLM
from tensorrt_llm.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams"]
