"""trtspec.runtime.trtllm_stream's boundary with TensorRT-LLM: sampling in its terms, against
the test-only stand-in of TensorRT-LLM 1.2.1 (tests/standin/). The streams and arms run in
tests/serve/test_llmapi.py, under the scheduler that drives them."""

from __future__ import annotations

import trtspec.runtime.trtllm_stream as stream
from trtspec.spec.sample.probs import SamplingParams


def test_sampling_reaches_tensorrt_llm_in_its_terms(trtllm_standin) -> None:
    made = stream.llm_sampling(SamplingParams(temperature=0.7, top_k=0, top_p=1.0, seed=3,
                                              max_tokens=9), frozenset({5, 2}))
    assert (made.temperature, made.top_k, made.top_p, made.seed, made.max_tokens) == \
        (0.7, None, None, 3, 9)
    assert made.stop_token_ids == [2, 5] and made.include_stop_str_in_output
    assert made.ignore_eos and not made.detokenize  # EOS only through the stop ids
    greedy = stream.llm_sampling(SamplingParams(temperature=0.0, top_k=4, top_p=0.9), ())
    assert greedy.greedy and greedy.stop_token_ids is None
    seeds = {stream.llm_sampling(SamplingParams(), ()).seed for _ in range(4)}
    assert len(seeds) == 4  # no seed: a random one each, not TensorRT-LLM's shared default
