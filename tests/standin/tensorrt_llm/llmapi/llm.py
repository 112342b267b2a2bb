"""``LLM`` over a toy Markov model: ``generate`` with 1.2.1's signature; context logits as the
PyTorch workflow returns them (with KV block reuse, only the recomputed tail of the prompt);
``UserProvidedDecodingConfig`` drafting through the given ``Drafter`` and the sampler in
_torch/pyexecutor/sampler.py.

``generate_async(..., streaming=True)`` runs requests on an engine thread of its own that
batches them as the PyTorch executor does (at most ``max_batch_size`` in flight, the rest
queued; each iteration one step for every running request): a request's first streamed step
is its context phase (one token), each later one an iteration's tokens (kept drafts and one
more). The result is iterated as 1.2.1's ``GenerationResult`` is (the same object, updated;
``outputs[0].token_ids`` cumulative, ``token_ids_diff`` the step's). ``abort()`` ends a
request with finish reason ``cancelled``. With ``return_perf_metrics``, each step carries
``request_perf_metrics.speculative_decoding`` with the request's cumulative draft and accepted
counts. Natively it drafts with ``NGram`` (a prompt-lookup of its own: the longest suffix of
up to ``max_matching_ngram_size`` tokens seen before, the tokens that followed) and through a
``User_Provided`` drafter; drafts are verified by the sampler module.
"""

from __future__ import annotations

import queue
import threading
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
    request_perf_metrics: Any = None
    _last_token_ids_len: int = 0

    @property
    def token_ids_diff(self) -> list[int]:
        return self.token_ids[self._last_token_ids_len:]


@dataclass
class RequestOutput:
    request_id: int
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    context_logits: torch.Tensor | None = None
    finished: bool = True
    _steps: queue.Queue | None = None  # streamed steps from the engine thread
    _aborted: bool = False

    def __iter__(self) -> RequestOutput:
        return self

    def __next__(self) -> RequestOutput:
        if self.finished:
            raise StopIteration
        item = self._steps.get()
        if isinstance(item, Exception):  # the request failed in the engine
            self.finished = True
            raise item
        tokens, finish, perf = item
        out = self.outputs[0]
        out._last_token_ids_len = len(out.token_ids)
        out.token_ids = out.token_ids + tokens
        out.finish_reason, out.request_perf_metrics = finish, perf
        self.finished = finish is not None
        return self

    def result(self, timeout: float | None = None) -> RequestOutput:
        for _ in self:
            pass
        return self

    def abort(self) -> None:
        self._aborted = True


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
        self._queued: list[_Live] = []  # generate_async requests not yet in the batch
        self._wake = threading.Condition()
        self._engine: threading.Thread | None = None
        self._shutdown = False
        self.iterations = 0  # engine iterations run
        self.max_in_flight = 0  # the most requests the engine ran in one iteration
        self.aborted: list[int] = []  # ids of requests abort() ended, with tokens made
        self.failing: set[tuple[int, ...]] = set()  # prompts that fail after their 1st token

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

    def generate_async(self, inputs: Any, sampling_params: Any = None, lora_request: Any = None,
                       prompt_adapter_request: Any = None, streaming: bool = False,
                       kv_cache_retention_config: Any = None, disaggregated_params: Any = None,
                       _postproc_params: Any = None, scheduling_params: Any = None,
                       cache_salt: Any = None) -> RequestOutput:
        if self._shutdown:
            raise RuntimeError("the LLM has been shut down")
        prompt = list(inputs)
        params = sampling_params if sampling_params is not None else SamplingParams()
        if params.max_tokens < 1:
            raise ValueError("max_tokens must be ≥ 1")
        if self.args.max_input_len is not None and len(prompt) > self.args.max_input_len:
            raise ValueError(f"The sum of prompt length ({len(prompt)}) should not exceed "
                             f"max_input_len ({self.args.max_input_len})")
        if any(not 0 <= t < self.target.vocab_size for t in prompt):
            raise ValueError(f"Token ID out of range (vocab {self.target.vocab_size})")
        with self._wake:
            request_id, self._next_id = self._next_id, self._next_id + 1
            out = RequestOutput(request_id, prompt, [CompletionOutput(0)], finished=False,
                                _steps=queue.Queue())
            self._queued.append(_Live(out, LlmRequest(request_id, prompt, params), params,
                                      self._generator(params, request_id)))
            if self._engine is None:
                self._engine = threading.Thread(target=self._run, name="standin-engine",
                                                daemon=True)
                self._engine.start()
            self._wake.notify()
        return out

    def shutdown(self) -> None:
        with self._wake:
            self._shutdown = True
            self._wake.notify()
        if self._engine is not None:
            self._engine.join(timeout=10)

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    def _run(self) -> None:
        """The engine: admit queued requests up to max_batch_size (their context phase),
        then one generation step for every running one, until shut down."""
        running: list[_Live] = []
        while True:
            with self._wake:
                while not self._shutdown and not running and not self._queued:
                    self._wake.wait()
                if self._shutdown:
                    for live in running + self._queued:
                        live.send([], "cancelled")
                    return
                room = (self.args.max_batch_size or 2048) - len(running)
                new, self._queued = self._queued[:room], self._queued[room:]
            for live in new:
                if live.out._aborted:
                    live.send([], "cancelled")
                    continue
                logits = self._context(live.request.get_tokens(0))[-1:]
                live.emit(process_draft_tokens(live.request, logits, live.generator))
                if tuple(live.out.prompt_token_ids) in self.failing:
                    live.out._steps.put(RuntimeError("stand-in: the request failed"))
                elif live.finish is None:
                    running.append(live)
            for live in [r for r in running if r.out._aborted]:
                self.aborted.append(live.out.request_id)
                live.send([], "cancelled")
            running = [r for r in running if not r.out._aborted]
            if not running:
                continue
            self.iterations += 1
            self.max_in_flight = max(self.max_in_flight, len(running))
            self._draft([r.request for r in running])
            for live in running:
                r = live.request
                seq = r.get_tokens(0)
                logits = torch.stack([self.target.next_logits(seq + r.py_draft_tokens[:j])
                                      for j in range(len(r.py_draft_tokens) + 1)])
                emitted = process_draft_tokens(r, logits, live.generator)
                live.drafted += len(r.py_draft_tokens)
                live.accepted += len(emitted) - 1
                self.accepted_drafts += len(emitted) - 1
                live.emit(emitted)
            running = [r for r in running if r.finish is None]

    def _draft(self, batch: list[LlmRequest]) -> None:
        """Each request's drafts for this iteration, by the speculative config."""
        spec = self.args.speculative_config
        for r in batch:
            r.py_draft_tokens, r.py_draft_logits = [], None
        if spec is None:
            return
        if spec.decoding_type == "User_Provided":
            spec.drafter.prepare_draft_tokens(ScheduledRequests(generation_requests=batch))
            _pad_for_cuda_graph(spec.drafter, batch)
        elif spec.decoding_type == "NGram":
            d = _schedule_len(spec, len(batch))
            for r in batch:
                r.py_draft_tokens = _lookup(r.get_tokens(0), spec.max_matching_ngram_size, d)
        else:
            raise NotImplementedError(f"stand-in: no native {spec.decoding_type} drafting")
        for r in batch:
            if len(r.py_draft_tokens) > (spec.max_draft_len or 0):
                raise ValueError(f"Number of draft tokens ({len(r.py_draft_tokens)}) is "
                                 f"larger than maximum ({spec.max_draft_len})")

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
            _pad_for_cuda_graph(spec.drafter, batch)
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


