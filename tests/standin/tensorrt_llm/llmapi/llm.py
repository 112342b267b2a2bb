"""``LLM`` over a toy Markov model: ``generate`` with 1.2.1's signature; context logits as the
PyTorch workflow returns them (with KV block reuse, only the recomputed tail of the prompt);
``UserProvidedDecodingConfig`` drafting through the given ``Drafter`` and the sampler in
_torch/pyexecutor/sampler.py."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import torch

from tensorrt_llm._torch.pyexecutor.sampler import process_draft_tokens, strategy
from tensorrt_llm.llmapi.llm_args import TorchLlmArgs
from tensorrt_llm.sampling_params import SamplingParams
from trtspec.runtime.toy import MarkovLM

MODELS: dict[str, MarkovLM] = {}  # model name → the toy model LLM(model=name) runs


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None


@dataclass
class RequestOutput:
    request_id: int
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    context_logits: torch.Tensor | None = None
    finished: bool = True


class LlmRequest:
    """What a Drafter sees of a request (_torch/pyexecutor/llm_request.py)."""

    def __init__(self, request_id: int, prompt: list[int], params: SamplingParams) -> None:
        self.py_request_id = request_id
        self.py_orig_prompt_len = len(prompt)
        self.py_max_new_tokens = params.max_tokens
        self.py_draft_tokens: list[int] = []
        self.py_draft_logits: torch.Tensor | None = None
        self.py_draft_use_greedy_sampling = False
        self.sampling_config = SimpleNamespace(
            **{name: None if getattr(params, key) is None else [getattr(params, key)]
               for name, key in (("temperature", "temperature"), ("top_k", "top_k"),
                                 ("top_p", "top_p"), ("random_seed", "seed"))})
        self._tokens = list(prompt)

    def get_tokens(self, beam: int) -> list[int]:
        return list(self._tokens)


@dataclass
class ScheduledRequests:
    context_requests: list[LlmRequest] = field(default_factory=list)
    generation_requests: list[LlmRequest] = field(default_factory=list)

    def all_requests(self) -> list[LlmRequest]:
        return self.context_requests + self.generation_requests


class LLM:
    def __init__(self, model: str, **kwargs: Any) -> None:
        self.args = TorchLlmArgs(model=model, **kwargs)
        if str(model) not in MODELS:
            raise ValueError(f"stand-in LLM: no toy model registered as {model!r}")
        self.target = MODELS[str(model)]
        self._cached: set[int] = set()  # keys of (salt, prefix) whose KV blocks exist
        self._next_id = 0
        self.generate_calls = 0
        self.context_rows: list[int] = []  # context-logit rows returned, per request
        self.accepted_drafts = 0  # drafts the sampler kept, over every step

    def generate(self, inputs: Any, sampling_params: Any = None, use_tqdm: bool = True,
                 lora_request: Any = None, prompt_adapter_request: Any = None,
                 kv_cache_retention_config: Any = None, disaggregated_params: Any = None,
                 scheduling_params: Any = None, cache_salt: Any = None) -> Any:
        single = not (inputs and isinstance(inputs[0], list | tuple))
        prompts = [list(inputs)] if single else [list(p) for p in inputs]
        params = sampling_params if sampling_params is not None else SamplingParams()
        params = list(params) if isinstance(params, list) else [params] * len(prompts)
        salts = cache_salt if isinstance(cache_salt, list | tuple) else [cache_salt] * len(prompts)
        self.generate_calls += 1
        spec = self.args.speculative_config
        if spec is not None and spec.decoding_type == "User_Provided":
            outs = self._speculate(prompts, params, spec)
        else:
            outs = [self._plain(p, sp, salt)
                    for p, sp, salt in zip(prompts, params, salts, strict=True)]
        return outs[0] if single else outs

    def _generator(self, params: SamplingParams, request_id: int) -> torch.Generator:
        return torch.Generator().manual_seed(params.seed if params.seed is not None
                                             else 1_000_003 * request_id)

    def _context(self, prompt: list[int], salt: str | None = None) -> torch.Tensor:
        """Context logits [recomputed, V]: block reuse skips the longest prefix cached under
        the same salt (whole blocks unless partial reuse is on), never the last prompt
        token."""
        kv = self.args.kv_cache_config
        keys, key = [], hash(salt)  # keys[n - 1]: the prefix prompt[:n] under this salt
        for token in prompt:
            key = hash((key, token))
            keys.append(key)
        reused = 0
        if kv.enable_block_reuse:
            for n in range(len(prompt) - 1, 0, -1):
                if keys[n - 1] in self._cached:
                    reused = n if kv.enable_partial_reuse else n - n % kv.tokens_per_block
                    break
        self._cached.update(keys)
        rows = torch.stack([self.target.next_logits(prompt[: i + 1])
                            for i in range(reused, len(prompt))])
        self.context_rows.append(len(rows))
        return rows

    def _plain(self, prompt: list[int], params: SamplingParams, salt: str | None
               ) -> RequestOutput:
        request_id, self._next_id = self._next_id, self._next_id + 1
        context = self._context(prompt, salt)
        generator = self._generator(params, request_id)
        tokens = list(prompt)
        for step in range(params.max_tokens):
            logits = context[-1] if step == 0 else self.target.next_logits(tokens)
            request = LlmRequest(request_id, tokens, params)
            tokens.append(process_draft_tokens(request, logits[None], generator)[0])
        return RequestOutput(request_id, prompt, [CompletionOutput(
            0, token_ids=tokens[len(prompt):], finish_reason="length")],
            context if params.return_context_logits else None)

    def _speculate(self, prompts: list[list[int]], params: list[SamplingParams],
                   spec: Any) -> list[RequestOutput]:
        """Context phase (first token), then steps: the drafter drafts for every running
        request, the sampler verifies each against the target's logits."""
        requests, generators = [], []
        for prompt, sp in zip(prompts, params, strict=True):
            request = LlmRequest(self._next_id, prompt, sp)
            generators.append(self._generator(sp, self._next_id))
            self._next_id += 1
            first = process_draft_tokens(request, self._context(prompt)[-1:], generators[-1])
            request._tokens += first
            requests.append(request)
        live = [i for i, r in enumerate(requests) if r.py_max_new_tokens > 1]
        while live:
            batch = [requests[i] for i in live]
            spec.drafter.prepare_draft_tokens(ScheduledRequests(generation_requests=batch))
            for i in live:
                r = requests[i]
                if len(r.py_draft_tokens) > (spec.max_draft_len or 0):
                    raise ValueError(f"Number of draft tokens ({len(r.py_draft_tokens)}) is "
                                     f"larger than maximum ({spec.max_draft_len})")
                seq = r.get_tokens(0)
                logits = torch.stack([self.target.next_logits(seq + r.py_draft_tokens[:j])
                                      for j in range(len(r.py_draft_tokens) + 1)])
                emitted = process_draft_tokens(r, logits, generators[i])
                self.accepted_drafts += len(emitted) - 1
                room = r.py_max_new_tokens - (len(seq) - r.py_orig_prompt_len)
                r._tokens += emitted[:room]
            live = [i for i in live if len(requests[i]._tokens) - requests[i].py_orig_prompt_len
                    < requests[i].py_max_new_tokens]
        return [RequestOutput(r.py_request_id, p, [CompletionOutput(
            0, token_ids=r._tokens[len(p):], finish_reason="length")])
            for r, p in zip(requests, prompts, strict=True)]


__all__ = ["LLM", "MODELS", "RequestOutput", "strategy"]
