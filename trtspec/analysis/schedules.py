"""The eval's decision in each serving stack's own words, written to ``<eval>/schedules/``.

* ``trtspec-policy.yaml``: what ``trtspec serve --policy FILE`` runs (:func:`read_policy`).
* ``trtllm-speculative.yaml``: a ``speculative_config:`` block for ``trtllm-serve --config``
  (one option with ``--extra_llm_api_options``), in the names of the release it names.
* ``vllm-speculative.json``: the JSON of ``vllm serve --speculative-config``, strictly the
  config (JSON has no comments), and ``vllm-speculative.md``: what it leaves out and why.

Terms:

* **schedule**   D per number of running requests (the batch size), ``(n, D)`` by increasing n:
                 up to n running requests draft D tokens; above the last entry D = 0 (plain
                 decoding). The entries are the eval's measured levels where a D was GO and
                 not above its crossover c* (see :mod:`trtspec.analysis.crossover`), trailing zeros
                 dropped: nothing is carried past the last GO level.
* **release**    the version of the stack a snippet targets: option names differ between
                 releases, so every snippet names the release it was written for.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from trtspec.analysis.policy import POLICY, ServePolicy, read_policy, serve_policy, write_policy
from trtspec.build.trtllm_options import RELEASE as TRTLLM_RELEASE
from trtspec.build.trtllm_options import (
    at_least,
    decoding_type,
    draft_len_schedule,
    sampling_fields,
    speculative_config,
)
from trtspec.spec.adaptive import ADAPTIVE

SCHEDULES = "schedules"
TRTLLM, VLLM, VLLM_NOTES = ("trtllm-speculative.yaml", "vllm-speculative.json",
                           "vllm-speculative.md")
VLLM_METHOD = {"ngram": "ngram", "suffix": "suffix", "draft_model": "draft_model",
               "eagle": "eagle3", "medusa": "medusa", "mtp": "mtp"}
INSTEAD = {"layer_skip": "self-speculation from the target's first layers has no equivalent; "
                         "the nearest is a small draft model of the same tokenizer "
                         "(TensorRT-LLM DraftTarget, vLLM draft_model) or EAGLE-3 heads "
                         "trained for the target",
           "suffix": "suffix decoding has no TensorRT-LLM equivalent; the nearest is NGram "
                     "(prompt lookup), or vLLM's method suffix"}


def deploy_schedule(schedule: Any) -> list[tuple[int, int | str]]:
    """The schedule a stack runs (see the module docstring): the measured levels, trailing
    zeros dropped. Nothing is carried past the last level that was GO: between it and c* the
    fit is a point estimate, not a shown speedup."""
    steps = [(int(n), d) for n, d in schedule]
    while steps and steps[-1][1] == 0:
        steps.pop()
    return steps


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 2)


def trtllm_snippet(method: Any, steps: list[tuple[int, int | str]], temperature: float,
                   eval_id: str, release: str = TRTLLM_RELEASE, cap: int = 8,
                   measured_on: str | None = None) -> str:
    """``speculative_config:`` for trtllm-serve at ``release`` (names and forms from
    trtspec.build.trtllm_options); ``method`` is the recipe's method entry, ``steps`` the
    deployed schedule; ``cap`` replaces an adaptive D; ``measured_on`` names the device the
    eval ran on where it is not an NVIDIA GPU (the schedule's levels are that device's)."""
    name = method.method
    lines = [f"# TensorRT-LLM {release}: trtllm-serve MODEL --config FILE (the same option as "
             "--extra_llm_api_options).",
             f"# From trtspec eval {eval_id}. Option names as in TensorRT-LLM {release}, "
             "tensorrt_llm/llmapi/llm_args.py (DecodingBaseConfig and its subclasses)."]
    if measured_on:
        lines.append(f"# Measured on {measured_on}: the batch sizes where speculation pays "
                     "differ on TensorRT-LLM and its GPU. Re-run trtspec eval there before "
                     "deploying.")
    decoding = decoding_type(method, release)
    if decoding is None:
        lines.append(f"# {name}: {INSTEAD.get(name, 'no TensorRT-LLM form in ' + release)}. "
                     "Nothing to configure here.")
        return "\n".join(lines) + "\n"
    if any(d == ADAPTIVE for _, d in steps):
        lines.append(f"# An adaptive D has no TensorRT-LLM form: written as its cap {cap}.")
    steps = [(n, cap if d == ADAPTIVE else int(d)) for n, d in steps]
    first = steps[0][1] if steps else 0
    config = speculative_config(method, first, release, temperature)
    plan = ", ".join(f"≤ {n}: D = {d}" for n, d in steps)
    if steps and decoding != "MTP":
        config |= draft_len_schedule(steps, release)
        form = ("keys are upper bounds, D = 0 past the last (PR #10860)"
                if at_least(release, 1, 3) else
                "keys are the smallest batch size a D applies from; 1: max_draft_len first")
        lines.append(f"# draft_len_schedule: running requests → D ({plan}, plain decoding "
                     f"above); in {release} {form}.")
        if any(d > first for _, d in steps):
            lines.append(f"# Later entries clipped to max_draft_len = {first}.")
    if temperature > 0:
        check = ("`trtspec audit --endpoint URL --baseline-endpoint URL` against the same "
                 "model served plainly")
        fields = ", ".join(sampling_fields(decoding, release)) or "nothing more"
        lines.append(f"# Temperature {temperature}: {fields} set so sampled requests keep the "
                     f"target's distribution; check the server with {check}.")
    if decoding == "Medusa":
        lines.append("# Medusa runs in the engine workflow only (not the pytorch backend).")
    return "\n".join(lines) + "\n" + yaml.safe_dump({"speculative_config": config},
                                                    sort_keys=False)


def vllm_config(method: Any, steps: list[tuple[int, int | str]], cap: int = 8
                ) -> dict[str, Any] | None:
    """The ``--speculative-config`` JSON (None where vLLM has no equivalent): one D, the
    schedule's first (what was chosen at the lowest load)."""
    name = method.method
    if name not in VLLM_METHOD:
        return None
    d = next((cap if x == ADAPTIVE else int(x) for _, x in steps), 0)
    vllm_name = VLLM_METHOD[name] if not (name == "eagle" and method.version != 3) else "eagle"
    config: dict[str, Any] = {"method": vllm_name, "num_speculative_tokens": d}
    model = getattr(method, "model", None) or getattr(method, "heads", None)
    if model:
        config["model"] = model
    if name == "ngram":
        config |= {"prompt_lookup_max": method.max_n, "prompt_lookup_min": method.min_n}
    if name == "suffix":
        config |= {"suffix_decoding_max_tree_depth": method.max_depth,
                   "suffix_decoding_max_spec_factor": method.max_spec_factor,
                   "suffix_decoding_min_token_prob": method.min_token_prob}
    return config


