"""What speculation costs in GPU memory, and the concurrency it gives up for it.

A GPU holds the weights and, per running sequence, a KV cache sized for ``limits.max_seq_len``
tokens. Speculation adds the draft's weights and its own KV cache, plus per sequence the
extra verified positions and their logits; what is left fits fewer sequences. A speedup at
c = 1 is worth less if the same memory served more requests without speculation.

Terms (bytes):

* **dtype bytes**     per weight / KV element: float32 4, float16 and bfloat16 2, fp8 1 (its KV
                      cache stays 2: fp8 weights do not make an fp8 cache); ``auto``: bfloat16
                      with a GPU profile, float32 without
* **params**          counted from the checkpoint's safetensors headers when present, else from
                      config.json: embeddings vocab × hidden (twice unless
                      ``tie_word_embeddings``), per layer attention hidden × (heads + 2 ·
                      kv_heads) × head_dim + heads × head_dim × hidden, gated MLP 3 × hidden ×
                      intermediate, two norms 2 × hidden; a final norm hidden
* **KV per token**    2 (K and V) × layers × kv_heads × head_dim × dtype bytes
* **verify extras**   per running sequence with draft length D: the KV of D positions beyond
                      max_seq_len (target and draft) and the logits of D + 1 verified positions,
                      (D + 1) × vocab × 4 (float32), against 1 × vocab × 4 without speculation
* **fits**            ⌊(GPU memory × count × (1 − min_gpu_memory_headroom) − weights) / bytes
                      per sequence⌋, bytes per sequence = max_seq_len × KV per token (target
                      and draft) + the extras
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "fp8": 1}
LOGIT_BYTES = 4  # logits are float32
GIB = 2 ** 30


@dataclass
class ModelSize:
    """One model's weights and KV cache per token; ``shared``: it reuses the target's."""

    name: str
    params: int
    weight_bytes: int
    kv_bytes_per_token: int
    layers: int
    kv_heads: int
    head_dim: int
    vocab: int
    counted: str  # "safetensors", "config.json", or "shared with the target"


@dataclass
class MethodMemory:
    """The memory of one method at draft length ``d`` against plain decoding."""

    method: str
    d: int
    draft: ModelSize | None  # None: no draft model (n-gram, suffix)
    per_sequence_baseline: int
    per_sequence_spec: int
    fits_baseline: int | None  # None: no GPU profile
    fits_spec: int | None
    note: str = ""


def dtype_bytes(dtype: str, on_gpu: bool) -> tuple[int, int]:
    """(weight bytes, KV bytes) per element of a recipe dtype."""
    if dtype == "auto":
        dtype = "bfloat16" if on_gpu else "float32"
    weight = DTYPE_BYTES.get(dtype, 2)
    return weight, max(weight, 2)


def config_params(cfg: dict[str, Any]) -> int:
    """Parameters of a Llama-shaped decoder from its config.json (see the module docstring)."""
    hidden, layers = cfg["hidden_size"], cfg["num_hidden_layers"]
    heads = cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads", heads)
    head_dim = cfg.get("head_dim") or hidden // heads
    vocab = cfg["vocab_size"]
    attention = hidden * (heads + 2 * kv_heads) * head_dim + heads * head_dim * hidden
    mlp = 3 * hidden * cfg["intermediate_size"]
    embeddings = vocab * hidden * (1 if cfg.get("tie_word_embeddings") else 2)
    return embeddings + layers * (attention + mlp + 2 * hidden) + hidden


def safetensors_params(folder: Path) -> int | None:
    """Parameters counted from every ``*.safetensors`` header in ``folder`` (None: none)."""
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        return None
    total = 0
    for f in files:
        with f.open("rb") as fh:
            (size,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(size))
        total += sum(math.prod(t["shape"]) for k, t in header.items() if k != "__metadata__")
    return total


def model_size(name: str, folder: str | Path, weight_bytes: int, kv_bytes: int,
               layers: int | None = None) -> ModelSize | None:
    """A model's size from its HF-layout folder (None: no config.json there). ``layers``
    overrides the config's (a layer-skip draft keeps the first ``layers``)."""
    path = Path(folder)
    if not (path / "config.json").is_file():
        return None
    cfg = json.loads((path / "config.json").read_text())
    cfg = cfg.get("text_config", cfg)
    counted = safetensors_params(path)
    params = counted if counted is not None else config_params(cfg)
    heads = cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads", heads)
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    n = layers or cfg["num_hidden_layers"]
    return ModelSize(name, params, params * weight_bytes, 2 * n * kv_heads * head_dim * kv_bytes,
                     n, kv_heads, head_dim, cfg["vocab_size"],
                     "safetensors" if counted is not None else "config.json")


