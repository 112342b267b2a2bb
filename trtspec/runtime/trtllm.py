"""TensorRT-LLM's LLM API (PyTorch workflow) under trtspec, in three modes.

The only runtime module that imports ``tensorrt_llm`` (build/trtllm.py runs its build steps),
behind one guarded import: without it, :func:`require` raises :class:`TrtllmMissing`, whose one
line names the package and the docs page, and everything else in trtspec still works.

Terms:

* **mode**      who drafts and who verifies (:data:`MODES`):

  - ``exact``    trtspec verifies. :class:`ContextLogitsRunner` is a trtspec Runner over the
                 LLM API: each call sends a row's tokens so far plus the new ones as a prompt
                 with ``max_tokens=1`` and ``return_context_logits=True``. With KV block reuse
                 TensorRT-LLM recomputes only the tail past the longest cached prefix and
                 returns context logits for that tail only; the last ``n`` rows (``n`` new
                 tokens) are the raw logits trtspec's ``logits_to_probs`` and ``verify`` need.
                 The row count is checked on every call. Slow by design (a prompt per round):
                 the reference the other modes are audited against.
  - ``drafter``  TensorRT-LLM verifies trtspec's drafts: :func:`make_drafter` returns a
                 ``Drafter`` for ``UserProvidedDecodingConfig`` that sets each request's
                 ``py_draft_tokens`` and ``py_draft_logits`` = log q, q the proposal as trtspec
                 sampled it (after temperature, top-k and top-p), so the sampler's rejection
                 test min(1, p/q) sees the real proposal.
  - ``native``   TensorRT-LLM drafts and verifies: the options file build wrote, speculative
                 config and all.

  ``native`` and ``drafter`` run TensorRT-LLM's own batch, request by request
  (:mod:`trtspec.runtime.trtllm_stream`).

* **exact at T** (:func:`exactness`): whether a mode keeps the target's output distribution at
  a sampling temperature T, as the 1.2.1 sources read: ``yes``, ``no`` or ``audit`` (not
  established from the source: measure it with ``trtspec audit``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

try:  # guarded: TensorRT-LLM needs Linux + an NVIDIA GPU + CUDA; trtspec runs without it
    import tensorrt_llm
except Exception:  # ImportError, or a broken CUDA install raising at import
    tensorrt_llm = None

DOCS = "docs/gpu.md"
MODES = ("native", "drafter", "exact")
Mode = Literal["native", "drafter", "exact"]


class TrtllmMissing(RuntimeError):
    """TensorRT-LLM is not importable here; the message is the one line a user sees."""


class ContextLogitsShort(RuntimeError):
    """TensorRT-LLM returned fewer context-logit rows than tokens trtspec must verify."""


def require() -> Any:
    """The ``tensorrt_llm`` module, or :class:`TrtllmMissing` with what to install."""
    if tensorrt_llm is None:
        raise TrtllmMissing("this needs TensorRT-LLM, which is not importable here: on a Linux "
                            "machine with an NVIDIA GPU, pip install 'trtspec[trtllm]' "
                            f"(see {DOCS}, Running on an NVIDIA GPU)")
    return tensorrt_llm


def release() -> str | None:
    """The importable TensorRT-LLM's version, None without one."""
    return None if tensorrt_llm is None else str(getattr(tensorrt_llm, "__version__", "?"))


@dataclass(frozen=True)
class Exactness:
    """Whether a mode keeps the target's distribution, and why (a report line)."""

    exact: Literal["yes", "no", "audit"]
    why: str


