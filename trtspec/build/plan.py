"""recipe + GPU → ordered build steps. Pure: no I/O, no TensorRT-LLM, so every plan is testable.

Engine workflow (TensorRT-LLM 1.2.x): convert_checkpoint + ``trtllm-build`` per engine.

* ``target``       the plain engine: the baseline runs on it.
* ``target-spec``  draft-target / n-gram: ``--speculative_decoding_mode draft_tokens_external
                   --max_draft_len D --use_paged_context_fmha enable --gather_generation_logits``.
* ``draft``        an ordinary engine with ``--gather_generation_logits`` (its logits become q).
* ``medusa`` / ``eagle``  converted with their heads; built with their decoding mode.

PyTorch workflow: one ``extra_llm_api_options`` YAML per method × D (``speculative_config``) for
``trtllm-serve`` / ``trtllm-bench``, plus a baseline YAML without speculation.

Torch backend: resolve / convert checkpoints and check tokenizers (see build/torch.py).

Every plan ends with what to run next (comments, never run by the plan): only commands that
exist, ``trtspec eval`` / ``audit`` / ``decide`` and TensorRT-LLM's ``trtllm-serve``.
"""

from __future__ import annotations

import re
import shlex
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from trtspec.build.gpu import GpuProfile
from trtspec.build.recipe import DraftModel, Eagle, LayerSkip, Medusa, Ngram, Recipe
from trtspec.build.trtllm_options import RELEASE, speculative_config

EXAMPLES = "$TRTLLM_EXAMPLES"  # TensorRT-LLM's examples/ directory (set it on the build machine)
CONVERT = {"llama": "models/core/llama/convert_checkpoint.py"}
EVAL_DIR = "reports/<eval-id>"  # the folder `trtspec eval` prints (placeholder)
BASELINE_PORT, SPEC_PORT = 8000, 8001


@dataclass(frozen=True)
class Step:
    name: str
    kind: str  # "run" (a command), "write" (a file), "prepare" (torch, in-process)
    argv: tuple[str, ...] = ()
    path: str = ""  # for "write"
    content: str = ""  # for "write"
    produces: str = ""  # artifact directory or file
    note: str = ""

    def shell(self) -> str:
        if self.kind == "write":
            return f"mkdir -p {shlex.quote(str(Path(self.path).parent))}\n" \
                   f"cat > {shlex.quote(self.path)} <<'YAML'\n{self.content}YAML"
        if self.kind == "prepare":
            return f"# {self.note}"
        return _join(self.argv)


@dataclass(frozen=True)
class Next:
    """A command to run once the plan has run: printed as a comment, never run by the plan
    (servers run until stopped, and an eval takes its own time)."""

    argv: tuple[str, ...]
    why: str = ""  # a comment printed above it

    def shell(self) -> str:
        lines = [f"# {line}" for line in textwrap.wrap(self.why, 96)]
        return "\n".join(lines + ([f"#   {_join(self.argv)}"] if self.argv else []))


def _join(argv: Sequence[str]) -> str:
    """Quote for bash, leaving $VARS and <placeholders> readable."""
    return " ".join(a if a.startswith("$") or re.fullmatch(r"[\w./:-]*<[\w-]+>[\w./-]*", a)
                    else shlex.quote(a) for a in argv)


@dataclass
class Plan:
    recipe: str
    backend: str
    workflow: str | None
    gpu: GpuProfile | None
    out_dir: Path
    draft_lengths: list[int]
    d0: int | None
    d0_derivation: str | None
    steps: list[Step] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    next: list[Next] = field(default_factory=list)

    def shell(self) -> str:
        """The plan as a copy-pasteable bash script."""
        gpu = f"{self.gpu.name} (SM{self.gpu.sm})" if self.gpu else "this machine's CPU/GPU"
        lines = ["#!/usr/bin/env bash", f"# trtspec build plan: {self.recipe} for {gpu}",
                 f"# backend {self.backend}" + (f", workflow {self.workflow}" if self.workflow
                                                 else ""),
                 f"# draft lengths: {self.draft_lengths}"]
        if self.d0_derivation:
            lines.append(f"# D₀: {self.d0_derivation}")
        lines += [f"# note: {n}" for n in self.notes]
        lines += ["set -euo pipefail"]
        if self.backend == "trtllm" and self.workflow == "engine":
            lines.append(': "${TRTLLM_EXAMPLES:?set it to TensorRT-LLM\'s examples/ directory}"')
        for i, s in enumerate(self.steps, 1):
            lines += ["", f"# [{i}/{len(self.steps)}] {s.name}" + (f": {s.note}" if s.note and
                                                                    s.kind != "prepare" else ""),
                      s.shell()]
        if self.next:
            lines += ["", "# next: run what this plan built (not run by this script)"]
            lines += [n.shell() for n in self.next]
        return "\n".join(lines) + "\n"


