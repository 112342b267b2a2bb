"""What a recipe is: the target, the methods to compare, backend, GPU, limits, sampling, eval
and decide settings, and the digests that tie builds and evals to the settings they used.

Every model is pydantic with ``extra="forbid"``, so a typo is an error, not a silent default.
Speculation methods are a discriminated union on ``method`` (their models live beside the
proposers, in :mod:`trtspec.spec.methods`)."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    Field,
    PlainValidator,
    field_validator,
    model_validator,
)

from trtspec.build.recipe.decide import Decide
from trtspec.spec.adaptive import ADAPTIVE, DEFAULT_MAX_DRAFT_LEN
from trtspec.spec.methods import Dtype, Method, Strict
from trtspec.spec.sample.probs import SamplingParams


def _draft_length(value: Any) -> int | str:
    """One entry of draft_lengths: an integer 1..64, or adaptive."""
    if value == ADAPTIVE:
        return ADAPTIVE
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{value!r} is not a draft length: give an integer 1..64 or adaptive")
    if not 1 <= value <= 64:
        raise ValueError(f"Input should be {'greater' if value < 1 else 'less'} than or equal "
                         f"to {1 if value < 1 else 64}")
    return value


DraftLength = Annotated[Annotated[int, Field(ge=1, le=64)] | Literal["adaptive"],
                        PlainValidator(_draft_length)]


def _disjoint_groups(groups: dict[str, list[str]]) -> dict[str, list[str]]:
    """eval.categories: every group lists categories, each category in one group at most, and
    none is named 'all' (the report's cell over every category)."""
    seen: dict[str, str] = {}
    for name, members in groups.items():
        if not members:
            raise ValueError(f"group {name!r} lists no category")
        if name == "all":
            raise ValueError("a group cannot be named 'all' (the report's cell over every "
                             "category)")
        for c in members:
            if c in seen:
                raise ValueError(f"group {name!r} lists a category twice" if seen[c] == name
                                 else f"category {c!r} is in two groups ({seen[c]!r} and "
                                 f"{name!r})")
            seen[c] = name
    return groups


CategoryGroups = Annotated[dict[str, list[str]], AfterValidator(_disjoint_groups)]


class RecipeError(ValueError):
    """A recipe problem, as one line: file, key path, what is wrong and how to fix it."""


class Target(Strict):
    model: str = Field(description="built-in name, .gguf file, local HF dir or hub id")
    dtype: Dtype = Field("auto", description="weights' dtype; auto: bfloat16 on CUDA and in "
                         "TensorRT-LLM, else float32; fp8 needs TensorRT-LLM")
    tp_size: int = Field(1, ge=1, description="tensor-parallel GPUs (TensorRT-LLM); "
                         "tp_size × pp_size = gpu.count")
    pp_size: int = Field(1, ge=1, description="pipeline-parallel stages (TensorRT-LLM engine "
                         "workflow); tp_size × pp_size = gpu.count")
    # For planning where config.json is not on this machine (D₀ needs the head counts)
    num_attention_heads: int | None = Field(None, ge=1, description="query heads, for D₀ when "
                                            "the target's config.json is not on this machine")
    num_key_value_heads: int | None = Field(None, ge=1, description="KV heads, for D₀ when the "
                                            "target's config.json is not on this machine")


class TorchBackend(Strict):
    kind: Literal["torch"] = Field(description="transformers in process, on any machine")
    device: str = Field("auto", description="auto (cuda when there is one, else cpu), cpu, "
                        "cuda, cuda:N or mps; checked by build and eval")
    runner: Literal["compiled", "eager", "transformers"] = Field(
        "compiled", description="compiled: trtspec's Llama-family decoder under torch.compile, "
        "compiled by build and cached in the build folder; eager: the same decoder without "
        "compiling; transformers: the model's own modules (any architecture; also what other "
        "architectures fall back to)")


class TrtllmBackend(Strict):
    kind: Literal["trtllm"] = Field(description="TensorRT-LLM 1.2")
    workflow: Literal["engine", "pytorch"] = Field(
        "engine", description="engine: trtllm-build engines; pytorch: llm-api YAML for "
        "trtllm-serve / trtllm-bench, and the LLM API that eval, audit and serve run")
    mode: Literal["native", "drafter", "exact"] = Field(
        "native", description="who drafts and verifies on the pytorch workflow: native "
        "(TensorRT-LLM both), drafter (trtspec's ngram / suffix / draft model propose inside "
        "TensorRT-LLM's batch, TensorRT-LLM rejection-samples) or exact (trtspec verifies "
        "TensorRT-LLM's raw logits: slow, the reference the others are audited against)")


Backend = Annotated[TorchBackend | TrtllmBackend, Field(discriminator="kind")]


class Gpu(Strict):
    name: str = Field("auto", description="a GPU profile (H200, H100, A100-80GB, …) or auto")
    count: int = Field(1, ge=1, description="GPUs the target runs on (= tp_size × pp_size)")


class Limits(Strict):
    max_batch_size: int = Field(8, ge=1, description="most requests in flight at once")
    max_input_len: int = Field(2048, ge=1, description="longest prompt, in tokens")
    max_seq_len: int = Field(4096, ge=2, description="longest prompt + output, in tokens")
    max_num_tokens: int = Field(8192, ge=1, description="most tokens in one forward pass, "
                                "summed over the batch")

    @model_validator(mode="after")
    def _lengths(self) -> Limits:
        if self.max_input_len >= self.max_seq_len:
            raise ValueError(f"max_input_len ({self.max_input_len}) must be < max_seq_len "
                             f"({self.max_seq_len}): no room left for output")
        return self


class Sampling(Strict):
    temperature: float = Field(0.0, ge=0, description="0: greedy (argmax)")
    top_k: int = Field(0, ge=0, description="keep the k most likely tokens; 0: off")
    top_p: float = Field(1.0, gt=0, le=1, description="nucleus mass kept; 1: off")
    max_tokens: int = Field(128, ge=1, description="output tokens per request, stop token "
                            "included")
    seed: int = Field(0, description="seeds each request (the same in both arms), the "
                      "per_category sample and the bootstrap")
    ignore_eos: bool = Field(False, description="generate through EOS to max_tokens: fixed "
                             "output lengths, as in benchmarks (`trtspec eval --ignore-eos`)")

    def params(self, **overrides: Any) -> SamplingParams:
        fields = {"temperature": self.temperature, "top_k": self.top_k, "top_p": self.top_p,
                  "max_tokens": self.max_tokens, "seed": self.seed,
                  "ignore_eos": self.ignore_eos}
        return SamplingParams(**(fields | overrides))


class Eval(Strict):
    """Filled in by the eval step; validated now so recipes stay honest."""

    workloads: list[str] = Field(default_factory=lambda: ["builtin"], description="`builtin`, "
                                 "`speed-bench:<config>` or a JSONL path; `eval -w` replaces them")
    concurrency: list[Annotated[int, Field(ge=1)]] = Field(
        default_factory=lambda: [1], description="closed-loop clients (each sends its next "
        "request when one finishes); each value is a condition")
    request_rate: float | None = Field(
        None, gt=0, description="open-loop Poisson arrivals, requests/s (seeded; .inf: all at "
        "once) instead of closed-loop clients; null: closed loop")
    per_category: int | None = Field(
        None, ge=1, description="a seeded stratified sample of at most N requests per category "
        "of builtin and SPEED-Bench workloads (a custom JSONL runs whole unless "
        "`--per-category` is given); null: every request")
    warmup: int = Field(2, ge=0, description="requests each arm runs (8 tokens) before measuring")
    categories: CategoryGroups | None = Field(
        None, description="judge groups of categories of `builtin` and SPEED-Bench instead of "
        "each one: group name → the categories it merges (unlisted ones keep their names; a "
        "custom JSONL's categories are its own); null: the workloads' own categories")


class Recipe(Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9._-]+$",
                      description="names the build folder and the eval ids")
    description: str = Field("", description="free text, for people")
    target: Target = Field(description="the model to speed up; its plain decoding is the "
                           "baseline")
    methods: list[Method] = Field(min_length=1, description="the speculation methods to "
                                  "compare, each once")
    draft_lengths: list[DraftLength] | Literal["auto"] = Field(
        "auto", description="the draft lengths D to sweep, each a condition; auto: 2, 4, "
        "D₀/4, D₀/2 and D₀ = 128/G − 1 (G: query heads per KV head); adaptive (alone or in "
        "the list, e.g. [2, 4, adaptive]): D ∈ 0 … max_draft_len chosen per round from the "
        "running requests' acceptance and the measured round cost (torch backend)")
    max_draft_len: int | None = Field(None, ge=1, le=64, description="the cap K of an "
                                      "adaptive draft length; null: the largest of "
                                      f"{DEFAULT_MAX_DRAFT_LEN} and the fixed draft lengths")
    sampling: Sampling = Field(Sampling(), description="how every request samples, in both arms")
    limits: Limits = Field(Limits(), description="the sizes TensorRT-LLM engines and llm-api "
                           "configs allow; the torch backend uses max_batch_size (serve's "
                           "slots, the graphs build compiles)")
    backend: Backend = Field(description="what runs the models")
    gpu: Gpu = Field(Gpu(), description="the GPU to plan and build for")
    eval: Eval = Field(Eval(), description="what `trtspec eval` runs")
    decide: Decide = Field(Decide(), description="when `trtspec decide` says GO")

    @field_validator("draft_lengths", mode="before")
    @classmethod
    def _alone(cls, value: Any) -> Any:
        if isinstance(value, str) and value not in ("auto", ADAPTIVE):
            raise ValueError(f"{value!r}: write a list of draft lengths (integers 1..64 or "
                             "adaptive), adaptive or auto")
        return [ADAPTIVE] if value == ADAPTIVE else value

    @property
    def adaptive(self) -> bool:
        """Whether draft_lengths has an adaptive condition."""
        return self.draft_lengths != "auto" and ADAPTIVE in self.draft_lengths

    @property
    def adaptive_cap(self) -> int:
        """K, the most an adaptive round drafts: max_draft_len, else the largest of 8 and
        the fixed draft lengths."""
        if self.max_draft_len is not None:
            return self.max_draft_len
        return max([DEFAULT_MAX_DRAFT_LEN, *self.fixed_draft_lengths()])

    def fixed_draft_lengths(self) -> list[int]:
        """The integer draft lengths (none for auto: the build sweeps them)."""
        if self.draft_lengths == "auto":
            return []
        return [d for d in self.draft_lengths if isinstance(d, int)]

    def condition_draft_lengths(self, swept: Sequence[int]) -> list[int | str]:
        """The D of each condition, in order: draft_lengths as written (adaptive included),
        or ``swept`` (the build's) for auto."""
        return list(swept) if self.draft_lengths == "auto" else list(self.draft_lengths)

    @model_validator(mode="after")
    def _consistent(self) -> Recipe:
        t, backend = self.target, self.backend
        if self.adaptive and backend.kind != "torch":
            raise ValueError("draft_lengths: adaptive chooses D per round in trtspec's own "
                             "executor (backend.kind: torch); TensorRT-LLM builds D into its "
                             "engines and configs: list fixed draft lengths")
        if self.draft_lengths != "auto" and not self.draft_lengths:
            raise ValueError("draft_lengths is empty: list at least one draft length, or write "
                             "adaptive or auto")
        if t.tp_size * t.pp_size != self.gpu.count:
            raise ValueError(f"target.tp_size × target.pp_size = {t.tp_size * t.pp_size} but "
                             f"gpu.count = {self.gpu.count}: make them equal")
        kinds = [m.method for m in self.methods]
        if len(set(kinds)) != len(kinds):
            raise ValueError("methods lists a method twice: give each method once")
        if backend.kind == "torch":
            if t.tp_size * t.pp_size > 1:
                raise ValueError("the torch backend runs on one device: set tp_size and pp_size "
                                 "to 1, or use backend.kind: trtllm")
            for m in self.methods:
                if m.method == "eagle" and m.version != 3:
                    raise ValueError("the torch backend runs EAGLE-3 heads: set version: 3 "
                                     "(EAGLE-1/2 run on TensorRT-LLM engines)")
            fp8 = ["target.dtype"] * (t.dtype == "fp8") + [
                f"methods.{i}.dtype" for i, m in enumerate(self.methods)
                if getattr(m, "dtype", None) == "fp8"]
            if fp8:
                raise ValueError(f"{fp8[0]}: fp8 needs TensorRT-LLM (backend.kind: trtllm); the "
                                 "torch backend runs auto, float32, bfloat16 or float16")
        else:
            if backend.mode != "native":
                if backend.workflow != "pytorch":
                    raise ValueError(f"backend.mode {backend.mode} runs on the LLM API: set "
                                     "backend.workflow: pytorch")
                for m in self.methods:
                    if m.method not in ("ngram", "suffix", "draft_model"):
                        raise ValueError(f"{m.method} with backend.mode {backend.mode}: trtspec "
                                         "drafts ngram, suffix and draft_model there; run "
                                         f"{m.method} with backend.mode: native")
            else:
                for m in self.methods:
                    if m.method == "eagle" and m.version != 3 and backend.workflow == "pytorch":
                        raise ValueError("EAGLE-1/2 run on TensorRT-LLM engines: set "
                                         "backend.workflow: engine (or eagle version 3)")
                    if m.method == "layer_skip":
                        raise ValueError("layer_skip is a torch-backend method: TensorRT-LLM "
                                         "has no layer-skip drafting")
                    if m.method == "suffix":
                        raise ValueError("suffix: TensorRT-LLM 1.2 has no suffix drafting of its "
                                         "own: set backend.mode: drafter (trtspec drafts, "
                                         "TensorRT-LLM verifies), or use ngram")
                    if m.method == "medusa" and backend.workflow == "pytorch":
                        raise ValueError("medusa runs only in the engine workflow in TensorRT-LLM "
                                         "1.2: set backend.workflow: engine")
                    if m.method == "eagle" and m.version == 3 and backend.workflow == "engine":
                        raise ValueError("EAGLE-3 runs only in the pytorch workflow: set "
                                         "backend.workflow: pytorch (or eagle version 1/2)")
            if t.pp_size > 1 and backend.workflow == "pytorch":
                raise ValueError("speculative decoding with pipeline parallelism is not "
                                 "supported in the pytorch workflow: set target.pp_size: 1")
            if t.dtype == "float32":
                raise ValueError("TensorRT-LLM engines for speculation are built in "
                                 "bfloat16/float16/fp8: set target.dtype")
        return self

    def digest(self) -> str:
        """sha256 of the canonical JSON of this recipe (after overrides and defaults): the
        eval's provenance. Keys added later are left out while at their default, so the digest
        of a recipe that does not use them stays what older trtspec versions recorded. What a
        build depends on is :meth:`build_inputs`."""
        return self._digest_without(self._added_at_default())

    def digests(self) -> set[str]:
        """Every digest this recipe has been recorded under: with each key of _ADDED_LATER
        that is at its default present or left out (what each trtspec version recorded)."""
        import itertools

        keys = self._added_at_default()
        return {self._digest_without(dropped) for n in range(len(keys) + 1)
                for dropped in itertools.combinations(keys, n)}

    def _added_at_default(self) -> list[tuple[str, str]]:
        data = self.model_dump(mode="json")
        return [(section, key) for section, key, default in _ADDED_LATER
                if (data[section] if section else data).get(key) == default]

    def _digest_without(self, keys: Sequence[tuple[str, str]]) -> str:
        data = self.model_dump(mode="json")
        for section, key in keys:
            del (data[section] if section else data)[key]
        return _sha256(data)

    def build_inputs(self) -> dict[str, Any]:
        """What the built artefacts depend on, apart from the methods (see method_digests):
        the target and its dtype, the backend (and its device), the GPU, and for TensorRT-LLM
        the limits and draft lengths compiled into engines. Sampling, eval and decide settings
        are not here: editing them never invalidates a build."""
        inputs: dict[str, Any] = {"target": self.target.model_dump(mode="json"),
                                  "backend": self.backend.model_dump(mode="json"),
                                  "gpu": self.gpu.model_dump(mode="json")}
        if inputs["backend"].get("runner") == "compiled":  # the default: builds made before
            del inputs["backend"]["runner"]  # runners were recorded stay usable
        inputs["backend"].pop("mode", None)  # chosen at run time: nothing built depends on it
        if self.backend.kind == "trtllm":
            inputs["limits"] = self.limits.model_dump(mode="json")
            inputs["draft_lengths"] = self.draft_lengths
        return inputs

    def build_digest(self) -> str:
        return _sha256(self.build_inputs())

    def method_digests(self) -> dict[str, str]:
        """Per method, a digest of the settings its artefacts depend on: a build covers a set
        of methods, and an eval of a subset of them uses it. TensorRT-LLM compiles every
        setting in (engine flags, llm-api YAML); the torch backend prepares only the draft
        checkpoint (draft_model: its model and dtype; layer_skip: the layers kept; heads: their
        folder), so n-gram sizes and suffix settings are chosen at run time."""
        built = {"draft_model": ("method", "model", "dtype"), "layer_skip": ("method", "layers"),
                 "ngram": ("method",), "suffix": ("method",),
                 "medusa": ("method", "heads", "num_heads"),
                 "eagle": ("method", "model", "version")}
        return {m.method: _sha256(m.model_dump(mode="json", include=set(built[m.method]))
                                  if self.backend.kind == "torch" else m.model_dump(mode="json"))
                for m in self.methods}


# Keys added after digests were first recorded: left out of Recipe.digest() while at their
# default, so an eval started by an older trtspec can still be resumed ("": top level).
_ADDED_LATER = (("sampling", "ignore_eos", False), ("eval", "request_rate", None),
                ("", "max_draft_len", None), ("backend", "runner", "compiled"),
                ("eval", "categories", None))


def _sha256(data: Any) -> str:
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()