def exactness(mode: Mode, decoding_type: str | None, temperature: float,
              allow_advanced_sampling: bool = False) -> Exactness:
    """What the 1.2.1 sources say about a mode's output distribution at ``temperature``
    (``decoding_type``: the native config's, None for the other modes)."""
    if mode == "exact":
        return Exactness("yes", "trtspec verifies the raw context logits (exact rejection "
                                "sampling, the same code as the torch backend)")
    if temperature == 0:
        return Exactness("yes", "greedy: drafts are kept while they equal the target's argmax")
    if mode == "drafter":
        return Exactness("yes", "TorchSampler rejection-samples requests that carry "
                                "py_draft_logits; trtspec hands log q of the proposal it "
                                "sampled from")
    if decoding_type in ("Eagle3", "MTP") and not allow_advanced_sampling:
        return Exactness("no", f"{decoding_type} one-model drafting samples greedily unless "
                               "allow_advanced_sampling is set: temperature is ignored")
    if decoding_type == "NGram":
        return Exactness("yes", "n-gram drafts are point masses, kept while they equal the "
                                "target's own sample")
    return Exactness("audit", f"{decoding_type} at T > 0: not established from the source; "
                              "run trtspec audit on it")


def make_llm(model: str, tp_size: int, limits: Any, speculative_config: Any = None,
             kv_cache_fraction: float = 0.9, options: dict[str, Any] | None = None,
             kv_cache_bytes: int | None = None) -> Any:
    """A ``tensorrt_llm.LLM`` (PyTorch workflow) with the recipe's limits and KV block reuse
    on, which the exact mode relies on to find a row's prefix again. ``kv_cache_fraction`` of
    the free GPU memory goes to its KV cache (TensorRT-LLM's default 0.9; less where a torch
    draft model shares the GPU and grows a cache of its own, or two arms share it).
    ``options``: an LLM API options file build wrote (its keys win, as trtllm-serve's
    ``--config`` does). ``kv_cache_bytes`` caps the KV cache in bytes as well (TensorRT-LLM
    takes the smaller): arms made one after another get the same cache that way, where a
    fraction of what is free would give the second less."""
    trt = require()
    from tensorrt_llm.llmapi import KvCacheConfig

    kwargs: dict[str, Any] = {
        "max_batch_size": limits.max_batch_size, "max_num_tokens": limits.max_num_tokens,
        "max_seq_len": limits.max_seq_len, "speculative_config": speculative_config,
        "kv_cache_config": KvCacheConfig(enable_block_reuse=True,
                                         free_gpu_memory_fraction=kv_cache_fraction,
                                         max_gpu_total_bytes=kv_cache_bytes or 0)}
    kwargs.update(options or {})
    kwargs.pop("stream_interval", None)  # 1, the default: every iteration a streamed step
    return trt.LLM(model=model, tensor_parallel_size=tp_size, **kwargs)