def make_plan(recipe: Recipe, gpu: GpuProfile | None, out_dir: Path, draft_lengths: list[int],
              d0: int | None = None, d0_derivation: str | None = None,
              recipe_path: str = "RECIPE", overrides: Sequence[str] = ()) -> Plan:
    """``recipe_path`` and ``overrides`` as the user passed them: the "next" commands repeat
    them, so eval opens the same recipe (and finds a --set build in its own folder)."""
    backend = recipe.backend
    workflow = backend.workflow if backend.kind == "trtllm" else None
    plan = Plan(recipe.name, backend.kind, workflow, gpu, out_dir, draft_lengths, d0,
                d0_derivation)
    recipe_args = (recipe_path, *(a for o in overrides for a in ("--set", o)))
    if backend.kind == "torch":
        _torch_steps(plan, recipe)
        _torch_next(plan, recipe_args)
    elif workflow == "engine":
        _engine_steps(plan, recipe)
        _engine_next(plan, recipe, recipe_args)
    else:
        _pytorch_steps(plan, recipe)
        _pytorch_next(plan, recipe, recipe_args)
    return plan


def _torch_steps(plan: Plan, recipe: Recipe) -> None:
    plan.steps.append(Step("target", "prepare", produces=recipe.target.model,
                           note=f"resolve {recipe.target.model} (a GGUF is converted once to "
                                "safetensors and cached); record config/tokenizer digests"))
    for m in recipe.methods:
        if isinstance(m, DraftModel):
            plan.steps.append(Step("draft", "prepare", produces=m.model,
                                   note=f"resolve draft {m.model}; check its tokenizer against "
                                        "the target's"))
        elif isinstance(m, LayerSkip):
            plan.steps.append(Step(f"layer_skip-{m.layers}", "prepare",
                                   note=f"check the target has more than {m.layers} layers "
                                        "(the draft shares its weights)"))
        elif isinstance(m, Medusa | Eagle):
            folder = m.heads if isinstance(m, Medusa) else m.model
            plan.steps.append(Step(m.method, "prepare", produces=folder,
                                   note=f"load the {m.method} heads in {folder} against the "
                                        "target (shapes, vocabulary); left out, with how to "
                                        "train them, when the folder is missing"))
    if recipe.backend.runner == "compiled":
        plan.steps.append(Step("compile target", "prepare",
                               note="torch.compile one decoder layer of the target (for one row "
                                    "and for several), kernels cached in inductor/ here"))
    plan.steps.append(Step("cost curve", "prepare",
                           note=f"time the target scoring T = 1 … {recipe.adaptive_cap + 1} new "
                                "tokens in a row, and each draft's one step (fastest of five, "
                                "into the manifest): the costs of the adaptive draft length"))


def _dtype(recipe: Recipe, gpu: GpuProfile | None) -> str:
    dtype = recipe.target.dtype
    if dtype == "fp8":
        if gpu is not None and not gpu.fp8:
            raise ValueError(f"target.dtype fp8 needs an FP8 GPU (Ada/Hopper/Blackwell); "
                             f"{gpu.name} has none: use bfloat16")
        raise ValueError("target.dtype fp8 needs a ModelOpt-quantised checkpoint, which trtspec "
                         "does not plan yet: use bfloat16")
    return "bfloat16" if dtype == "auto" else dtype


