"""The cost curve: what scoring T new tokens per row costs a Runner, and a draft's one step.

``trtspec build`` (torch backend) measures it once and keeps it in the manifest
(``cost_curve``); the adaptive draft length (:mod:`trtspec.spec.adaptive`) reads it as
t(T) / t(1) for T = 1 … K + 1 and t_draft / t(1). A build without one (older trtspec) is
measured when eval or serve starts; models that are not timed honestly (the toy backend) use
:func:`fallback`: t(T) = 1 + 2 % per extra token, t_draft 0.1 for a draft model.

The round cost (``rounds``): what one scoring call costs as a function of rows and width, for
B = 1 … max_batch_size rows × W = 1 … K + 1 tokens each, measured the same way on a batch of
max_batch_size rows (the first B scored, as the scheduler's slots are): the batch-aware
chooser's t(B, W) (:class:`~trtspec.spec.round_cost.RoundCost`), and where padding pays.

Measuring: one row is prefilled with a prompt of ``context`` tokens, then ``score`` calls of T
tokens, each rolled back so every call sees the same context, round-robin over T (and the
drafts): one warm-up round, five timed; the fastest is kept (ms). Another process sharing
the machine only ever adds time, so the minimum is the estimate it disturbs least (a median
measured on a busy 2-core machine swung t(5)/t(1) between 2 and 6).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from trtspec.spec.adaptive import AdaptiveDraft
from trtspec.spec.round_cost import RoundCost

MODEL_FREE = ("ngram", "suffix")  # proposers that run no model: t_draft = 0
FALLBACK_SLOPE, FALLBACK_DRAFT = 0.02, 0.1
ROUND_CONTEXT = 128  # tokens per row when the round cost is measured


class CostCurve(BaseModel):
    """As the manifest keeps it: milliseconds per call, measured on one device."""

    model_config = ConfigDict(extra="forbid")

    target: dict[int, float] = Field(description="T → fastest ms of scoring T new tokens in one "
                                     "row of the target")
    draft: dict[str, float] = Field(default_factory=dict, description="method → fastest ms of "
                                    "one draft step (draft_model, layer_skip)")
    device: str = ""
    context: int = 0  # tokens in the row when measured
    rounds: dict[int, dict[int, float]] = Field(
        default_factory=dict, description="B → W → fastest ms of one scoring call of W new "
        "tokens in each of B rows (a batch of max_batch_size rows, the first B scored)")
    rounds_seconds: float | None = Field(default=None, description="what measuring `rounds` "
                                         "took at build, s")

    @field_validator("rounds")
    @classmethod
    def _a_table(cls, rounds: dict[int, dict[int, float]]) -> dict[int, dict[int, float]]:
        if rounds:
            RoundCost(rounds)  # raises what is wrong with it
        return rounds

    def round_cost(self) -> RoundCost | None:
        """The batch-aware chooser's t(B, W), or None (a build by an older trtspec)."""
        return RoundCost(self.rounds) if self.rounds else None

    def relative(self, method: str) -> tuple[list[float], float | None]:
        """(t(T)/t(1) for the measured T, t_draft/t(1)); t_draft is None when the method
        drafts with a model whose step was not measured."""
        ms = [self.target[t] for t in sorted(self.target)]
        ts = [t / ms[0] for t in ms]
        if method in MODEL_FREE:
            return ts, 0.0
        draft = self.draft.get(method)
        return ts, None if draft is None else draft / ms[0]


def fallback(max_tokens: int, method: str) -> tuple[list[float], float]:
    """t(T) = 1 + 2 % per extra token; t_draft 0 for model-free methods, else 0.1."""
    return ([1 + FALLBACK_SLOPE * (t - 1) for t in range(1, max_tokens + 1)],
            0.0 if method in MODEL_FREE else FALLBACK_DRAFT)


def time_score(runners: dict[str, Any], lengths: dict[str, list[int]], context: int = 64,
               warmup: int = 1, repeats: int = 5) -> dict[str, dict[int, float]]:
    """name → T → fastest ms of ``runner.score`` of T new tokens (T in ``lengths[name]``) in a
    live row of ``context`` tokens, each call rolled back. The calls go round-robin over every
    (runner, T), ``warmup`` rounds untimed then ``repeats`` timed, so a machine that slows down
    meanwhile slows every T alike."""
    times: dict[str, dict[int, list[float]]] = {n: {t: [] for t in lengths[n]} for n in runners}
    for runner in runners.values():
        vocab = runner.vocab_size
        runner.prefill([[(7 * i + 3) % vocab for i in range(context)]])
    for i in range(warmup + repeats):
        for name, runner in runners.items():
            for t in lengths[name]:
                feed = [[(11 * j + 5) % runner.vocab_size for j in range(t)]]
                start = time.perf_counter()
                _sync(runner.score(feed))
                if i >= warmup:
                    times[name][t].append((time.perf_counter() - start) * 1e3)
                runner.rollback([context])
    return {n: {t: min(v) for t, v in per.items()} for n, per in times.items()}


def round_rows(rows: int) -> list[int]:
    """The row counts the round cost is measured at: 1 … 8, then powers of two, and ``rows``
    (between them :class:`~trtspec.spec.round_cost.RoundCost` interpolates)."""
    return sorted({*range(1, min(rows, 8) + 1), *(2 ** i for i in range(4, rows.bit_length())),
                   rows})