class ContextLogitsRunner:
    """A trtspec Runner whose scores are TensorRT-LLM's raw context logits (mode ``exact``).

    The KV cache is TensorRT-LLM's, found again by block reuse: a row is the token list it
    holds, :meth:`rollback` only truncates it. ``llm`` is a ``tensorrt_llm.LLM`` with KV block
    reuse on (its default); ``vocab_size`` trims the padded vocabulary of the logits.

    Each row's prompts carry a ``cache_salt`` of their own, new whenever a rollback drops
    committed tokens (a new request, a kept prompt), so a row reuses only blocks its own
    request wrote: another request's identical prefix, or an earlier request's continuation,
    would be reused without its logits, and those are the rows trtspec must verify. Within a
    request, the first new token differs from the continuation cached there (a rejection's
    token is never the rejected draft, a bonus lies past every draft), so the tail comes back
    whole; where it does not (numerics), the rows the row's previous call returned at those
    positions stand in, and a position neither covers is an error, never a silent wrong
    answer.
    """

    def __init__(self, llm: Any, vocab_size: int, eos_token_id: int | None = None) -> None:
        self.llm, self._vocab, self._eos = llm, vocab_size, eos_token_id
        self._params = require().SamplingParams(max_tokens=1, return_context_logits=True,
                                                detokenize=False)
        self._rows: list[list[int]] = []
        self._salts: list[str] = []
        self._seen: list[tuple[list[int], dict[int, torch.Tensor]]] = []  # last call's rows
        self._committed: list[int] = []  # per row, see score()
        self._starts = 0  # rows started over, for fresh salts
        self.calls = 0  # generate() calls (one per prefill or score)

    @property
    def vocab_size(self) -> int:
        return self._vocab

    @property
    def eos_token_id(self) -> int | None:
        return self._eos

    @property
    def shares_cache(self) -> bool:
        return False

    def prefill(self, prompts: Sequence[Sequence[int]]) -> torch.Tensor:
        self._rows = [[] for _ in prompts]
        self._salts = [self._salt() for _ in prompts]
        self._seen = [([], {}) for _ in prompts]
        self._committed = [0] * len(prompts)
        return self.score(prompts, last_only=True)[:, 0]

    def _salt(self) -> str:
        self._starts += 1
        return f"trtspec-{id(self):x}-{self._starts}"

    def score(self, tokens: Sequence[Sequence[int]], last_only: bool = False) -> torch.Tensor:
        """One ``generate`` call for the rows given tokens: logits [B, T, V] (see Runner)."""
        if len(tokens) != len(self._rows):
            raise ValueError(f"score got {len(tokens)} rows for a batch of {len(self._rows)}")
        fed = [b for b, new in enumerate(tokens) if new]
        width = 1 if last_only else max((len(t) for t in tokens), default=0)
        out = torch.zeros((len(tokens), width, self._vocab))
        if not fed or width == 0:
            return out
        prompts = [self._rows[b] + list(tokens[b]) for b in fed]
        results = self.llm.generate(prompts, [self._params] * len(prompts), use_tqdm=False,
                                    cache_salt=[self._salts[b] for b in fed])
        self.calls += 1
        for b, result in zip(fed, results, strict=True):
            n = 1 if last_only else len(tokens[b])
            rows = self._tail(b, prompts[fed.index(b)], n, result)  # [n, V]
            out[b, : len(rows)] = rows
            # committed: what a later rollback must keep for this row's cached blocks to hold
            # no continuation but drafts (after a round, the row's tokens before it and the
            # first fed, its last emitted token; after a prefill, all of them)
            self._committed[b] = len(self._rows[b]) + (len(tokens[b]) if last_only else 1)
            self._rows[b].extend(tokens[b])
        return out

    def _tail(self, b: int, prompt: list[int], n: int, result: Any) -> torch.Tensor:
        """Logits [n, V] at the prompt's last ``n`` positions: TensorRT-LLM's context rows
        for the tail it recomputed, and for positions block reuse served from this row's cache
        the rows the row's previous call returned there (same prefix, same logits), else
        ContextLogitsShort."""
        logits = getattr(result, "context_logits", None)
        if logits is None:
            raise ContextLogitsShort("TensorRT-LLM returned no context logits: the LLM must run "
                                     "the PyTorch workflow and the request ask "
                                     "return_context_logits")
        if logits.dim() != 2:
            raise ContextLogitsShort(f"TensorRT-LLM returned context logits of shape "
                                     f"{tuple(logits.shape)}; trtspec reads [tokens, vocab]")
        got = logits[:, : self._vocab].float().cpu()  # [r, V]
        first = len(prompt) - got.shape[0]  # the first position TensorRT-LLM recomputed
        seen_tokens, seen = self._seen[b]
        rows = []
        for pos in range(len(prompt) - n, len(prompt)):
            if pos >= first:
                rows.append(got[pos - first])
            elif pos in seen and seen_tokens[: pos + 1] == prompt[: pos + 1]:
                rows.append(seen[pos])
            else:
                raise ContextLogitsShort(
                    f"TensorRT-LLM returned {got.shape[0]} context-logit rows for a "
                    f"{len(prompt)}-token prompt whose last {n} tokens trtspec must verify: KV "
                    "block reuse served the others from the cache without their logits; run "
                    "with KvCacheConfig(enable_block_reuse=False) to recompute every prompt, "
                    "and report it")
        tail = torch.stack(rows)
        self._seen[b] = (prompt, dict(zip(range(len(prompt) - n, len(prompt)), tail,
                                          strict=True)))
        return tail

    def rollback(self, lengths: Sequence[int]) -> None:
        for b, (row, n) in enumerate(zip(self._rows, lengths, strict=True)):
            if n > len(row):
                raise ValueError(f"cannot roll forward: row holds {len(row)} tokens, asked {n}")
            del row[n:]
            if n < self._committed[b]:  # committed tokens dropped (a new request, or a kept
                # prompt): its blocks hold a continuation the next tokens may repeat, which
                # block reuse would serve without logits; a fresh salt reuses none of them
                self._salts[b], self._seen[b] = self._salt(), ([], {})
                self._committed[b] = n

    def lengths(self) -> list[int]:
        return [len(r) for r in self._rows]

    def layer_skip(self, num_layers: int, share_cache: bool = True) -> Any:
        raise ValueError("layer_skip drafts from the target's own layers, which TensorRT-LLM's "
                         "LLM API does not expose: use ngram, suffix or a draft model")

    def capture_hidden(self, layers: Sequence[int]) -> None:
        if layers:
            raise ValueError("Medusa / EAGLE heads on TensorRT-LLM run natively (mode native)")

    def warm_up(self, batch: int, watch: bool = False) -> float:
        return 0.0  # TensorRT-LLM captures its own graphs when the LLM is made


