"""`trtspec serve`: the recipe's built models behind an OpenAI-compatible server."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

import click

from trtspec.adaptive import ADAPTIVE, DEFAULT_MAX_DRAFT_LEN
from trtspec.cli.evaluation import ENGINES_HELP, engines_root, explain_engines


class DraftLen(click.ParamType):
    """A draft length 0 … 64, or adaptive."""

    name = "D|adaptive"

    def convert(self, value: Any, param: Any, ctx: Any) -> int | str:
        if value == ADAPTIVE or isinstance(value, int):
            return value
        try:
            d = int(value)
        except ValueError:
            d = -1
        if not 0 <= d <= 64:
            self.fail(f"{value!r} is not a draft length: give 0 … 64 or adaptive", param, ctx)
        return d


@click.command()
@click.argument("recipe", required=False, type=click.Path())
@click.option("--backend", type=click.Choice(["recipe", "toy"]), default="recipe",
              show_default=True, help="toy: exact Markov-chain models, no weights (tries, tests)")
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", type=click.IntRange(0, 65535), default=8000, show_default=True)
@click.option("--api-key", default=None, help="require Bearer KEY [default: $TRTSPEC_API_KEY]")
@click.option("--method", default=None,
              help="speculation method of the recipe, or none [default: the recipe's first]")
@click.option("--draft-len", "-D", type=DraftLen(), default=None,
              help="D for every round, or adaptive: each request chooses D ≤ the recipe's "
                   "max_draft_len per round [default: the recipe's first draft length]")
@click.option("--draft-len-schedule", default=None, metavar="RUNNING:D,…",
              help="D by number of running requests, e.g. 1:4,4:2,8:0 (0 beyond the last; "
                   "a D may be adaptive)")
@click.option("--policy", "policy_dir", type=click.Path(exists=True, file_okay=False),
              default=None, help="a decided eval folder: its GO conditions set method and D "
                                 "per concurrency; plain decoding where none is GO")
@click.option("--slots", type=click.IntRange(1), default=None,
              help="requests decoded together [default: the recipe's limits.max_batch_size]")
@click.option("--max-waiting", type=click.IntRange(0), default=256, show_default=True,
              help="queued requests beyond the slots; more are refused (429)")
@click.option("--served-model-name", default=None, help="[default: the recipe's target.model]")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE")
@click.option("--engines", default=None, type=click.Path(), help=ENGINES_HELP)
def serve(recipe: str | None, backend: str, host: str, port: int, api_key: str | None,
          method: str | None, draft_len: int | str | None, draft_len_schedule: str | None,
          policy_dir: str | None, slots: int | None, max_waiting: int,
          served_model_name: str | None, overrides: tuple[str, ...], engines: str | None
          ) -> None:
    """Serve RECIPE's built models, or a build folder (engines/<recipe>/<gpu>/), behind an
    OpenAI-compatible server (/v1/completions, /v1/chat/completions, /v1/models, /health,
    /metrics) with exact speculative sampling and continuous batching."""
    import uvicorn

    from trtspec.manifest import ManifestError
    from trtspec.scheduler import DraftPolicy
    from trtspec.serve.server import make_app

    if policy_dir and (draft_len is not None or draft_len_schedule):
        raise click.UsageError("--policy sets D: drop --draft-len / --draft-len-schedule")
    if policy_dir:
        method, schedule = policy_from_eval(Path(policy_dir), method)
    else:
        schedule = draft_len_schedule
    try:  # a schedule with an adaptive D needs an executor that can choose it
        if schedule and DraftPolicy.parse(schedule).adaptive:
            draft_len = ADAPTIVE
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--draft-len-schedule") from None
    if backend == "toy":
        engine, label = toy_engine(method or "draft_model", draft_len, slots or 8,
                                   max_waiting, served_model_name or "toy")
    else:
        if recipe is None:
            raise click.UsageError("give a RECIPE or a build folder (or --backend toy)")
        root, why = engines_root(recipe, engines)
        try:
            engine, label = recipe_engine(recipe, overrides, root, method, draft_len, slots,
                                          max_waiting, served_model_name)
        except ManifestError as e:
            raise explain_engines(e, root, why) from None
    if schedule and engine.scheduler.executor.proposer is not None:
        engine.scheduler.policy = DraftPolicy.parse(schedule)
        label += f", D by running requests {schedule} (0 beyond)"
    elif schedule:
        label += " (the schedule is moot: plain decoding)"
    engine.policy = label
    key = api_key or os.environ.get("TRTSPEC_API_KEY")
    click.echo(f"trtspec serve: http://{host}:{port}/v1  model {engine.model}  policy {label}  "
               f"slots {engine.scheduler.slots}  (waiting ≤ {engine.scheduler.max_waiting}"
               f"{', API key required' if key else ''})")
    class Draining(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:  # /health 503 from now on
            engine.draining = True
            super().handle_exit(sig, frame)

    # uvicorn re-raises the signal it shut down on; SIGTERM is a normal stop here (exit 0)
    signal.signal(signal.SIGTERM, lambda *_: None)
    Draining(uvicorn.Config(make_app(engine, key), host=host, port=port, log_level="warning",
                            timeout_graceful_shutdown=30)).run()
    click.echo(f"trtspec serve: stopped ({engine.scheduler.running} requests were still "
               "running)")


def policy_from_eval(folder: Path, method: str | None) -> tuple[str, str | None]:
    """(method, draft length schedule) from a decided eval: the method with the most GO
    conditions (or ``method``); for every concurrency the eval measured, its fastest GO draft
    length (adaptive when that is an adaptive condition), or 0 (plain decoding) where no D was
    GO; plain decoding everywhere ("none") when nothing is GO."""
    from trtspec.metrics import condition_parts

    path = folder / "decision.json"
    if not path.is_file():
        raise click.UsageError(f"--policy {folder}: no decision.json (run `trtspec decide "
                               f"{folder}` first)")
    overall = [v for v in json.loads(path.read_text())["verdicts"] if v["category"] == "all"]
    if any(v["condition"].startswith("endpoint/") for v in overall):
        raise click.UsageError(f"--policy {folder}: an endpoint eval measured a server's own "
                               "policy, not trtspec's methods: use an in-process eval")
    levels = sorted({condition_parts(v["condition"])[2] for v in overall})
    go: dict[str, dict[int, tuple[float, int | str]]] = {}
    for v in overall:
        if v["verdict"] != "GO":
            continue
        name, d, c = condition_parts(v["condition"])  # d: an int or "adaptive"
        best = go.setdefault(name, {}).get(c)
        if best is None or v["speedup"] > best[0]:
            go[name][c] = (v["speedup"], d)
    if method is None:
        method = max(go, key=lambda m: len(go[m]), default="none")
    if method not in go:
        return "none", None
    return method, ",".join(f"{c}:{go[method].get(c, (0, 0))[1]}" for c in levels)


def recipe_engine(recipe_path: str, overrides: tuple[str, ...], root: Path,
                  method: str | None, draft_len: int | str | None, slots: int | None,
                  max_waiting: int, name: str | None) -> tuple[Any, str]:
    from trtspec.build import check_backend_device
    from trtspec.eval import _executor_factory, _loaded_models
    from trtspec.eval.run import Condition
    from trtspec.manifest import open_built
    from trtspec.recipe import RecipeError, load_recipe
    from trtspec.scheduler import Scheduler
    from trtspec.serve.server import Engine, Limits, TokenizerTexts

    folder = Path(recipe_path) if Path(recipe_path).is_dir() else None
    if folder is not None:  # a build folder: the recipe it was built from is in it
        from trtspec.build import BUILT_RECIPE

        if not (folder / BUILT_RECIPE).is_file():
            raise RecipeError(f"{folder}: no {BUILT_RECIPE} here (a build folder is "
                              "engines/<recipe>/<gpu>/, written by `trtspec build`)")
        recipe_path = str(folder / BUILT_RECIPE)
    recipe = load_recipe(recipe_path, overrides)
    if recipe.backend.kind != "torch":
        raise RecipeError(f"{recipe_path}: trtspec serve runs the torch backend; serve "
                          "TensorRT-LLM builds with the trtllm-serve commands `trtspec build "
                          "--dry-run` prints")
    if folder is not None:
        from trtspec.gpu import detect
        from trtspec.manifest import ManifestError, check_covers, check_gpu, load_manifest

        manifest = load_manifest(folder)
        check_gpu(manifest, detect(), folder / "manifest.json")
        problem = check_covers(manifest, recipe)
        if problem:
            raise ManifestError(f"{folder}: the build {problem} (--set overrides?)")
    else:
        manifest, _ = open_built(recipe, recipe_path, root)
    check_backend_device(recipe, recipe_path)
    methods = [m.method for m in recipe.methods]
    method = method or methods[0]
    if method not in (*methods, "none"):
        raise RecipeError(f"--method {method}: the recipe has {', '.join(methods)} (or none)")
    lengths = recipe.condition_draft_lengths(manifest.draft_lengths)
    d = lengths[0] if draft_len is None else draft_len  # an int, or adaptive
    models = _loaded_models(manifest, recipe)
    make = _executor_factory(recipe, manifest, models)
    executor = make(Condition(method, d, 1), "baseline" if method == "none" or d == 0 else "spec")
    scheduler = Scheduler(executor, slots or recipe.limits.max_batch_size,
                          max_waiting=max_waiting)
    if getattr(executor.target, "compiled", False):  # --slots: graphs for that batch, now
        executor.target.warm_up(scheduler.slots)
    limits = Limits(max_input_len=recipe.limits.max_input_len,
                    max_seq_len=recipe.limits.max_seq_len)
    label = "plain decoding" if executor.proposer is None else f"{method}, " + (
        f"adaptive D ≤ {executor.draft_len}" if executor.adaptive else f"D = {d}")
    return Engine(scheduler, TokenizerTexts(models().tokenizer), name or recipe.target.model,
                  limits), label


def toy_engine(method: str, draft_len: int | str | None, slots: int, max_waiting: int,
               name: str) -> tuple[Any, str]:
    """The toy models `trtspec generate --backend toy` uses by default (vocab 32, order 2,
    seed 0; the draft diverged 0.3 with seed 1), so their outputs can be compared."""
    from trtspec.executor import SpecExecutor
    from trtspec.propose import make_proposer
    from trtspec.runtime.toy import MarkovLM, ToyRunner
    from trtspec.scheduler import Scheduler
    from trtspec.serve.server import Engine, IdTexts, Limits

    if method not in ("none", "draft_model", "ngram", "suffix"):
        raise click.BadParameter("the toy backend runs none, draft_model, ngram or suffix",
                                 param_hint="--method")
    target = MarkovLM(32, 2, seed=0)
    d = 4 if draft_len is None else draft_len
    proposer = make_proposer(method, draft=ToyRunner(target.diverged(0.3, seed=1)),
                             draft_len=DEFAULT_MAX_DRAFT_LEN if d == ADAPTIVE else int(d))
    if d == ADAPTIVE:  # toy models are not timed: the fallback cost curve, said once
        from trtspec.cost_curve import chooser

        executor = SpecExecutor(ToyRunner(target), proposer, DEFAULT_MAX_DRAFT_LEN,
                                adaptive=chooser(method, DEFAULT_MAX_DRAFT_LEN, say=click.echo))
    else:
        executor = SpecExecutor(ToyRunner(target), proposer, int(d))
    label = "plain decoding" if proposer is None or d == 0 else f"{method}, " + (
        f"adaptive D ≤ {DEFAULT_MAX_DRAFT_LEN}" if d == ADAPTIVE else f"D = {d}")
    return Engine(Scheduler(executor, slots, max_waiting=max_waiting), IdTexts(), name,
                  Limits()), label