def vllm_notes(method: Any, steps: list[tuple[int, int | str]], eval_id: str,
               max_batch: int) -> str:
    """vllm-speculative.md: what the JSON is, and the per-batch-size schedule it leaves out."""
    name = method.method
    if name not in VLLM_METHOD:
        return (f"# vLLM speculative config (trtspec eval {eval_id})\n\n{name}: "
                f"{INSTEAD[name]}; no vllm-speculative.json was written.\n")
    ranges, low = [], 1
    for n, d in steps:
        ranges.append([low, n, d])
        low = n + 1
    if low <= max_batch:
        ranges.append([low, max_batch, 0])
    return (f"# vLLM speculative config (trtspec eval {eval_id})\n\n"
            "`vllm serve MODEL --speculative-config \"$(cat vllm-speculative.json)\"` drafts "
            "`num_speculative_tokens` tokens at every batch size, also above the last level "
            f"this eval found it GO ({steps[-1][0] if steps else 0} running requests): cap "
            "the server's concurrency there or use the schedule below. Its keys are those of "
            "vLLM's SpeculativeConfig (vllm/config/speculative.py: method, model, "
            "num_speculative_tokens, prompt_lookup_max/min, suffix_decoding_*) in recent "
            "releases; method suffix needs a release with suffix decoding.\n\n"
            "Left out of the JSON: the per-batch-size schedule. Recent vLLM releases accept "
            "`num_speculative_tokens_per_batch_size` (inclusive batch-size ranges [start, end, "
            "K], K = 0: speculation off), but the release that introduced it was not verified "
            "here and its form has changed between versions. Where your vLLM has it, this "
            f"eval's schedule is `{json.dumps(ranges)}`.\n")