@dataclass(frozen=True)
class Scheduled:
    """What a drafter reads of one request TensorRT-LLM scheduled: its id, the tokens it holds
    (prompt and output) and its sampling, in trtspec's terms (temperature 0: greedy)."""

    key: int
    tokens: list[int]
    temperature: float
    top_k: int
    top_p: float
    seed: int | None


def scheduled(request: Any) -> Scheduled:
    """A TensorRT-LLM ``LlmRequest`` as :class:`Scheduled`. Its sampling lives in
    ``request.sampling_config`` as one-element lists (None: unset, TensorRT-LLM's defaults)."""
    config = request.sampling_config

    def first(name: str) -> Any:
        value = getattr(config, name, None)
        return value[0] if isinstance(value, list | tuple) and value else value

    temperature, top_k, top_p = first("temperature"), first("top_k"), first("top_p")
    greedy = (temperature is None and top_k is None and top_p is None) or top_k == 1 \
        or top_p == 0 or temperature == 0
    return Scheduled(int(request.py_request_id), list(request.get_tokens(0)),
                     0.0 if greedy else float(1.0 if temperature is None else temperature),
                     int(top_k or 0), float(1.0 if top_p is None else top_p),
                     first("random_seed"))


Propose = Callable[[list[Scheduled], int], list[tuple[list[int], torch.Tensor | None]]]


