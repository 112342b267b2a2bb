"""Opens a build: recipe + manifest → loaded models → the target's Runner → a proposer and an
executor per (method, D), warmed up for a batch size.

`trtspec serve`, `eval` and `audit` open what `trtspec build` wrote here, and `trtspec
generate` makes its executor with :func:`executor_for`, so the four run the same objects: one
target runner per process (the compiled one copies weights and holds the graphs), the recipe's
own method objects turned into proposers by :func:`~trtspec.spec.propose.make_proposer`, and one
set of stop tokens (every EOS id the model's generation config lists).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trtspec.build.recipe import DraftModel, Eagle, Medusa, Recipe, RecipeError, load_recipe
from trtspec.runtime import Runner
from trtspec.spec.adaptive import ADAPTIVE, is_adaptive
from trtspec.spec.executor import SpecExecutor
from trtspec.spec.propose import make_proposer
from trtspec.spec.propose.proposer import Proposer

if TYPE_CHECKING:
    from trtspec.build.manifest import RunnerInfo

PLAIN = "none"  # the method name of plain decoding
DRAFT_KV_FRACTION = 0.6  # TensorRT-LLM's KV share of free GPU memory beside a torch draft


def _stderr(line: str) -> None:
    print(line, file=sys.stderr)


class OpenBuild:
    """A build's models, loaded once each on the recipe's device and in its dtypes, and the
    target's one Runner, from which executors are made."""

    def __init__(self, recipe: Recipe, manifest: Any, say: Callable[[str], None] = _stderr
                 ) -> None:
        self.recipe, self.manifest, self.say = recipe, manifest, say
        self._dtypes = {manifest.artifact("target").path: recipe.target.dtype}
        for m in recipe.methods:
            if isinstance(m, DraftModel):
                self._dtypes[manifest.artifact("draft").path] = m.dtype
        self._models: dict[str, Any] = {}
        self._runner: Runner | None = None

    def model(self, path: str | None = None) -> Any:
        """The target's loaded checkpoint (trtspec.runtime.models.LoadedModel), or another
        artifact's (a draft model, in its method's dtype)."""
        from trtspec.runtime.models import load

        key = path or self.manifest.artifact("target").path
        if key not in self._models:
            device = getattr(self.recipe.backend, "device", "auto")  # trtllm: its GPU
            self._models[key] = load(key, device=device,
                                     dtype=self._dtypes.get(key, self.recipe.target.dtype))
        return self._models[key]

    @property
    def tokenizer(self) -> Any:
        return self.model().tokenizer

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return eos_token_ids(self.model())

    @property
    def method_names(self) -> list[str]:
        """The recipe's methods this build can run (not those it left out: heads not trained)."""
        left_out = self.manifest.left_out()
        return [m.method for m in self.recipe.methods if m.method not in left_out]

    def target_runner(self) -> Runner:
        """The target's Runner as built: the manifest's runner kind (the recipe's for a build
        that recorded none) with the build folder's inductor cache, compiled (or loaded) for
        ``limits.max_batch_size`` rows."""
        if self._runner is None:
            from trtspec.runtime.kinds import built_runner

            built = self.manifest.runner
            kind = built.kind if built is not None else self.recipe.backend.runner
            if built is None and kind == "compiled":
                self.say("this build recorded no runner (an older trtspec): compiling now, "
                         "uncached; `trtspec build --force` caches it")
            lm = self.model()
            self._runner = built_runner(lm.model, kind, rows=self.recipe.limits.max_batch_size,
                                        cache_dir=built.cache_dir if built is not None else None,
                                        eos_token_id=lm.tokenizer.eos_token_id, say=self.say)
            if built is not None and self.manifest.cost_curve is not None:
                self._check_cost_curve(built)
        return self._runner

    def _check_cost_curve(self, built: RunnerInfo) -> None:
        """Warn where the runner now runs otherwise than when the build measured its cost
        curve, which the adaptive D prices its rounds by: GEMM weights prepacked or not, a
        wide call's grouped-query attention packed or not (each changes what a round costs)."""
        now = bool(getattr(self._runner, "prepacked", False))
        then = bool(built.prepacked)
        if now != then:
            self.say(f"warning: this build measured its cost curve with the weights "
                     f"{'' if then else 'not '}prepacked and they are "
                     f"{'' if now else 'not '}now (another trtspec, or TRTSPEC_PREPACK): "
                     "the adaptive D's costs are off; `trtspec build --force` measures "
                     "them again")
        now = bool(getattr(self._runner, "packed_attention", False))
        if built.packed_attention is None and now:  # measured unpacked if built before
            # trtspec packed, packed if built after but before it recorded so: can't tell
            self.say("warning: this build did not record whether its cost curve was measured "
                     "with grouped query heads packed in calls of 2+ tokens a row (verify "
                     "rounds, prompt chunks), as they are now (an older trtspec): if not, the "
                     "adaptive D prices those rounds dearer than they cost and drafts less; "
                     "`trtspec build --force` measures them again")
        elif built.packed_attention is not None and built.packed_attention != now:
            self.say(f"warning: this build measured its cost curve with grouped query heads "
                     f"{'' if built.packed_attention else 'not '}packed in calls of 2+ tokens "
                     f"a row and they are {'' if now else 'not '}now (another trtspec): the "
                     "adaptive D's costs are off; `trtspec build --force` measures them again")

    def warm_up(self, batch: int, watch: bool = False) -> float:
        """Every graph a batch of ``batch`` rows needs, now (a live cache is kept); ``watch``:
        a server, which says if a request ever waits for a compiler after this."""
        return self.target_runner().warm_up(batch, watch=watch)

    def check_method(self, method: str) -> None:
        """RecipeError unless ``method`` is one of the recipe's (or none)."""
        if method in (why := self.manifest.left_out()):
            raise RecipeError(f"method {method} is not in this build: {why[method]}; then "
                              "`trtspec build` again")
        if method != PLAIN and method not in self.method_names:
            raise RecipeError(f"method {method}: the recipe has "
                              f"{', '.join(self.method_names)} (or {PLAIN})")

    def proposer(self, method: str) -> Proposer | None:
        """A fresh proposer for one of the recipe's methods (or none)."""
        self.check_method(method)
        if method == PLAIN:
            return None
        chosen = {m.method: m for m in self.recipe.methods}[method]
        draft = None
        if isinstance(chosen, DraftModel):
            draft = self.model(self.manifest.artifact("draft").path)
        elif isinstance(chosen, Medusa | Eagle):  # loaded once: proposers only read them
            from trtspec.build.torch import load_heads

            key = f"heads:{chosen.method}"
            if key not in self._models:
                self._models[key] = load_heads(chosen, self.manifest.artifact(chosen.method).path,
                                               self.model().model)
            draft = self._models[key]
        return make_proposer(chosen, self.target_runner(), draft=draft,
                             target_tokenizer=self.tokenizer)

    def executor(self, method: str, draft_len: int | str) -> SpecExecutor:
        """Plain decoding for ``none`` or D = 0; else the method at a fixed D, or adaptive
        (each round's D from the running requests' acceptance, at most the recipe's adaptive
        cap, costed by the build's round cost)."""
        self.check_method(method)
        runner = self.target_runner()
        if method == PLAIN or draft_len == 0:  # no draft model loaded for nothing
            return SpecExecutor(runner, eos_token_ids=self.eos_token_ids)
        return executor_for(runner, self.proposer(method), method, draft_len,
                            curve=self.manifest.cost_curve, cap=self.recipe.adaptive_cap,
                            eos_token_ids=self.eos_token_ids, say=self.say,
                            slots=self.recipe.limits.max_batch_size)

    def arm(self, method: str, draft_len: int | str, schedule: Any = None) -> Any:
        """What one arm of an eval, a server or an audit runs: an executor here (trtspec's
        scheduler drives it); :class:`TrtllmBuild` in mode native or drafter gives an
        :class:`~trtspec.runtime.trtllm.LlmArm` instead (TensorRT-LLM's batch). ``schedule``
        (a serve policy's D by running requests) shapes an LlmArm only: trtspec's scheduler
        applies it to an executor round by round."""
        return self.executor(method, draft_len)

    def release_arms(self) -> None:
        """Free what :meth:`arm` holds beyond the target's runner (nothing here)."""

    def share_gpu(self, arms: int) -> None:
        """``arms`` arms will be held at once (nothing to share here: one target runner)."""

    def encode(self, prompt: Any, chat: bool = True) -> list[int]:
        from trtspec.runtime.models import encode

        return encode(self.tokenizer, prompt, chat)

    def margin(self, prefix: list[int], a: int, b: int) -> tuple[float, str]:
        """|logit a − logit b| of the target after ``prefix`` (one prefill, on a runner of its
        own: the target's may hold live rows) and the dtype the target ran in."""
        from trtspec.runtime.hf import HFRunner

        runner = HFRunner(self.model().model)
        logits = runner.prefill([prefix])[0]  # [V]
        return float((logits[a] - logits[b]).abs()), str(runner.dtype).removeprefix("torch.")


