"""The header of a decide report: what was measured, on what hardware, by which trtspec (version
and git sha), with which overrides, and the criteria it was judged by, as rows of one table.

A reviewer signs the report; these are the facts the signature rests on, so each comes from a
record (eval.json's provenance and command line, the build's manifest.json, the recipe the
eval ran), and what a folder does not record says "not recorded" rather than a guess.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from trtspec.analysis.decide import Verdict
from trtspec.analysis.extract import SPEEDUP_MEANS
from trtspec.analysis.records import condition_parts
from trtspec.analysis.stats import ALPHA
from trtspec.build.recipe import Recipe


def header_rows(out: Path, recipe: Recipe, records: list[dict[str, Any]],
                verdicts: list[Verdict], sequential: dict[str, Any] | None
                ) -> list[tuple[str, str]]:
    """The report's header, (row, value): what was measured, on what, by which trtspec, with
    which overrides, and the criteria it was judged by: what a reviewer signs, in one table.
    From eval.json (the eval's provenance and command line), the build's manifest.json and
    the recipe the eval ran; what a folder does not record is said to be "not recorded"."""
    from trtspec.build.manifest import versions
    from trtspec.eval.folder import meta_if_any

    meta = meta_if_any(out)
    try:
        manifest = json.loads((out / "manifest.json").read_text())
    except (OSError, ValueError):
        manifest = {}
    manifest = manifest if isinstance(manifest, dict) else {}
    seen = meta.get("provenance") or {}
    hardware = seen.get("hardware")
    c, s = recipe.decide, recipe.sampling
    conditions = [condition_parts(k) for k in sorted({r["condition"] for r in records})]
    measured = list(dict.fromkeys(m for m, _, _ in conditions))
    rows = [("hardware", _hardware_text(hardware, meta, manifest, recipe)),
            ("target model", _target_text(recipe, meta)),
            ("draft (methods)", _methods_text(recipe, measured, manifest)),
            ("conditions measured", _conditions_text(conditions, recipe)),
            ("precision", _precision_text(recipe, measured, hardware, meta)),
            ("sampling", f"temperature {s.temperature:g}"
             + (" (greedy)" if s.temperature == 0 else "")
             + f", top-p {s.top_p:g}" + (" (off)" if s.top_p == 1 else "")
             + f", top-k {s.top_k}" + (" (off)" if s.top_k == 0 else "")
             + f", max_tokens {s.max_tokens}" + (", ignore_eos" if s.ignore_eos else "")
             + f", seed {s.seed}"),
            ("workloads", (", ".join(meta.get("workloads") or recipe.eval.workloads))
             + (f"; {meta['requests']} requests planned" if meta.get("requests") else "")
             + f"; {len({r['request_id'] for r in records})} measured"),
            ("overrides", _overrides_text(out, meta)),
            ("trtspec version", _version_text(seen, manifest, versions()["trtspec"])),
            ("git sha", ("not recorded (an eval from before trtspec recorded it)"
                         if "git_sha" not in seen else
                         "none: the eval's trtspec was not run from a git checkout"
                         if not seen["git_sha"] else f"`{seen['git_sha']}`"
                         + (" with uncommitted changes" if seen.get("git_dirty") else ""))),
            ("primary metric", f"{c.primary_metric}: {SPEEDUP_MEANS[c.primary_metric]}"),
            ("min_speedup", f"{c.min_speedup:.2f}× (GO needs the speedup shown above it)"),
            ("min_requests", f"{c.min_requests} paired requests per cell (fewer: no verdict)"),
            ("significance level α", _significance_text(verdicts, sequential)),
            ("latency gates", f"TTFT tail regression ≤ {100 * c.max_ttft_p99_regression:.0f} "
             f"%, E2E tail regression ≤ {100 * c.max_e2e_p99_regression:.0f} %"),
            ("other gates", "; ".join(
                [f"GPU memory headroom ≥ {100 * c.min_gpu_memory_headroom:.0f} %",
                 "an exactness audit must pass where one applies" if c.require_audit
                 else "no exactness audit required"]
                + (["greedy identity, tie margin " + (
                    f"{c.greedy_tie_margin:g}" if c.greedy_tie_margin is not None else
                    "0.01 in float32, 0.1 in float16, 0.5 in bfloat16")]
                   if s.temperature == 0 else [])))]
    if c.slo is not None:
        rows.append(("SLO", ", ".join(f"{k} ≤ {v:g}" for k, v in c.slo.model_dump().items()
                                      if v is not None)))
    return rows


def _hardware_text(hardware: dict[str, Any] | None, meta: dict[str, Any],
                   manifest: dict[str, Any], recipe: Recipe) -> str:
    """The device the models ran on, from the eval's record, else the build's, else "not
    recorded" (an endpoint's server is not visible to its client)."""
    if hardware:
        if hardware["device"] == "cpu":
            return f"CPU: {hardware['name']} ({hardware['count']} logical CPUs)"
        return f"{hardware['count']} × {hardware['name']} ({hardware['device']})"
    if meta.get("endpoint"):
        return (f"the server at {meta['endpoint']} ({meta.get('server') or 'kind unknown'}): "
                "its hardware is not visible to the client, not recorded")
    gpu = manifest.get("gpu")
    if gpu:
        return (f"{gpu.get('count', 1)} × {gpu['name']} as built (the eval's own device was not "
                "recorded)")
    if recipe.backend.kind == "torch" and recipe.backend.device == "cpu":
        return "CPU (its model was not recorded)"
    return "not recorded"


def _target_text(recipe: Recipe, meta: dict[str, Any]) -> str:
    """The target model: the recipe's (with its parallelism), or what an endpoint served."""
    if meta.get("endpoint"):
        return (f"{meta.get('model') or 'the default model'} served at {meta['endpoint']}"
                + (f", baseline at {meta['baseline_endpoint']}"
                   if meta.get("baseline_endpoint") else ""))
    t = recipe.target
    return t.model + "".join(f", {k} {getattr(t, k)}" for k in ("tp_size", "pp_size")
                             if getattr(t, k) > 1)


def _conditions_text(conditions: list[tuple[str, int | str, int]], recipe: Recipe) -> str:
    """The draft lengths measured per method and the concurrency levels: what the eval ran
    after any narrowing (--set, a build that left a method out)."""
    methods = list(dict.fromkeys(m for m, _, _ in conditions))
    per = "; ".join(f"{m}: D " + ", ".join(str(d) for d in dict.fromkeys(
        d for name, d, _ in conditions if name == m)) for m in methods)
    levels = ", ".join(str(c) for c in sorted({c for *_, c in conditions}))
    rate = recipe.eval.request_rate
    return (f"{per} — at concurrency {levels}" if per else "none") + (
        f", open-loop {rate:g} requests/s" if rate is not None else "")


def _methods_text(recipe: Recipe, measured: list[str], manifest: dict[str, Any]) -> str:
    """Each measured method with the settings that say what drafts (defaults left out), then
    the recipe's methods this eval did not measure, and why where the build says."""
    left_out = {a["name"]: a["flags"]["missing"] for a in manifest.get("artifacts") or []
                if isinstance(a, dict) and "missing" in (a.get("flags") or {})}
    parts = []
    for name in measured:
        method = next((m for m in recipe.methods if m.method == name), None)
        if method is None:
            parts.append(f"{name}: the server's own speculation" if name == "endpoint"
                         else f"{name} (not in the recipe)")
            continue
        settings = {k: v for k, v in method.model_dump(exclude_defaults=True).items()
                    if k != "method"}
        parts.append(name + (f" ({', '.join(f'{k}={v}' for k, v in settings.items())})"
                             if settings else ""))
    missing = [m.method for m in recipe.methods if m.method not in measured]
    if missing and "endpoint" not in measured:
        parts.append("not measured: " + ", ".join(
            f"{m} ({left_out[m]})" if m in left_out else m for m in missing))
    return "; ".join(parts) or "none"


def _precision_text(recipe: Recipe, measured: list[str], hardware: dict[str, Any] | None,
                    meta: dict[str, Any]) -> str:
    """The target's dtype (and a measured draft model's), "auto" resolved as the backend
    resolves it where the device is known."""
    if meta.get("endpoint"):
        return "the server's (not visible to the client)"
    device = (hardware or {}).get("device") or (
        recipe.backend.device if recipe.backend.kind == "torch" else "cuda")

    def resolved(dtype: str) -> str:
        if dtype != "auto":
            return dtype
        if recipe.backend.kind == "trtllm" or device.startswith("cuda"):
            return "bfloat16 (auto)"
        return "auto (device not recorded)" if device == "auto" else "float32 (auto)"

    drafts = [f"draft {m.model} {resolved(m.dtype)}" for m in recipe.methods
              if m.method == "draft_model" and m.method in measured]
    return ", ".join([f"target {resolved(recipe.target.dtype)}", *drafts])


def _overrides_text(out: Path, meta: dict[str, Any]) -> str:
    """The command line that narrowed or changed the recipe for this eval (--set, knobs,
    workloads, --until-decided, --confirm), as eval.json recorded it."""
    from trtspec.eval.folder import stored_selection

    if not meta:
        return "not recorded (no eval.json)"
    flags = [f"`{f}`" for f in stored_selection(out).flags()]
    if meta.get("until_decided"):
        flags.append("`--until-decided`" + (f" `--max-requests {meta['max_requests']}`"
                                            if meta.get("max_requests") else ""))
    if meta.get("confirms"):
        flags.append(f"`--confirm {Path(meta['confirms']).name}`")
    return ", ".join(flags) or "none: the recipe as written"


def _version_text(seen: dict[str, Any], manifest: dict[str, Any], here: str | None) -> str:
    """trtspec's version at the build, the eval and this report (each where recorded)."""
    eval_version = (seen.get("versions") or {}).get("trtspec")
    built = (manifest.get("versions") or {}).get("trtspec")
    parts = [f"eval {eval_version}" if eval_version else "eval: not recorded",
             f"this report {here or 'unknown'}"]
    if built:
        parts.insert(0, f"build {built}")
    others = ", ".join(f"{k} {v}" for k, v in (seen.get("versions") or {}).items()
                       if v and k != "trtspec")
    return " · ".join(parts) + (f" ({others})" if others else "")


def _significance_text(verdicts: list[Verdict], sequential: dict[str, Any] | None) -> str:
    """The speedup tests' error rate: α per direction, the family it is controlled over, and
    the looks it was spent over."""
    families = sorted({(v.alpha, v.family) for v in verdicts if v.family}, reverse=True)
    text = "; ".join(f"{100 * a:.2g} % one-sided per direction, family-wise over {m} cells "
                     "(Holm)" for a, m in families) or \
        f"{100 * ALPHA:.2g} % one-sided per direction (no cell had an interval to test)"
    if sequential:
        text += (f"; spent over {len(sequential.get('looks') or [])} look(s) of "
                 f"--until-decided ({sequential.get('method', 'alpha spending')})")
    return text
