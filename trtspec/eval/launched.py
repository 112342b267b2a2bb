"""``trtspec eval --launch``: an endpoint eval whose servers trtspec starts and stops itself.

For a TensorRT-LLM recipe on the pytorch workflow, ``trtspec build`` wrote one LLM API options
file per method × D (``llmapi/<method>-d<D>.yaml``) and one for plain decoding
(``llmapi/baseline.yaml``). This runs ``trtllm-serve`` on them (:mod:`trtspec.serve.launch`),
per method × D:

* **one after another** (the default): the baseline server, its arm of every request, stop;
  then the speculating server, its arm, stop. One model in GPU memory at a time; the arms do
  not alternate batch by batch (drift between them lands on one arm: the report says
  nothing of it, so keep the machine quiet).
* **side by side** (``side_by_side``): both servers at once, each with part of the KV cache
  (``kv_cache_fraction``), and the arms alternate batch by batch as in every other eval.

Both arms run the same scheduler settings: the baseline gets the speculating server's
``disable_overlap_scheduler`` (:func:`trtspec.serve.launch.same_scheduler`). Because trtspec
knows what each server ran, conditions are named as in-process ones, ``<method>/D<d>/c<c>``,
so ``trtspec decide`` writes schedules and the policy as for an in-process eval. Records,
counters and resume are the endpoint eval's (:func:`trtspec.eval.endpoint.run_arms`): a
resumed eval starts only the servers whose arms still lack records. At temperature 0 each
server is asked for top log-probabilities, so a divergence's margin is known.
The options files and logs of the servers are kept in ``<eval>/servers/``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from trtspec.build.recipe import Recipe, RecipeError, load_recipe
from trtspec.eval import EVERYTHING, finish_eval, kept_on_failure, target_dtype
from trtspec.eval.endpoint import (
    TOP_LOGPROBS,
    accepts_logprobs,
    record_divergences,
    run_arms,
    warm_up,
)
from trtspec.eval.folder import Selection, resumed_selection, start
from trtspec.eval.run import RECORDS, done_keys, read_jsonl
from trtspec.serve.launch import (
    EXECUTABLE,
    HEALTH_TIMEOUT_S,
    ServerSpec,
    TrtllmServer,
    find_executable,
    merged_options,
    read_options,
    same_scheduler,
)

SERVERS = "servers"  # <eval>/servers/: the options file and log of every server started
SIDE_BY_SIDE_FRACTION = 0.4  # of free GPU memory for each server's KV cache, side by side


@dataclass(frozen=True)
class Launch:
    """How the servers run: one after another, or side by side with ``kv_cache_fraction``
    each [default: TensorRT-LLM's own one after another, 0.4 side by side]."""

    side_by_side: bool = False
    kv_cache_fraction: float | None = None
    health_timeout: float = HEALTH_TIMEOUT_S

    @property
    def fraction(self) -> float | None:
        if self.kv_cache_fraction is None and self.side_by_side:
            return SIDE_BY_SIDE_FRACTION
        return self.kv_cache_fraction


@dataclass(frozen=True)
class Served:
    """One speculating server of the sweep: method × D, the options file build wrote."""

    method: str
    draft_len: int
    options: Path

    @property
    def name(self) -> str:
        return f"{self.method}-d{self.draft_len}"


def check_launchable(recipe: Recipe, recipe_path: str | Path) -> None:
    """--launch runs trtllm-serve on the options files of a pytorch-workflow trtllm build."""
    backend = recipe.backend
    if backend.kind != "trtllm" or backend.workflow != "pytorch":
        what = "the torch backend" if backend.kind != "trtllm" else "the engine workflow"
        raise RecipeError(f"{recipe_path}: --launch starts trtllm-serve on the options files "
                          "of a TensorRT-LLM pytorch-workflow build (backend.kind: trtllm, "
                          f"backend.workflow: pytorch); this recipe runs {what}: "
                          + ("evaluate it in process (drop --launch)" if backend.kind != "trtllm"
                             else "serve its engines yourself and pass --endpoint"))


def sweep(recipe: Recipe, manifest: Any, say: Callable[[str], None]
          ) -> tuple[Path, list[Served]]:
    """(the baseline options file, every method × D the build wrote options for)."""
    from trtspec.build.manifest import ManifestError

    def path_of(name: str) -> Path | None:
        try:
            return Path(manifest.artifact(name).path)
        except (ManifestError, KeyError, StopIteration, ValueError):
            return None

    baseline = path_of("baseline")
    if baseline is None:
        raise RecipeError("the build wrote no llmapi/baseline.yaml: `trtspec build` it again "
                          "with this trtspec")
    served: list[Served] = []
    for m in recipe.methods:
        for d in recipe.condition_draft_lengths(manifest.draft_lengths):
            path = path_of(f"{m.method}-d{d}")
            if path is None:
                say(f"note: {m.method} at D = {d} is left out: the build wrote no options "
                    "file for it")
                continue
            served.append(Served(m.method, int(d), path))
    if not served:
        raise RecipeError("the build wrote no speculative options file (llmapi/<method>-"
                          "d<D>.yaml) for the recipe's methods and draft lengths")
    return baseline, served


def server_spec(recipe: Recipe, name: str, options: dict[str, Any], launch: Launch
                ) -> ServerSpec:
    """The trtllm-serve flags of a recipe's target: its parallelism and limits."""
    t, limits = recipe.target, recipe.limits
    return ServerSpec(name=name, model=t.model, options=options, backend="pytorch",
                      tp_size=t.tp_size, pp_size=t.pp_size,
                      max_batch_size=limits.max_batch_size,
                      max_num_tokens=limits.max_num_tokens, max_seq_len=limits.max_seq_len,
                      kv_cache_fraction=launch.fraction)


def evaluate_launched(recipe_path: str | Path, selection: Selection = EVERYTHING,
                      eval_id: str | None = None, resume: str | Path | None = None,
                      engines_root: str | Path = "engines", reports_root: str | Path = "reports",
                      progress: Callable[[int, int, str], None] | None = None,
                      say: Callable[[str], None] = print, launch: Launch = Launch()) -> Path:
    """The recipe's workloads, sampling and concurrency against trtllm-serve servers started
    from its build's options files (module docstring); returns the eval folder."""
    from trtspec.build.manifest import open_built

    if resume:  # the folder's overrides decide which build is meant, and how it ran
        selection = resumed_selection(Path(resume), selection, recipe_path)
    recipe = load_recipe(recipe_path, selection.all_overrides())
    check_launchable(recipe, recipe_path)
    executable = find_executable()  # before any folder: nothing to clean up
    manifest, _ = open_built(recipe, recipe_path, engines_root)
    baseline_path, served = sweep(recipe, manifest, say)
    levels = list(dict.fromkeys(recipe.eval.concurrency))
    keys = [f"{s.method}/D{s.draft_len}/c{c}" for s in served for c in levels]
    mode = "side by side" if launch.side_by_side else "one after another"
    out, recipe, requests, selection, created = start(
        recipe_path, selection, eval_id, resume, reports_root, "-launched",
        lambda recipe, requests: {
            "endpoint": f"{EXECUTABLE} launched by trtspec ({mode})",
            "baseline_endpoint": f"{EXECUTABLE} launched by trtspec on llmapi/baseline.yaml",
            "model": recipe.target.model, "server": "trtllm", "client": "clients",
            "launch": {"executable": EXECUTABLE, **asdict(launch)},
            "conditions": keys, "expected_records": len(keys) * 2 * len(requests)}, say)
    total = len(keys) * 2 * len(requests)
    sampling = recipe.sampling.params()
    with kept_on_failure(out, created, total), _sigterm_interrupts():
        for s in served:
            spec_options = read_options(s.options)
            base_options = same_scheduler(read_options(baseline_path), spec_options)
            specs = {"baseline": server_spec(recipe, f"baseline-for-{s.name}",
                                             merged_options(base_options), launch),
                     "spec": server_spec(recipe, s.name, merged_options(spec_options), launch)}
            condition = [(c, f"{s.method}/D{s.draft_len}/c{c}") for c in levels]
            missing = _missing_arms(out, requests, [k for _, k in condition])
            if not missing:
                continue
            say(f"{s.name}: starting {EXECUTABLE} for the arms {', '.join(missing)} ({mode})")
            groups = [missing] if launch.side_by_side else [[arm] for arm in missing]
            k, decided = None, False  # by the first servers up, for both arms
            for arms in groups:
                with _servers({a: specs[a] for a in arms}, out / SERVERS, executable,
                              launch) as urls:
                    warm = [r.model_copy(update={"max_tokens": 8})  # as in-process evals
                            for r in requests[: recipe.eval.warmup]]
                    for url in urls.values():
                        warm_up(url, recipe.target.model, warm,
                                sampling.model_copy(update={"max_tokens": 8}))
                    if not decided:  # the same requests on both arms: both ask for the
                        k = TOP_LOGPROBS if sampling.greedy and all(  # lists, or neither
                            accepts_logprobs(u, recipe.target.model, requests[0], sampling)
                            for u in urls.values()) else None
                        decided = True
                        if sampling.greedy and k is None:
                            say(f"note: {s.name}: a server returned no top log-probabilities: "
                                "greedy divergences there have no margin")
                    run_arms(out, requests, urls, recipe.target.model, sampling, condition,
                             progress, recipe.eval.request_rate, k, total)
        if sampling.greedy:
            record_divergences(out, read_jsonl(out / RECORDS), target_dtype(recipe))
    return finish_eval(out, out / RECORDS)


def _missing_arms(out: Path, requests: Sequence[Any], keys: Sequence[str]) -> list[str]:
    """The arms (baseline first) with a request of ``keys`` not yet recorded."""
    done = done_keys(out / RECORDS)
    return [arm for arm in ("baseline", "spec")
            if any((k, arm, r.id) not in done for k in keys for r in requests)]


@contextlib.contextmanager
def _sigterm_interrupts() -> Iterator[None]:
    """SIGTERM (a supervisor's stop) ends the eval as Ctrl-C does: what was measured is kept
    and the servers, in sessions of their own, are stopped on the way out, not orphaned."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(_sig: int, _frame: Any) -> None:
        raise KeyboardInterrupt

    before = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, before)


@contextlib.contextmanager
def _servers(specs: dict[str, ServerSpec], folder: Path, executable: str, launch: Launch
             ) -> Iterator[dict[str, str]]:
    """The arms' servers started (one at a time, each healthy before the next starts, so the
    second's KV-cache fraction is of what the first left) and stopped; yields arm → URL."""
    with contextlib.ExitStack() as stack:
        urls = {}
        for arm, spec in specs.items():
            server = TrtllmServer(spec, folder, executable, launch.health_timeout)
            urls[arm] = stack.enter_context(server).url
        yield urls