class TrtllmBuild(OpenBuild):
    """A pytorch-workflow TensorRT-LLM build run in-process on the LLM API.

    Mode ``exact``: the target is a :class:`~trtspec.runtime.trtllm.ContextLogitsRunner`
    (TensorRT-LLM's raw context logits, verified by trtspec's sampler), so eval, audit and
    serve run the same executor as on the torch backend. Modes ``native`` and ``drafter``:
    each arm is an :class:`~trtspec.runtime.trtllm.LlmArm` (:meth:`arm`), one LLM made from
    the options file build wrote for it, TensorRT-LLM's batch doing the rest. A draft model
    drafts in torch on the same device; the tokenizer and the model's config are read from
    the target's checkpoint.

    Each LLM's KV cache takes 0.9 of the free GPU memory where it is the only one (a
    server); where an eval holds the baseline's and a speculative arm's at once
    (:meth:`share_gpu`), both get the same cache in bytes."""

    def __init__(self, recipe: Recipe, manifest: Any, say: Callable[[str], None] = _stderr
                 ) -> None:
        self.recipe, self.manifest, self.say = recipe, manifest, say
        self._dtypes = {m.model: m.dtype for m in recipe.methods if isinstance(m, DraftModel)}
        self._models: dict[str, Any] = {}
        self._runner: Runner | None = None
        self._tokenizer: Any = None
        self._eos: frozenset[int] | None = None
        self._arms: dict[tuple[Any, ...], Any] = {}  # (method, D, schedule) → LlmArm
        self.arms_at_once = 1
        self._kv_budget: int | None = None

    def share_gpu(self, arms: int) -> None:
        """``arms`` LLMs will be held at once (an eval's baseline and one speculative arm):
        each gets the same KV cache, its share of the GPU memory free before the first."""
        self.arms_at_once = max(1, arms)

    def arm(self, method: str, draft_len: int | str, schedule: Any = None) -> Any:
        """Mode exact: the executor. Modes native and drafter: the LLM of this arm (plain
        for ``none`` or D = 0), made once and kept; a new speculative arm first shuts the
        other speculative arms down (the baseline's stays: every condition pairs with it)."""
        mode = self.recipe.backend.mode
        if mode == "exact":
            return self.executor(method, draft_len)
        self.check_method(method)
        if draft_len == ADAPTIVE or (schedule is not None and schedule.adaptive):
            raise RecipeError(f"backend.mode {mode}: an adaptive D is trtspec's executor's; "
                              "TensorRT-LLM takes fixed draft lengths (a schedule by running "
                              "requests): give draft lengths, or backend.mode: exact")
        plain = method == PLAIN or draft_len == 0
        steps = tuple(schedule.schedule) if schedule is not None and not plain else ()
        if steps and int(steps[0][1]) == 0:  # TensorRT-LLM refuses max_draft_len 0: as
            self.say("note: the schedule drafts nothing at one running request: serving "
                     "plain decoding (llmapi/baseline.yaml)")  # serve --native does
            plain, steps = True, ()
        if steps and mode == "drafter":
            raise RecipeError("backend.mode drafter: a D by running requests is not applied "
                              "(TensorRT-LLM 1.2 pads every request's drafts to the drafter's "
                              "maximum): serve a fixed --draft-len, or backend.mode native")
        key = (PLAIN, 0, ()) if plain else (method, int(draft_len), steps)
        if key not in self._arms:
            if not plain:
                for other in [k for k in self._arms if k[0] != PLAIN]:
                    self._arms.pop(other).shutdown()
            self._arms[key] = self._llm_arm(method, int(draft_len), steps, plain)
        return self._arms[key]

    def release_arms(self) -> None:
        """Shut every arm's LLM down (each tried, whatever another raised)."""
        arms, self._arms = list(self._arms.values()), {}
        for arm in arms:
            try:
                arm.shutdown()
            except Exception as e:  # the others still go, and an eval's own error stays
                self.say(f"note: shutting a TensorRT-LLM arm down failed: {e}")
        if self.recipe.backend.mode != "exact":
            self._runner = None  # the reference's LLM was the plain arm's

    def _options(self, name: str) -> dict[str, Any]:
        """An LLM API options file build wrote (llmapi/<name>.yaml), as a mapping."""
        import yaml

        from trtspec.build.manifest import ManifestError

        try:
            path = Path(self.manifest.artifact(name).path)
        except ManifestError:
            raise RecipeError(f"the build wrote no llmapi/{name}.yaml: `trtspec build` the "
                              "recipe again (with this D in its draft_lengths)") from None
        try:
            options = yaml.safe_load(path.read_text()) if path.is_file() else None
        except yaml.YAMLError as e:
            raise RecipeError(f"{path}: not YAML ({str(e).splitlines()[0]}): `trtspec build` "
                              "writes it again") from None
        if not isinstance(options, dict):
            raise RecipeError(f"{path}: no options here (`trtspec build` writes them)")
        return options

    def _kv_cache_bytes(self) -> int | None:
        """The KV cache each arm gets when several are held: 0.9 of the GPU memory free
        before the first LLM, less the weights every arm loads (the checkpoint's size on
        disk), split evenly; None for one arm (a fraction of what is free, TensorRT-LLM's
        way) or without CUDA here."""
        if self.arms_at_once < 2:
            return None
        if self._kv_budget is None:
            import torch

            if not torch.cuda.is_available():
                return None
            free, _ = torch.cuda.mem_get_info()
            model = Path(self.recipe.target.model)
            weights = sum(f.stat().st_size for f in model.glob("*.safetensors")) \
                if model.is_dir() else 0
            if any(isinstance(m, DraftModel) for m in self.recipe.methods):
                free *= DRAFT_KV_FRACTION / 0.9  # room for a torch draft model and its cache
            self._kv_budget = max(0, int((0.9 * free - self.arms_at_once * weights)
                                         / self.arms_at_once))
        return self._kv_budget or None

    def _llm_arm(self, method: str, d: int, steps: tuple[tuple[int, int], ...],
                 plain: bool) -> Any:
        from trtspec.runtime.trtllm import make_llm
        from trtspec.runtime.trtllm_stream import LlmArm

        mode = self.recipe.backend.mode
        options = self._options("baseline")
        chosen = None if plain else {m.method: m for m in self.recipe.methods}[method]
        if mode == "drafter":  # 1.2 runs a user-provided drafter without the overlap
            options["disable_overlap_scheduler"] = True  # scheduler: every arm alike
        spec, forget, decoding = None, None, None
        if not plain and mode == "native":
            options = self._options(f"{method}-d{d}")
            if not isinstance(options.get("speculative_config"), dict):
                raise RecipeError(f"llmapi/{method}-d{d}.yaml has no speculative_config: "
                                  "`trtspec build` it again")
            if steps:
                from trtspec.build.trtllm_options import draft_len_schedule

                options["speculative_config"].update(draft_len_schedule(steps))
            decoding = options["speculative_config"].get("decoding_type")
        elif not plain:  # drafter: trtspec's proposer inside TensorRT-LLM's batch
            spec, forget = self._drafter(chosen, d)
        budget = self._kv_cache_bytes()
        # one LLM: a fraction of what is free (less beside a torch draft model); several:
        # the byte budget binds, the same for each arm (the fraction only as a ceiling)
        fraction = 0.9 if budget else 0.9 * (DRAFT_KV_FRACTION / 0.9 if isinstance(
            chosen, DraftModel) else 1.0)
        llm = make_llm(self.recipe.target.model, self.recipe.target.tp_size, self.recipe.limits,
                       spec, kv_cache_fraction=fraction, options=options, kv_cache_bytes=budget)
        return LlmArm(llm, PLAIN if plain else method, 0 if plain else d, self.eos_token_ids,
                      vocab_size(llm, self.recipe.target.model), None if plain else mode,
                      decoding, forget)

    def _drafter(self, chosen: Any, d: int) -> tuple[Any, Any]:
        """A UserProvidedDecodingConfig whose Drafter runs the method's trtspec proposer at
        D = ``d``, and what forgets the proposer's learnt state (a suffix tree)."""
        import torch

        from trtspec.runtime.trtllm import make_drafter, user_provided
        from trtspec.spec.propose.by_request import RequestDrafts

        draft = self.model(chosen.model) if isinstance(chosen, DraftModel) else None
        proposer = make_proposer(chosen, None, draft=draft,
                                 target_tokenizer=self.tokenizer if draft is not None else None)
        drafter = make_drafter(RequestDrafts(proposer, self.recipe.limits.max_batch_size),
                               lambda batch: d, d, vocab_size(None, self.recipe.target.model),
                               "cuda" if torch.cuda.is_available() else None)
        return user_provided(drafter, d), proposer.forget

    def reference(self) -> Any:
        """The target's raw logits, exactly (a ContextLogitsRunner): mode exact's runner;
        in modes native and drafter one over the plain arm's LLM (no LLM more on the GPU)."""
        if self.recipe.backend.mode == "exact":
            return self.target_runner()
        if self._runner is None:
            from trtspec.runtime.trtllm import ContextLogitsRunner

            plain = self.arm(PLAIN, 0)
            self._runner = ContextLogitsRunner(plain.llm, plain.vocab_size,
                                               min(self.eos_token_ids, default=None))
        return self._runner

    def model(self, path: str | None = None) -> Any:
        if path is None:
            raise ValueError("the target runs in TensorRT-LLM: its torch model is not loaded")
        return super().model(path)

    @property
    def tokenizer(self) -> Any:
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(self.recipe.target.model)
        return self._tokenizer

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """Every id that ends a request, as on the torch backend: the tokenizer's EOS and each
        one the checkpoint's config and generation config list (Llama-3 lists several)."""
        if self._eos is not None:
            return self._eos
        ids: set[int] = set()
        sources: list[Any] = [getattr(self.tokenizer, "eos_token_id", None)]
        try:
            from transformers import AutoConfig, GenerationConfig

            sources.append(AutoConfig.from_pretrained(self.recipe.target.model).eos_token_id)
            sources.append(GenerationConfig.from_pretrained(self.recipe.target.model)
                           .eos_token_id)
        except (OSError, ValueError):
            pass  # no config or generation config: the tokenizer's
        for value in sources:
            ids.update([value] if isinstance(value, int) else
                       [int(v) for v in value] if isinstance(value, list | tuple) else [])
        self._eos = frozenset(ids)
        return self._eos

    def target_runner(self) -> Runner:
        if self._runner is None:
            from trtspec.runtime.trtllm import ContextLogitsRunner, make_llm

            draft = any(isinstance(m, DraftModel) for m in self.recipe.methods)
            llm = make_llm(self.recipe.target.model, self.recipe.target.tp_size,
                           self.recipe.limits, kv_cache_fraction=DRAFT_KV_FRACTION if draft
                           else 0.9)
            self._runner = ContextLogitsRunner(llm, vocab_size(llm, self.recipe.target.model),
                                               min(self.eos_token_ids, default=None))
        return self._runner

    def proposer(self, method: str) -> Proposer | None:
        self.check_method(method)
        if method == PLAIN:
            return None
        chosen = {m.method: m for m in self.recipe.methods}[method]
        draft = self.model(chosen.model) if isinstance(chosen, DraftModel) else None
        return make_proposer(chosen, self.target_runner(), draft=draft,
                             target_tokenizer=self.tokenizer if draft is not None else None)

    def margin(self, prefix: list[int], a: int, b: int) -> tuple[float, str]:
        """|logit a − logit b| from TensorRT-LLM's context logits after ``prefix`` (a runner
        of its own on the same LLM: the target's may hold live rows)."""
        from trtspec.runtime.trtllm import ContextLogitsRunner

        target = self.reference()
        runner = ContextLogitsRunner(target.llm, target.vocab_size)  # type: ignore[attr-defined]
        logits = runner.prefill([prefix])[0]
        return float((logits[a] - logits[b]).abs()), self.recipe.target.dtype