def write_schedules(out: str | Path, recipe: Any, decision: dict[str, Any], eval_id: str,
                    trtllm_release: str = TRTLLM_RELEASE) -> list[str]:
    """Write ``<out>/schedules/``: always the trtspec policy; the stack snippets when a method
    is GO. Returns the file names written."""
    from trtspec.build.files import write_atomic

    if any(v["condition"].startswith("endpoint/") for v in decision["verdicts"]):
        return []  # a server's own policy was measured: nothing of trtspec's to deploy
    folder = Path(out) / SCHEDULES
    folder.mkdir(exist_ok=True)
    policy = serve_policy(decision)
    cross = (decision.get("crossover") or {}).get("schedules", {}).get(policy.method)
    c_star = cross["c_star"] if cross and cross.get("where") == "between" else None
    if cross:
        steps = deploy_schedule(cross["schedule"])
        policy = ServePolicy(policy.method, tuple(steps), policy.go_methods)
    else:
        steps = deploy_schedule(policy.schedule)
    if not steps:  # GO nowhere it would deploy: plain decoding, said as such
        policy = ServePolicy("none", (), policy.go_methods)
    crossing = {"c_star": _round(c_star), "ci": [_round(x) for x in cross["c_star_ci"]],
                "where": cross["where"]} if cross and cross.get("where") else None
    manifest = Path(out) / "manifest.json"
    built = json.loads(manifest.read_text()) if manifest.is_file() else {}
    build, gpu = built.get("build_digest"), built.get("gpu") or {}
    measured_on = None if built.get("backend") != "torch" else (
        f"{gpu['name'] if gpu.get('detected') else 'a CPU'} with trtspec's torch backend, not "
        "TensorRT-LLM")
    write_policy(folder / POLICY, policy, eval_id, crossing, build)
    written = [POLICY]
    if policy.method == "none" or not steps:
        return written
    method = next(m for m in recipe.methods if m.method == policy.method)
    cap = recipe.adaptive_cap
    write_atomic(folder / TRTLLM, trtllm_snippet(method, steps,
                                                 recipe.sampling.temperature, eval_id,
                                                 trtllm_release, cap, measured_on))
    written.append(TRTLLM)
    config = vllm_config(method, steps, cap)
    if config is not None:
        write_atomic(folder / VLLM, json.dumps(config, indent=2) + "\n")
        written.append(VLLM)
    write_atomic(folder / VLLM_NOTES, vllm_notes(method, steps, eval_id,
                                                 recipe.limits.max_batch_size))
    written.append(VLLM_NOTES)
    return written


def markdown_lines(written: list[str] | None, decision: dict[str, Any]) -> list[str]:
    """The report's "Deployment schedules" section: the files written and what they say."""
    if not written:
        return []
    policy = decision.get("policy") or {"method": "none", "schedule": []}
    plan = ", ".join(f"{n}: {d}" for n, d in policy["schedule"])
    what = "plain decoding (nothing GO to deploy)" if policy["method"] == "none" else \
        f"{policy['method']}, D by running requests {plan} (plain decoding above)"
    stacks = (" The TensorRT-LLM and vLLM files name the release they were written for and "
              "say what that release cannot express.") if len(written) > 1 else ""
    return ["## Deployment schedules", "",
            f"Written to `{SCHEDULES}/`: {', '.join(f'`{w}`' for w in written)}. The policy "
            f"runs {what}; `trtspec serve --policy {SCHEDULES}/{POLICY}` serves it.{stacks}"]


def deployment(out: Path, recipe: Any, records: list[dict[str, Any]], verdicts: list[Any],
               decision: dict[str, Any]) -> dict[str, Any]:
    """What make_decision adds for a deployment: ``crossover`` (None under 2 levels),
    ``memory`` and ``schedules`` (the file names written to ``<out>/schedules/``)."""
    from trtspec.analysis.crossover import crossover
    from trtspec.analysis.memory import eval_memory

    part: dict[str, Any] = {"crossover": crossover(verdicts, records, recipe.decide,
                                                   recipe.sampling.seed)}
    part["memory"] = eval_memory(out, recipe, decision | part)
    try:
        part["schedules"] = write_schedules(out, recipe, decision | part, Path(out).name)
        if part["schedules"]:  # as serve will read it
            written = read_policy(Path(out) / SCHEDULES / POLICY)
            part["policy"] = {"method": written.method,
                              "schedule": [list(x) for x in written.schedule]}
    except (OSError, ValueError, StopIteration) as e:
        part["schedules"] = []
        part["schedules_error"] = f"schedules not written ({type(e).__name__}: {e})"
    return part


def deployment_lines(decision: dict[str, Any]) -> list[str]:
    """The report's crossover, memory and schedule sections (each only where it applies)."""
    from trtspec.analysis.crossover import markdown_lines as crossover_lines
    from trtspec.analysis.memory import markdown_lines as memory_lines

    lines = [*crossover_lines(decision.get("crossover")), ""]
    lines += [*memory_lines(decision.get("memory"), decision.get("throughput")), ""]
    lines += markdown_lines(decision.get("schedules"), decision)
    if decision.get("schedules_error"):
        lines += ["", "## Deployment schedules", "", decision["schedules_error"] + "."]
    return lines
