"""TensorRT-LLM's speculative options in each release's own names and forms.

Build plans (the llm-api YAML), the schedules ``decide`` writes and the native mode's config all
come from here, so one release's spelling is written in one place. Read from
``tensorrt_llm/llmapi/llm_args.py`` (``DecodingBaseConfig`` and its subclasses) of the 1.2 line
and of later mains; where the two differ:

================  ===============================  ====================================
                  1.2.x (``RELEASE``)              1.3 and later (PyTorch workflow)
================  ===============================  ====================================
draft model       ``Draft_Target``                 ``DraftTarget``
EAGLE-3           ``Eagle3`` (``Eagle`` converted  ``Eagle3``
                  with a warning on pytorch)
EAGLE-1/2         ``Eagle`` (engine workflow)      none
Medusa            ``Medusa`` (engine workflow)     none
MTP draft length  ``num_nextn_predict_layers``     the same
schedule          ``draft_len_schedule`` keys are  keys are upper bounds (D = 0 past
                  lower bounds, ``1: max_draft_    the last), PR #10860; exclusive with
                  len`` required                   ``max_concurrency``
T > 0             one-model paths (Eagle3 one-     ``use_rejection_sampling: true``
                  model, MTP) need ``allow_
                  advanced_sampling: true``
================  ===============================  ====================================

``speculative_model_dir`` is an alias of ``speculative_model`` in both: trtspec writes
``speculative_model``.

Terms: a **schedule** is ``[(n, D), …]`` by increasing n: up to n running requests draft D
tokens, above the last n none (see trtspec.analysis.schedules).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

RELEASE = "1.2.1"  # the newest TensorRT-LLM on the package index
ONE_MODEL = ("Eagle3", "MTP")  # draft inside the target's forward: greedy unless told


def at_least(release: str, major: int, minor: int) -> bool:
    """Whether a release string like "1.3.0rc2" is ≥ major.minor."""
    parts = [int("".join(ch for ch in p if ch.isdigit()) or 0) for p in release.split(".")[:2]]
    return tuple(parts + [0] * (2 - len(parts))) >= (major, minor)


def decoding_type(method: Any, release: str = RELEASE, workflow: str | None = None
                  ) -> str | None:
    """``speculative_config.decoding_type`` for a recipe method (None: no TensorRT-LLM form);
    ``workflow`` None: whichever workflow of ``release`` runs it."""
    newer = at_least(release, 1, 3)
    match method.method:
        case "draft_model":
            return "DraftTarget" if newer else "Draft_Target"
        case "ngram":
            return "NGram"
        case "eagle":
            if method.version == 3:
                return "Eagle3"
            return None if newer or workflow == "pytorch" else "Eagle"
        case "medusa":
            return None if newer or workflow == "pytorch" else "Medusa"
        case "mtp":
            return "MTP"
    return None


def speculative_config(method: Any, draft_len: int, release: str = RELEASE,
                       temperature: float = 0.0, workflow: str | None = None) -> dict[str, Any]:
    """The ``speculative_config`` mapping of one method at one D, as ``release`` spells it.
    ValueError where the release has no form for the method."""
    decoding = decoding_type(method, release, workflow)
    if decoding is None:
        where = f" on the {workflow} workflow" if workflow else ""
        raise ValueError(f"method {method.method} has no TensorRT-LLM {release} "
                         f"speculative_config{where}")
    config: dict[str, Any] = {"decoding_type": decoding}
    if decoding == "MTP":
        config["num_nextn_predict_layers"] = draft_len  # MTP's D (max_draft_len is derived)
    else:
        config["max_draft_len"] = draft_len
    model = getattr(method, "model", None) or getattr(method, "heads", None)
    if model and decoding != "Medusa":
        config["speculative_model"] = model
    if decoding == "NGram":
        config["max_matching_ngram_size"] = method.max_n
    if decoding == "Medusa":
        config["num_medusa_heads"] = method.num_heads
    if decoding == "Eagle":
        config |= {"num_eagle_layers": method.num_layers,
                   "max_non_leaves_per_layer": method.max_non_leaves_per_layer}
    if temperature > 0:
        config |= sampling_fields(decoding, release)
    return config


def sampling_fields(decoding: str, release: str = RELEASE) -> dict[str, Any]:
    """What ``release`` needs to verify sampled (T > 0) requests by rejection sampling rather
    than ignore the temperature or match tokens."""
    if at_least(release, 1, 3):
        return {"use_rejection_sampling": True}
    return {"allow_advanced_sampling": True} if decoding in ONE_MODEL else {}


def draft_len_schedule(steps: Sequence[tuple[int, int]], release: str = RELEASE
                       ) -> dict[str, Any]:
    """``max_draft_len`` and ``draft_len_schedule`` for a schedule in ``release``'s form.

    1.2.x: keys are the *smallest* batch size from which a D applies, ``1: max_draft_len``
    first, ``n + 1: 0`` after the last level. Later: keys are the *largest* batch size a D
    applies to, D = 0 past the last. ``max_draft_len`` is the first D; later D are clipped to
    it (both releases reject a D above it)."""
    steps = [(int(n), int(d)) for n, d in steps]
    if not steps or steps[0][0] < 1:
        raise ValueError(f"a schedule needs levels from batch size 1: {steps}")
    first = steps[0][1]
    if at_least(release, 1, 3):
        return {"max_draft_len": first, "draft_len_schedule": {n: min(d, first) for n, d in steps}}
    schedule: dict[int, int] = {1: first}
    low, last = 1, first
    for n, d in steps:
        d = min(d, first)
        if d != last:
            schedule[low] = d
        low, last = n + 1, d
    if last != 0:
        schedule[low] = 0
    return {"max_draft_len": first, "draft_len_schedule": schedule}