def make_drafter(propose: Propose, draft_len: Callable[[int], int], max_draft_len: int,
                 vocab_size: int, device: Any = None) -> Any:
    """A TensorRT-LLM ``Drafter`` (mode ``drafter``) for ``UserProvidedDecodingConfig``.

    ``propose(requests, d)`` drafts up to ``d`` tokens for each request and returns them with
    q [len, V], the distribution they were sampled from after trtspec's ``logits_to_probs``
    with the request's sampling (None: point masses, n-gram / suffix). ``draft_len(batch)``
    is D for a batch of that many running requests (the policy's schedule). ``vocab_size``
    is the width of the target's logits (padded vocabularies included) and ``device`` theirs:
    TorchSampler subtracts q from p element-wise there.

    Each request gets ``py_draft_tokens``, ``py_draft_logits`` = log q [len, V] and
    ``py_draft_use_greedy_sampling = True``. TorchSampler rejection-samples a sampled request
    that carries draft logits, and makes q from them with the request's own temperature,
    top-k and top-p, unless the greedy flag is set, when q = softmax(draft logits). trtspec's
    q is already shaped by that sampling (the same ``logits_to_probs`` as its target), so
    with the flag softmax(log q) = q: the test min(1, p/q) and the residual max(0, p − q) use
    the proposal the tokens were really drawn from. Without the flag the temperature would be
    applied a second time.

    TensorRT-LLM pads every request's drafts to the drafter's ``max_total_draft_tokens``
    with token 0 for its CUDA graphs, past the rows of q. So a request with fewer drafts (an
    n-gram without a match, a schedule's smaller D) is padded here first, with token 0 as a
    point mass (q one-hot there): a real proposal, exact whether it is kept or not. A request
    given no drafts is left without (TensorRT-LLM pads it and matches the pads against its
    own samples: point masses again).
    """
    from tensorrt_llm._torch.speculative.drafter import Drafter

    class TrtspecDrafter(Drafter):
        def prepare_draft_tokens(self, scheduled_requests: Any,
                                 resource_manager: Any = None) -> None:
            requests = list(scheduled_requests.generation_requests)
            d = min(draft_len(len(requests)), max_draft_len)
            drafts = propose([scheduled(r) for r in requests], d) if d > 0 and requests \
                else [([], None)] * len(requests)
            # the width TensorRT-LLM pads to (1.2 keeps it as _static_max_total_draft_tokens)
            width = getattr(self, "_static_max_total_draft_tokens", None) \
                or self.max_total_draft_tokens or max_draft_len
            for request, (tokens, q) in zip(requests, drafts, strict=True):
                logits = None
                if tokens:
                    logits = pad_point_masses(log_q(tokens, q, vocab_size, device), width)
                    tokens = list(tokens) + [0] * (width - len(tokens))
                request.py_draft_tokens = list(tokens)
                request.py_draft_logits = logits
                request.py_draft_use_greedy_sampling = True  # q as given (see above)

    return TrtspecDrafter(max_draft_len=max_draft_len, max_total_draft_tokens=max_draft_len)


def user_provided(drafter: Any, max_draft_len: int) -> Any:
    """The ``speculative_config`` that runs ``drafter`` (from :func:`make_drafter`)."""
    require()
    from tensorrt_llm.llmapi import UserProvidedDecodingConfig

    return UserProvidedDecodingConfig(max_draft_len=max_draft_len, drafter=drafter)


def pad_point_masses(logits: torch.Tensor, width: int) -> torch.Tensor:
    """Draft logits [n, V] → [width, V]: each added row a point mass at token 0 (0 there,
    −inf elsewhere), the log q of the padding token TensorRT-LLM would add."""
    n, vocab = logits.shape
    if n >= width:
        return logits
    pad = torch.full((width - n, vocab), -math.inf, device=logits.device, dtype=logits.dtype)
    pad[:, 0] = 0.0
    return torch.cat([logits, pad])


def log_q(tokens: Sequence[int], q: torch.Tensor | None, vocab_size: int, device: Any = None
          ) -> torch.Tensor:
    """Draft logits [D, vocab_size] on ``device`` whose softmax is q: log q (zeros, and ids
    past q's width, → −inf), or the one-hot of each point-mass token (0 at the token, −inf
    elsewhere)."""
    if q is not None:
        q = q.float()[: len(tokens)]
        if q.shape[-1] > vocab_size:
            if q[:, vocab_size:].sum() > 0:
                raise ValueError(f"q has mass past the target's {vocab_size} logits")
            q = q[:, :vocab_size]
        out = torch.nn.functional.pad(torch.log(q), (0, vocab_size - q.shape[-1]),
                                      value=-math.inf)
    else:
        out = torch.full((len(tokens), vocab_size), -math.inf)
        out[torch.arange(len(tokens)), torch.tensor(list(tokens))] = 0.0
    return out.to(device) if device is not None else out
