"""TensorRT-LLM's own batch, request by request (``backend.mode`` native and drafter): one
LLM per arm (:class:`LlmArm`), each request streamed through
``generate_async(streaming=True)`` and read by a :class:`Stream`.

Apart from :mod:`trtspec.runtime.trtllm` so that importing it (the server, eval and audit
do, for every backend) never imports ``tensorrt_llm``: only a request started here does,
through :func:`~trtspec.runtime.trtllm.require`.

Terms:

* **step**      one streamed response of a request: its first is the context phase (one
                token), each later one an iteration's tokens (the drafts it kept and one more).
                ``stream_interval`` is left at 1, TensorRT-LLM's default (make_llm drops it
                from options), so every iteration is a step. A step's accepted drafts are its
                tokens less one (a lower bound on the last, which max_tokens or a stop may
                cut): the per-request counters come from these increments, since 1.2's
                per-request perf metrics leave speculative decoding's at zero on the PyTorch
                workflow. How many drafts were *proposed* to a request is not reported per
                request, so those counters stay unknown (``SpecStats.record_step``).
"""

from __future__ import annotations

import secrets
import threading
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any

SEED_LIMIT = 2**64  # TensorRT-LLM's seeds are uint64


def llm_sampling(params: Any, stops: Collection[int]) -> Any:
    """trtspec's sampling (spec.sample.probs.SamplingParams) as TensorRT-LLM's.

    Temperature 0 is greedy in both; top-k 0 and top-p 1 are "off" (None there). ``stops``
    (the request's stop ids and, unless it ignores EOS, every EOS id) go to
    ``stop_token_ids`` with ``include_stop_str_in_output``, and TensorRT-LLM's own EOS
    (``end_id``, the tokenizer's) is switched off with ``ignore_eos``: so a request ends
    where trtspec's would, on any of its stop ids, and whether the stop token comes back is
    one rule, not two (the server drops a trailing stop token's text either way). A request
    without a seed gets a random one: TensorRT-LLM would give every such request the same."""
    from trtspec.runtime.trtllm import require

    trt = require()
    greedy = params.temperature == 0
    return trt.SamplingParams(
        max_tokens=params.max_tokens, temperature=0.0 if greedy else params.temperature,
        top_k=params.top_k or None, top_p=params.top_p if params.top_p < 1 else None,
        seed=params.seed if params.seed is not None else secrets.randbits(63),
        stop_token_ids=sorted(stops) or None, include_stop_str_in_output=True,
        ignore_eos=True, detokenize=False)


# TensorRT-LLM's finish reasons in trtspec's words ("timeout": a request past its deadline,
# ended by the server like a cancel); any other value is an error, never a normal finish
FINISH = {"stop": "stop", "length": "length", "cancelled": "abort", "timeout": "abort"}


@dataclass(frozen=True)
class Step:
    """A request's streamed step (module docstring): the tokens it added and, on the last,
    why it ended (trtspec's names: stop, length, abort; error with ``error`` set)."""

    token_ids: list[int]
    finish_reason: str | None = None
    error: str | None = None


class Stream:
    """One request on ``generate_async(streaming=True)``, read on a thread of its own (the
    LLM API's results iterate synchronously, blocking for each response); every step goes
    to ``on_step``, the last with a finish reason, whatever happens."""

    def __init__(self, llm: Any, prompt: Sequence[int], sampling: Any,
                 on_step: Callable[[Step], None]) -> None:
        self.on_step = on_step
        self._result = llm.generate_async(list(prompt), sampling, streaming=True)
        self._thread = threading.Thread(target=self._read, name="trtspec-llmapi-stream",
                                        daemon=True)
        self._thread.start()

    def _read(self) -> None:
        try:
            for result in self._result:
                out = result.outputs[0]
                finish = None
                if result.finished:
                    finish = FINISH.get(str(out.finish_reason), "error")
                    if finish == "error":
                        self.on_step(Step(list(out.token_ids_diff), "error",
                                          f"finished with reason {out.finish_reason!r}"))
                        return
                self.on_step(Step(list(out.token_ids_diff), finish))
                if finish is not None:
                    return
            self.on_step(Step([], "abort"))  # ended without a finished response
        except Exception as e:  # the request failed in TensorRT-LLM: this request only
            text = str(e).strip().splitlines()[0] if str(e).strip() else ""
            self.on_step(Step([], "error", f"{type(e).__name__}: {text}"))

    def abort(self) -> None:
        """Ask TensorRT-LLM to end the request (its last step then says abort)."""
        self._result.abort()


@dataclass
class LlmArm:
    """One LLM API instance an arm runs on: plain decoding (``mode`` None), TensorRT-LLM's
    own speculation (native) or trtspec's drafter in its batch (drafter).

    ``draft_len`` is the most drafts an iteration verifies (0: plain); ``eos_token_ids`` end
    a request as on the torch backend; ``vocab_size`` bounds a prompt's ids; ``forget``
    (drafter mode) clears what the drafter learnt from earlier requests (a suffix tree), as
    an executor's proposer does after an eval's warm-up."""

    llm: Any
    method: str
    draft_len: int
    eos_token_ids: frozenset[int]
    vocab_size: int
    mode: str | None = None  # None, "native" or "drafter"
    decoding_type: str | None = None
    forget: Callable[[], None] | None = None

    def stops(self, params: Any) -> frozenset[int]:
        """The ids that end a request with these params (as SpecExecutor.stops)."""
        ids = frozenset(params.stop_token_ids)
        return ids if params.ignore_eos else ids | self.eos_token_ids

    def check(self, prompt: Sequence[int], params: Any) -> None:
        """ValueError (the client's 400) for what TensorRT-LLM would fail on later: an empty
        prompt, an id outside the vocabulary, a seed outside uint64."""
        if not prompt:
            raise ValueError("the prompt is empty: give at least one token")
        bad = [t for t in prompt if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary (0 … "
                             f"{self.vocab_size - 1})")
        if params.seed is not None and not 0 <= params.seed < SEED_LIMIT:
            raise ValueError(f"seed {params.seed} is out of range: 0 ≤ seed < 2^64")

    def start(self, prompt: Sequence[int], params: Any, on_step: Callable[[Step], None]
              ) -> Stream:
        """Send one request to the LLM; its steps go to ``on_step`` (another thread)."""
        return Stream(self.llm, prompt, llm_sampling(params, self.stops(params)), on_step)

    def shutdown(self) -> None:
        """Free the LLM (its KV cache and workers)."""
        shutdown = getattr(self.llm, "shutdown", None)
        if shutdown is not None:
            shutdown()