def _engine_steps(plan: Plan, recipe: Recipe) -> None:
    t, limits = recipe.target, recipe.limits
    dtype = _dtype(recipe, plan.gpu)
    world = t.tp_size * t.pp_size
    max_d = max(plan.draft_lengths)
    ckpt, eng = plan.out_dir / "checkpoints", plan.out_dir / "engines"
    parallel = ["--tp_size", str(t.tp_size), "--pp_size", str(t.pp_size)]
    workers = ["--workers", str(world)] if world > 1 else []
    common = ["--max_batch_size", str(limits.max_batch_size),
              "--max_input_len", str(limits.max_input_len),
              "--max_seq_len", str(limits.max_seq_len),
              "--max_num_tokens", str(limits.max_num_tokens),
              "--gemm_plugin", dtype, "--gpt_attention_plugin", dtype, *workers]

    def convert(name: str, script: str, model: str, extra: list[str]) -> Step:
        return Step(f"convert {name}", "run",
                    ("python", f"{EXAMPLES}/{script}", "--model_dir", model, *extra,
                     "--output_dir", str(ckpt / name), "--dtype", dtype, *parallel, *workers),
                    produces=str(ckpt / name))

    def build(name: str, checkpoint: str, extra: list[str], note: str = "") -> Step:
        return Step(f"build {name}", "run",
                    ("trtllm-build", "--checkpoint_dir", str(ckpt / checkpoint),
                     "--output_dir", str(eng / name), *common, *extra),
                    produces=str(eng / name), note=note)

    plan.steps += [convert("target", CONVERT["llama"], t.model, []),
                   build("target", "target", [], "the baseline engine (no speculation)")]
    external = [m for m in recipe.methods if isinstance(m, DraftModel | Ngram)]
    if external:
        plan.steps.append(build("target-spec", "target", [
            "--speculative_decoding_mode", "draft_tokens_external", "--max_draft_len", str(max_d),
            "--use_paged_context_fmha", "enable", "--gather_generation_logits"],
            "verifies external drafts; runtime needs kv_cache_enable_block_reuse"))
    for m in recipe.methods:
        if isinstance(m, DraftModel):
            plan.steps += [convert("draft", CONVERT["llama"], m.model, []),
                           build("draft", "draft", ["--gather_generation_logits"],
                                 "draft logits are passed to the target for exact sampling")]
        elif isinstance(m, Medusa):
            plan.steps += [
                convert("medusa", "medusa/convert_checkpoint.py", t.model,
                        ["--medusa_model_dir", m.heads, "--num_medusa_heads", str(m.num_heads)]),
                build("medusa", "medusa", ["--speculative_decoding_mode", "medusa",
                                           "--max_draft_len", str(max_d)],
                      "Medusa verifies by token matching (exact only at temperature 0)")]
        elif isinstance(m, Eagle):
            plan.steps += [
                convert("eagle", "eagle/convert_checkpoint.py", t.model,
                        ["--eagle_model_dir", m.model, "--max_draft_len", str(max_d),
                         "--num_eagle_layers", str(m.num_layers),
                         "--max_non_leaves_per_layer", str(m.max_non_leaves_per_layer)]),
                build("eagle", "eagle", ["--speculative_decoding_mode", "eagle",
                                         "--max_draft_len", str(max_d)],
                      "EAGLE engines verify greedily or by typical acceptance (not exact)")]
    sources = [t.model] + [getattr(m, "model", None) or getattr(m, "heads", None)
                           for m in recipe.methods if not isinstance(m, Ngram)]
    remote = [s for s in sources if s and not s.startswith(("/", ".", "~"))]
    if remote:
        plan.notes.append("convert_checkpoint.py reads local directories: fetch "
                          f"{', '.join(remote)} first (`hf download ID --local-dir DIR`) and "
                          "point the recipe at DIR (--set target.model=DIR)")
    if world > 1:
        plan.notes.append(f"tp × pp = {world}: run the engines under `mpirun -n {world} "
                          "--allow-run-as-root`")


def _pytorch_steps(plan: Plan, recipe: Recipe) -> None:
    limits = recipe.limits
    base = {"max_batch_size": limits.max_batch_size, "max_num_tokens": limits.max_num_tokens,
            "max_seq_len": limits.max_seq_len}
    cfg = plan.out_dir / "llmapi"

    def write(name: str, options: dict) -> None:
        path = cfg / f"{name}.yaml"
        plan.steps.append(Step(f"write {name}", "write", path=str(path),
                               content=yaml.safe_dump(options, sort_keys=False),
                               produces=str(path)))

    two_model = {"Draft_Target", "DraftTarget"}  # a second model and its KV cache
    spec_options = []
    native = recipe.backend.mode == "native"
    if not native:
        plan.notes.append(f"backend.mode {recipe.backend.mode}: trtspec drafts in-process on the "
                          "LLM API (trtspec eval / audit / serve); the YAML here is the plain "
                          "baseline for trtllm-serve")
    for m in recipe.methods if native else ():
        for d in plan.draft_lengths:
            spec = speculative_config(m, d, RELEASE, recipe.sampling.temperature, "pytorch")
            options = {**base, "speculative_config": spec}
            if spec["decoding_type"] in two_model:
                options["disable_overlap_scheduler"] = True
            spec_options.append((f"{m.method}-d{d}", options))
    if any("disable_overlap_scheduler" in o for _, o in spec_options):
        base["disable_overlap_scheduler"] = True  # every arm runs the same scheduler
        for _, options in spec_options:
            options["disable_overlap_scheduler"] = True
        plan.notes.append("disable_overlap_scheduler: the two-model draft target needs it, so "
                          "the baseline and every other arm run without the overlap scheduler "
                          "too (the same scheduler on every arm)")
    write("baseline", base)
    for name, options in spec_options:
        write(name, options)