def trtllm_exactness(recipe: Recipe) -> dict[str, dict[str, str]]:
    """Per method of a TensorRT-LLM recipe: whether its mode keeps the target's output
    distribution at the recipe's temperature, and why (``exact``: yes, no or audit), as eval
    records it and serve says it; {} for the torch backend."""
    if recipe.backend.kind != "trtllm":
        return {}
    from trtspec.build.trtllm_options import RELEASE, decoding_type
    from trtspec.runtime.trtllm import exactness

    mode, t = recipe.backend.mode, recipe.sampling.temperature
    out = {}
    for m in recipe.methods:
        decoding = decoding_type(m, RELEASE, "pytorch") if mode == "native" else None
        found = exactness(mode, decoding, t, allow_advanced_sampling=t > 0)  # build sets it
        out[m.method] = {"mode": mode, "exact": found.exact, "why": found.why}
    return out


def vocab_size(llm: Any, model: str) -> int:
    """The target's vocabulary, its config's (context logits may be padded past it), else its
    tokenizer's length."""
    try:
        from transformers import AutoConfig

        return int(AutoConfig.from_pretrained(model).vocab_size)
    except (OSError, ValueError, AttributeError):
        tokenizer = getattr(llm, "tokenizer", None)
        if tokenizer is None:
            raise ValueError(f"{model}: no config.json or tokenizer to read the vocabulary "
                             "from") from None
        return len(tokenizer)