def fits(free: float | None, per_sequence: int) -> int | None:
    return None if free is None else max(0, int(free // per_sequence))


def memory_cost(manifest: dict[str, Any], recipe: Any, draft_lengths: dict[str, int]
                ) -> dict[str, Any]:
    """decision["memory"]: the target, per method its draft and the concurrency that fits at
    ``limits.max_seq_len`` with and without speculation; ``draft_lengths``: method → the D
    deployed (methods not in it were not measured and are left out). A one-line ``error``
    when the manifest names no target folder with a config.json."""
    from trtspec.build.gpu import profile

    gpu_name = recipe.gpu.name if recipe.gpu.name != "auto" else \
        (manifest.get("gpu") or {}).get("name")
    try:
        gpu = profile(gpu_name) if gpu_name else None
    except ValueError:
        gpu = None
    target_in = manifest.get("build_inputs", {}).get("target", {})
    weight_b, kv_b = dtype_bytes(target_in.get("dtype", recipe.target.dtype), gpu is not None)
    artifacts = manifest.get("artifacts", [])
    path = next((a["path"] for a in artifacts if a["role"] == "target"), None)
    target = model_size("target", path, weight_b, kv_b) if path else None
    if target is None:
        return {"error": "no target config.json at the manifest's target path: memory cost "
                         "not computed"}
    limits = recipe.limits
    gpu_bytes = gpu.memory_gib * GIB * recipe.gpu.count if gpu else None
    usable = gpu_bytes * (1 - recipe.decide.min_gpu_memory_headroom) if gpu_bytes else None
    base_seq = limits.max_seq_len * target.kv_bytes_per_token + target.vocab * LOGIT_BYTES
    rows = []
    for method in (m for m in recipe.methods if m.method in draft_lengths):  # measured ones
        name, d = method.method, draft_lengths[method.method]
        draft, note = _draft(name, method, artifacts, weight_b, kv_b, target)
        draft_kv = draft.kv_bytes_per_token if draft else 0
        spec_seq = ((limits.max_seq_len + d) * (target.kv_bytes_per_token + draft_kv)
                    + (d + 1) * target.vocab * LOGIT_BYTES)
        weights = target.weight_bytes + (draft.weight_bytes if draft and draft.counted !=
                                         "shared with the target" else 0)
        rows.append(MethodMemory(name, d, draft, base_seq, spec_seq,
                                 fits(usable - target.weight_bytes if usable else None,
                                      base_seq),
                                 fits(usable - weights if usable else None, spec_seq), note))
    return {"gpu": gpu.name if gpu else None, "gpu_bytes": gpu_bytes,
            "headroom": recipe.decide.min_gpu_memory_headroom,
            "max_seq_len": limits.max_seq_len, "weight_dtype_bytes": weight_b,
            "kv_dtype_bytes": kv_b, "target": asdict(target),
            "methods": [asdict(r) for r in rows],
            "note": None if gpu else "no GPU profile: memory section shows bytes only"}


def _draft(name: str, method: Any, artifacts: list[dict[str, Any]], weight_b: int, kv_b: int,
           target: ModelSize) -> tuple[ModelSize | None, str]:
    """The draft's size for a method, and a note on how it was found."""
    if name in ("ngram", "suffix"):
        return None, "drafts from text: no draft weights or KV"
    if name == "layer_skip":  # the target's first layers, over the target's own KV cache
        return ModelSize("layer_skip", 0, 0, 0, method.layers, target.kv_heads,
                         target.head_dim, target.vocab, "shared with the target"), \
            "the target's first layers: weights and KV cache shared with the target"
    roles = [a for a in artifacts if a["role"] in ("draft", "heads")
             and (a["name"].startswith(name) or (name == "draft_model" and a["role"] == "draft"))]
    for a in roles:
        size = model_size(a["name"], a["path"], weight_b, kv_b)
        if size is not None:
            return size, ""
    return None, f"{name}: no draft config.json in the manifest: its memory is not counted"


def equal_memory(mem: dict[str, Any], throughput: dict[str, Any]) -> list[str]:
    """Throughput at equal memory, per method: spec at its largest fitting concurrency against
    the baseline at its own, from the eval's measured tokens/s (never extrapolated)."""
    lines = []
    for m in mem.get("methods", []):
        if m["fits_spec"] is None:
            continue
        spec = _measured(throughput, m["method"], m["d"], m["fits_spec"], "spec")
        base = _measured(throughput, m["method"], None, m["fits_baseline"], "baseline")
        if spec is None or base is None:
            missing = [f"{arm} at c = {c}" for arm, c, x in (
                ("spec", m["fits_spec"], spec), ("baseline", m["fits_baseline"], base))
                if x is None]
            lines.append(f"- {m['method']}: not measured ({', '.join(missing)}): throughput at "
                         "equal memory needs those levels in eval.concurrency.")
        else:
            lines.append(f"- {m['method']}: spec {spec:.1f} tokens/s at c = {m['fits_spec']} "
                         f"vs baseline {base:.1f} tokens/s at c = {m['fits_baseline']} "
                         f"({spec / base:.2f}×).")
    return lines


def _measured(throughput: dict[str, Any], method: str, d: int | None, c: int | None, arm: str
              ) -> float | None:
    from trtspec.analysis.records import condition_parts

    for key, arms in throughput.items():
        m, dk, ck = condition_parts(key)
        if m == method and ck == c and (d is None or dk == d) and arm in arms:
            return arms[arm]["tokens_per_s"]
    return None


def _size(n: float | None) -> str:
    if n is None:
        return "—"
    for unit, scale in (("GiB", GIB), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} B"


def markdown_lines(mem: dict[str, Any] | None, throughput: dict[str, Any] | None) -> list[str]:
    """The report's "Memory cost" section."""
    if not mem:
        return []
    lines = ["## Memory cost", ""]
    if "error" in mem:
        return lines + [mem["error"] + "."]
    t = mem["target"]
    gpu = (f"{mem['gpu']}, {_size(mem['gpu_bytes'])} with {100 * mem['headroom']:.0f} % kept "
           "free" if mem["gpu"] else mem["note"])
    lines += [f"At max_seq_len {mem['max_seq_len']} ({gpu}). Target: {t['params'] / 1e6:.1f} M "
              f"params ({t['counted']}), weights {_size(t['weight_bytes'])}, KV "
              f"{_size(t['kv_bytes_per_token'])}/token. Per sequence: max_seq_len × KV/token "
              "(target + draft) + D extra positions + (D + 1) × vocab × 4 B of logits.", "",
              "| method | D | draft weights | draft KV/token | per sequence: plain | "
              "with speculation | fits: plain | with speculation | lost |",
              "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for m in mem["methods"]:
        dr = m["draft"]
        lost = "—" if m["fits_baseline"] is None else str(m["fits_baseline"] - m["fits_spec"])
        lines.append(f"| {m['method']} | {m['d']} | {_size(dr['weight_bytes']) if dr else '0 B'} "
                     f"| {_size(dr['kv_bytes_per_token']) if dr else '0 B'} | "
                     f"{_size(m['per_sequence_baseline'])} | {_size(m['per_sequence_spec'])} | "
                     f"{m['fits_baseline'] if m['fits_baseline'] is not None else '—'} | "
                     f"{m['fits_spec'] if m['fits_spec'] is not None else '—'} | {lost} |")
    notes = [f"{m['method']}: {m['note']}" for m in mem["methods"] if m["note"]]
    if notes:
        lines += ["", "Notes: " + "; ".join(notes) + "."]
    if mem["gpu"]:
        lines += ["", "Throughput at equal memory (each arm at the concurrency its memory "
                  "fits):", *equal_memory(mem, throughput or {})]
    return lines


def eval_memory(out: Path, recipe: Any, decision: dict[str, Any]) -> dict[str, Any]:
    """decision["memory"] for an eval folder (its ``manifest.json``), each method at the D it
    would deploy: its schedule's D at the lowest level, else the largest D it measured."""
    path = Path(out) / "manifest.json"
    if not path.is_file():
        return {"error": "no manifest.json in the eval folder: memory cost not computed"}
    from trtspec.analysis.records import condition_parts

    plans = (decision.get("crossover") or {}).get("schedules", {})
    measured: dict[str, list[int]] = {}
    for v in decision["verdicts"]:
        method, d, _ = condition_parts(v["condition"])
        measured.setdefault(method, []).extend([d] if isinstance(d, int) else [])
    deploy = {}
    for method, ds in measured.items():
        go = [d for _, d in plans.get(method, {}).get("schedule", []) if isinstance(d, int) and d]
        best = decision["apply_where"].get(method, {}).get("best_d", {})
        first = [v[0] for _, v in sorted(best.items(), key=lambda kv: int(kv[0][1:]))
                 if isinstance(v[0], int)]
        deploy[method] = (go or first or [max(ds, default=0)])[0]
    try:
        return memory_cost(json.loads(path.read_text()), recipe, deploy)
    except (OSError, ValueError, KeyError, TypeError) as e:
        return {"error": f"memory cost not computed ({type(e).__name__}: {e})"}