def _pad_for_cuda_graph(drafter: Any, batch: list[LlmRequest]) -> None:
    """Drafter.pad_draft_tokens_for_cuda_graph: every request's drafts padded with token 0
    to the drafter's max_total_draft_tokens (its draft logits are left as they are)."""
    width = drafter.max_total_draft_tokens or 0
    for r in batch:
        r.py_draft_tokens = list(r.py_draft_tokens) + [0] * (width - len(r.py_draft_tokens))


def _schedule_len(spec: Any, batch: int) -> int:
    """D for a batch of ``batch`` requests: the largest draft_len_schedule key ≤ batch."""
    if not spec.draft_len_schedule:
        return spec.max_draft_len
    return next(d for k, d in reversed(spec.draft_len_schedule.items()) if k <= batch)


def _lookup(tokens: list[int], max_n: int, d: int) -> list[int]:
    """Prompt lookup: the tokens after the latest earlier occurrence of the longest suffix of
    ``tokens`` (up to ``max_n`` long), at most ``d``."""
    for n in range(min(max_n, len(tokens) - 1), 0, -1):
        tail = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start: start + n] == tail:
                return tokens[start + n: start + n + d]
    return []


class _Live:
    """A generate_async request on the engine thread."""

    def __init__(self, out: RequestOutput, request: LlmRequest, params: SamplingParams,
                 generator: torch.Generator) -> None:
        self.out, self.request, self.params, self.generator = out, request, params, generator
        self.finish: str | None = None
        self.drafted = self.accepted = 0

    def emit(self, tokens: list[int]) -> None:
        """Append a step's tokens, cut at max_tokens or a stop id (kept: trtspec asks for
        include_stop_str_in_output), or at end_id unless ignore_eos."""
        p, r = self.params, self.request
        stops = set(p.stop_token_ids or ())  # stop words: ignore_eos leaves them on
        if p.end_id is not None and not p.ignore_eos:
            stops.add(p.end_id)
        kept = []
        for t in tokens:
            kept.append(t)
            if t in stops:
                self.finish = "stop"
                break
            if len(r._tokens) + len(kept) - r.py_orig_prompt_len >= p.max_tokens:
                self.finish = "length"
                break
        r._tokens += kept
        self.send(kept, self.finish)

    def send(self, tokens: list[int], finish: str | None) -> None:
        self.finish = finish
        perf = None
        if self.params.return_perf_metrics:
            perf = SimpleNamespace(speculative_decoding=SimpleNamespace(
                acceptance_rate=self.accepted / self.drafted if self.drafted else 0.0,
                total_accepted_draft_tokens=self.accepted, total_draft_tokens=self.drafted))
        self.out._steps.put((tokens, finish, perf))


__all__ = ["LLM", "MODELS", "RequestOutput", "strategy"]