def _torch_next(plan: Plan, recipe_args: tuple[str, ...]) -> None:
    root = plan.out_dir.parents[1]
    engines = ("--engines", str(root)) if str(root) != "engines" else ()
    plan.next += [
        Next(("trtspec", "eval", *recipe_args, *engines),
             f"baseline vs speculative on these models, in-process; it prints {EVAL_DIR}"),
        Next(("trtspec", "audit", EVAL_DIR), "is speculative sampling exact on these models?"),
        Next(("trtspec", "decide", EVAL_DIR), "go / no-go per condition (with the audit)")]


def _endpoint_eval(plan: Plan, recipe_args: tuple[str, ...], model: str) -> None:
    plan.next += [
        Next(("trtspec", "eval", *recipe_args, "--endpoint", f"http://127.0.0.1:{SPEC_PORT}/v1",
              "--model", model, "--baseline-endpoint",
              f"http://127.0.0.1:{BASELINE_PORT}/v1"),
             "both servers up: the recipe's workloads, sampling and concurrency against them"),
        Next(("trtspec", "decide", EVAL_DIR), "go / no-go")]


def _pytorch_next(plan: Plan, recipe: Recipe, recipe_args: tuple[str, ...]) -> None:
    t, cfg = recipe.target, plan.out_dir / "llmapi"
    world = ("--tp_size", str(t.tp_size), "--pp_size", str(t.pp_size))
    spec = cfg / f"{recipe.methods[0].method}-d{plan.draft_lengths[0]}.yaml"
    plan.next += [
        Next(("trtllm-serve", t.model, *world, "--extra_llm_api_options", str(spec),
              "--port", str(SPEC_PORT)),
             "serve one speculative condition (one server per method × D: swap the YAML) and "
             "the baseline with TensorRT-LLM's trtllm-serve"),
        Next(("trtllm-serve", t.model, *world, "--extra_llm_api_options",
              str(cfg / "baseline.yaml"), "--port", str(BASELINE_PORT)))]
    _endpoint_eval(plan, recipe_args, t.model)


def _engine_next(plan: Plan, recipe: Recipe, recipe_args: tuple[str, ...]) -> None:
    """trtllm-serve serves an engine directory with ``--backend tensorrt`` (the tokenizer comes
    from the target's checkpoint). Medusa / EAGLE engines speculate by themselves; target-spec
    verifies drafts a client passes with each request, which trtllm-serve's OpenAI API does
    not, so draft_model / ngram are pointed at the pytorch workflow instead."""
    t, eng = recipe.target, plan.out_dir / "engines"

    def serve(engine: str, port: int, why: str = "") -> Next:
        return Next(("trtllm-serve", str(eng / engine), "--tokenizer", t.model, "--backend",
                     "tensorrt", "--tp_size", str(t.tp_size), "--pp_size", str(t.pp_size),
                     "--port", str(port)), why)

    native = [m.method for m in recipe.methods if isinstance(m, Medusa | Eagle)]
    plan.next.append(serve("target", BASELINE_PORT, "serve the baseline engine with "
                                                    "TensorRT-LLM's trtllm-serve"))
    if native:
        plan.next.append(serve(native[0], SPEC_PORT, f"and the {native[0]} engine"))
        _endpoint_eval(plan, recipe_args, t.model)
    if any(isinstance(m, DraftModel | Ngram) for m in recipe.methods):
        why = ("engines/target-spec verifies drafts that a client passes with each request "
               "(draft_tokens_external); trtllm-serve passes none, so served alone it does not "
               "speculate, and trtspec has no such client yet")
        if any(isinstance(m, Medusa) for m in recipe.methods):  # medusa needs engines
            plan.next.append(Next((), why))
        else:
            plan.next.append(Next(("trtspec", "build", *recipe_args, "--set",
                                   "backend.workflow=pytorch"),
                                  f"{why}: to measure draft_model / ngram through a server, "
                                  "plan the pytorch workflow (its trtllm-serve drafts itself)"))