def open_models(recipe: Recipe, manifest: Any, recipe_path: str | Path = "recipe",
                say: Callable[[str], None] = _stderr) -> OpenBuild:
    """The opened build eval, audit and serve run in-process: :class:`OpenBuild` (torch) or
    :class:`TrtllmBuild` (TensorRT-LLM, mode exact); see :func:`check_in_process`."""
    check_in_process(recipe, recipe_path)
    return (TrtllmBuild if recipe.backend.kind == "trtllm" else OpenBuild)(recipe, manifest, say)


def check_in_process(recipe: Recipe, recipe_path: str | Path) -> None:
    """RecipeError unless this recipe runs in this process: the torch backend, or TensorRT-LLM's
    LLM API on the pytorch workflow, any mode (TrtllmMissing, one line, where TensorRT-LLM is
    not importable). Engines run in TensorRT-LLM's own server, and the error says how."""
    if recipe.backend.kind == "torch":
        return
    backend = recipe.backend
    if backend.workflow == "engine":
        raise RecipeError(f"{recipe_path}: engines run in trtllm-serve: `trtspec serve --native` "
                          "and `trtspec eval --launch` (or backend.workflow: pytorch to run "
                          "here)")
    from trtspec.runtime.trtllm import require

    require()


def executor_for(target: Runner, proposer: Proposer | None, method: str, draft_len: int | str,
                 *, curve: Any = None, cap: int | None = None, time_models: bool = True,
                 eos_token_ids: Iterable[int] | None = None,
                 say: Callable[[str], None] = _stderr, slots: int | None = None
                 ) -> SpecExecutor:
    """An executor at a fixed D, or adaptive up to ``cap`` [default 8]: costs from ``curve``
    (a build's), else timed now on ``target`` and the proposer's draft model
    (``time_models``), else assumed (toy models). A fixed D is scored at the widths the
    build's round cost says are cheapest, as an adaptive one is."""
    if not is_adaptive(draft_len) or proposer is None:
        return SpecExecutor(target, proposer, 0 if draft_len == ADAPTIVE else int(draft_len),
                            eos_token_ids=eos_token_ids,
                            round_cost=curve.round_cost() if curve is not None else None)
    from trtspec.spec.adaptive import DEFAULT_MAX_DRAFT_LEN
    from trtspec.spec.cost_curve import chooser

    k = cap or DEFAULT_MAX_DRAFT_LEN
    timed = time_models and curve is None
    adaptive = chooser(method, k, curve, target if timed else None,
                       proposer.draft_runner if timed else None, say=say, slots=slots)
    return SpecExecutor(target, proposer, k, adaptive=adaptive, eos_token_ids=eos_token_ids)