def measure_rounds(runner: Any, rows: int, widths: int, context: int = 64, warmup: int = 1,
                   repeats: int = 5) -> dict[int, dict[int, float]]:
    """B → W → fastest ms of ``runner.score`` of W new tokens in each of the first B of
    ``rows`` live rows of ``context`` tokens (B in :func:`round_rows`, W = 1 … widths), each
    call rolled back; round-robin over every (B, W), ``warmup`` rounds untimed, then
    ``repeats``."""
    vocab = runner.vocab_size
    runner.prefill([[(7 * i + 3 + b) % vocab for i in range(context)] for b in range(rows)])
    cells = [(b, w) for b in round_rows(rows) for w in range(1, widths + 1)]
    times: dict[tuple[int, int], list[float]] = {c: [] for c in cells}
    for i in range(warmup + repeats):
        for b, w in cells:
            feed = [[(11 * j + 5 + r) % vocab for j in range(w)] for r in range(b)]
            start = time.perf_counter()
            _sync(runner.score(feed + [[]] * (rows - b)))
            if i >= warmup:
                times[b, w].append((time.perf_counter() - start) * 1e3)
            runner.rollback([context] * rows)
    return {b: {w: min(times[b, w]) for w in range(1, widths + 1)} for b in round_rows(rows)}


def _sync(logits: Any) -> None:
    if getattr(logits, "is_cuda", False):
        import torch

        torch.cuda.synchronize(logits.device)


def measure(target: Any, max_tokens: int, drafts: dict[str, Any] | None = None,
            context: int = 64, repeats: int = 5) -> CostCurve:
    """The curve of a target Runner for T = 1 … max_tokens and of each draft Runner's one
    step (``drafts``: method → Runner), from the median of ``repeats`` timings."""
    drafts = drafts or {}
    runners = {"": target, **drafts}
    lengths = {"": list(range(1, max_tokens + 1)), **{m: [1] for m in drafts}}
    ms = time_score(runners, lengths, context, repeats=repeats)
    return CostCurve(target=ms[""], draft={m: ms[m][1] for m in drafts},
                     device=str(getattr(target, "device", "")), context=context)


_MEASURED: dict[tuple[int, str, int], tuple[list[float], float]] = {}
_SAID: set[str] = set()


def chooser(method: str, max_draft_len: int, curve: CostCurve | None = None,
            target: Any = None, draft: Any = None, say: Callable[[str], None] = print,
            slots: int | None = None, **knobs: Any) -> AdaptiveDraft:
    """An :class:`AdaptiveDraft` for ``method`` with cap K = ``max_draft_len``. Costs come
    from ``curve`` (the manifest's; batch-aware with its round cost); without one, from timing
    the ``target`` Runner (and the ``draft`` Runner of a draft model or layer skip) now, once
    per process and model (each request choosing alone unless ``curve`` has a round cost);
    with neither, from :func:`fallback` (batch-aware on its linear round cost, up to 64 rows).
    What is not the build's is said once, and so are ``slots`` past the rows measured."""
    costs, step = curve.relative(method) if curve is not None else (None, None)
    rounds = curve.round_cost() if curve is not None else None  # measured: always used
    if rounds is not None and slots is not None and slots > max(curve.rounds):
        _say_once(say, f"the round cost was measured up to {max(curve.rounds)} rows; {slots} "
                  "slots: rows past it are costed in proportion (`trtspec build --force` with "
                  "this limits.max_batch_size measures them)")
    if costs is not None and step is None:  # heads: the build times no draft step of theirs
        _say_once(say, f"the build timed no {method} draft step: the adaptive draft length "
                  f"assumes {FALLBACK_DRAFT:g} t(1) per draft token, with the measured t(T)")
        step = FALLBACK_DRAFT
    if costs is not None and step is not None:
        if rounds is None:
            _say_once(say, "the build has no round-cost table (built by an older trtspec): the "
                      "adaptive draft length is chosen per request, blind to the batch; "
                      "`trtspec build --force` for the batch-aware choice")
        return AdaptiveDraft(max_draft_len, costs, step, round_cost=rounds,  # measured: its
                             **{"timed": True, **knobs})  # rounds in service correct it
    if target is None:
        _say_once(say, "no cost curve for these models: the adaptive draft length assumes "
                  f"t(B, T) = 1 + {FALLBACK_SLOPE:g}·(B·T − 1) and a draft step of "
                  f"{FALLBACK_DRAFT:g} t(1) (0 for {', '.join(MODEL_FREE)})")
        return AdaptiveDraft(max_draft_len, *fallback(max_draft_len + 1, method),
                             round_cost=rounds or RoundCost.linear(FALLBACK_SLOPE, 64,
                                                                   max_draft_len + 1), **knobs)
    key = (id(target), method, max_draft_len)  # one target runner per process (build/open.py)
    if key not in _MEASURED:
        _say_once(say, "no cost curve from a build (one built by an older trtspec has none): "
                  "timing the models now for the adaptive draft length (chosen per request)")
        costs, step = measure(target, max_draft_len + 1,
                              {method: draft} if draft is not None else None).relative(method)
        _MEASURED[key] = (costs, FALLBACK_DRAFT if step is None else step)
    return AdaptiveDraft(max_draft_len, *_MEASURED[key], round_cost=rounds, **knobs)


def _say_once(say: Callable[[str], None], text: str) -> None:
    if text not in _SAID:
        _SAID.add(text)
        say(text)