def eos_token_ids(lm: Any) -> frozenset[int]:
    """Every id that ends a request: the tokenizer's EOS and each one the model's config and
    generation config list (Llama-3 lists several, e.g. <|eot_id|> and <|end_of_text|>)."""
    ids: set[int] = set()
    sources = (lm.tokenizer.eos_token_id, lm.model.config.eos_token_id,
               getattr(lm.model.generation_config, "eos_token_id", None))
    for value in sources:
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list | tuple):
            ids.update(int(v) for v in value)
    return frozenset(ids)


def check_backend_device(recipe: Recipe, recipe_path: str | Path) -> None:
    """The torch backend's ``backend.device`` exists on this machine (build and eval)."""
    from trtspec.runtime.models import check_device

    try:
        check_device(recipe.backend.device)
    except ValueError as e:
        raise RecipeError(f"{recipe_path}: backend.device: {e}") from None


def open_build(source: str | Path, overrides: Iterable[str] = (),
               engines_root: str | Path = "engines", say: Callable[[str], None] = _stderr
               ) -> tuple[OpenBuild, str]:
    """A recipe's build under ``engines_root``, or a build folder (engines/<recipe>/<gpu>/,
    which holds the recipe as built); checked against this machine and the recipe (with
    ``overrides``). Returns the opened build and the recipe's path."""
    from trtspec.build.gpu import detect
    from trtspec.build.manifest import (
        BUILT_RECIPE,
        ManifestError,
        check_covers,
        check_gpu,
        load_manifest,
        open_built,
    )

    folder = Path(source) if Path(source).is_dir() else None
    recipe_path = str(source)
    if folder is not None:  # a build folder: the recipe it was built from is in it
        if not (folder / BUILT_RECIPE).is_file():
            raise RecipeError(f"{folder}: no {BUILT_RECIPE} here (a build folder is "
                              "engines/<recipe>/<gpu>/, written by `trtspec build`)")
        recipe_path = str(folder / BUILT_RECIPE)
    recipe = load_recipe(recipe_path, list(overrides))
    check_in_process(recipe, recipe_path)
    if folder is not None:
        manifest = load_manifest(folder)
        check_gpu(manifest, detect(), folder / "manifest.json")
        problem = check_covers(manifest, recipe)
        if problem:
            raise ManifestError(f"{folder}: the build {problem} (--set overrides?)")
    else:
        manifest, _ = open_built(recipe, recipe_path, engines_root)
    if recipe.backend.kind == "torch":
        check_backend_device(recipe, recipe_path)
    return open_models(recipe, manifest, recipe_path, say), recipe_path
