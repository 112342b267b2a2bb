"""`trtspec serve`: the recipe's built models behind an OpenAI-compatible server."""

from __future__ import annotations

import math
import os
import signal
from pathlib import Path
from typing import Any

import click

from trtspec.build.open import PLAIN
from trtspec.cli.evaluation import ENGINES_HELP, engines_root, explain_engines
from trtspec.cli.policy import policy_arg, policy_from_eval
from trtspec.serve.slots import DraftPolicy
from trtspec.spec.adaptive import ADAPTIVE


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
@click.option("--policy", "policy_dir", callback=lambda ctx, param, value: policy_arg(value),
              default=None, help="what `trtspec decide` chose: its policy file "
                                 "(schedules/trtspec-policy.yaml), a decided eval folder, or "
                                 "an approved version in MLflow's registry "
                                 "(models:/<name>@approved, models:/<name>/<version>; "
                                 "--mlflow-uri): method and D by running requests; plain "
                                 "decoding where none is GO")
@click.option("--mlflow-uri", default=None, help="the registry --policy models:/… reads "
              "[default: $MLFLOW_TRACKING_URI, else sqlite:///mlflow.db]")
@click.option("--slots", type=click.IntRange(1), default=None,
              help="requests decoded together [default: the recipe's limits.max_batch_size]")
@click.option("--max-waiting", type=click.IntRange(0), default=256, show_default=True,
              help="queued requests beyond the slots; more are refused (429)")
@click.option("--prefill-chunk", type=click.IntRange(1), default=None,
              help="most prompt tokens a step prefills, over all admissions, so running "
                   "streams keep decoding while a long prompt comes in; on the compiled "
                   "runner on a CPU, counted at a prompt's start: further in, a token counts "
                   "more, by the context it attends (docs/serve.md) [default: 16 on a "
                   "CPU, 512 on a GPU; a step's whole budget is limits.max_num_tokens]")
@click.option("--prefill-stall", type=click.FloatRange(0, min_open=True), default=None,
              help="while requests decode, a step's prompt chunk aims at this many times "
                   "its round (the chunk learnt from the steps' times, at least 4 tokens), "
                   "so running streams' inter-token gap aims at (1 + this) rounds while a "
                   "long prompt comes in, at the cost of that prompt's TTFT [default: off: "
                   "--prefill-chunk tokens a step]")
@click.option("--served-model-name", default=None, help="[default: the recipe's target.model]")
@click.option("--per-request-spec-decode-metrics", "spec_metrics",
              type=click.Choice(["none", "summary", "detailed"]), default="summary",
              show_default=True, help="each response's metrics.speculative_decoding, in vLLM's "
              "shape (detailed: also per round); the spec extension is always there")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE")
@click.option("--engines", default=None, type=click.Path(), help=ENGINES_HELP)
@click.option("--native", is_flag=True,
              help="a TensorRT-LLM pytorch-workflow build: launch trtllm-serve on the options "
                   "file build wrote for --method / --draft-len (with --policy: its "
                   "schedule merged in), wait for /health, print the endpoint, forward "
                   "SIGINT/SIGTERM, exit when it exits")
@click.option("--kv-cache-fraction", type=click.FloatRange(0, 1, min_open=True), default=None,
              help="with --native: trtllm-serve's kv_cache_free_gpu_memory_fraction (two "
                   "servers on one GPU) [default: TensorRT-LLM's]")
def serve(recipe: str | None, backend: str, host: str, port: int, api_key: str | None,
          method: str | None, draft_len: int | str | None, draft_len_schedule: str | None,
          policy_dir: str | None, slots: int | None, max_waiting: int,
          served_model_name: str | None, spec_metrics: str, overrides: tuple[str, ...],
          engines: str | None, mlflow_uri: str | None, native: bool,
          kv_cache_fraction: float | None, prefill_chunk: int | None,
          prefill_stall: float | None) -> None:
    """Serve RECIPE's built models, or a build folder (engines/<recipe>/<gpu>/), behind an
    OpenAI-compatible server (/v1/completions, /v1/chat/completions, /v1/models, /health,
    /metrics) with exact speculative sampling and continuous batching."""
    import time

    import uvicorn

    from trtspec.build.manifest import ManifestError
    from trtspec.serve.server import freeze_heap, make_app

    began = time.perf_counter()
    if prefill_stall is not None and not math.isfinite(prefill_stall):
        raise click.UsageError(f"--prefill-stall must be a finite number > 0, got "
                               f"{prefill_stall}")
    if kv_cache_fraction is not None and not native:
        raise click.UsageError("--kv-cache-fraction sizes trtllm-serve's KV cache: add --native")
    if policy_dir and (draft_len is not None or draft_len_schedule):
        raise click.UsageError("--policy sets D: drop --draft-len / --draft-len-schedule")
    if draft_len is not None and draft_len_schedule:
        raise click.UsageError("give --draft-len (every round) or --draft-len-schedule (D by "
                               "running requests), not both")
    if method == PLAIN and (draft_len is not None or draft_len_schedule or policy_dir):
        raise click.UsageError("--method none decodes plainly: drop --draft-len / "
                               "--draft-len-schedule / --policy (or choose a method)")
    if backend == "toy" and (recipe or overrides or engines):
        raise click.UsageError("--backend toy serves toy models: drop RECIPE, --set and "
                               "--engines")
    if native:
        from trtspec.cli.serve_native import refuse_in_process_flags, serve_native

        refuse_in_process_flags(backend)
        if recipe is None:
            raise click.UsageError("--native serves a TensorRT-LLM build: give its RECIPE or "
                                   "build folder")
        serve_native(recipe, overrides, engines, method, draft_len, draft_len_schedule,
                     policy_dir, mlflow_uri, host, port, kv_cache_fraction)
        return
    notes: list[str] = []
    schedule, registered, decided = None, None, None  # decided: (its label, build digest)
    if policy_dir and policy_dir.startswith("models:/"):
        from trtspec.analysis.policy import decided_build
        from trtspec.report.approve import fetch_approved

        fetched = fetch_approved(policy_dir, mlflow_uri)
        registered = fetched.describe()
        method, schedule = policy_from_eval(fetched.folder, method, notes, label=policy_dir)
        decided = policy_dir, decided_build(fetched.folder)
    elif policy_dir:
        from trtspec.analysis.policy import decided_build

        method, schedule = policy_from_eval(Path(policy_dir), method, notes)
        decided = policy_dir, decided_build(policy_dir)
    elif draft_len_schedule:
        try:
            schedule = DraftPolicy.parse(draft_len_schedule)
        except ValueError as e:
            raise click.BadParameter(str(e), param_hint="--draft-len-schedule") from None
    if schedule is not None:  # the executor can draft the most any round asks for
        draft_len = ADAPTIVE if schedule.adaptive else max(int(d) for _, d in schedule.schedule)
    if backend == "toy":
        engine = toy_engine(method or "draft_model", draft_len, slots or 8, max_waiting,
                            served_model_name or "toy")
    else:
        if recipe is None:
            raise click.UsageError("give a RECIPE or a build folder (or --backend toy)")
        root, why = engines_root(recipe, engines)
        try:
            engine = recipe_engine(recipe, overrides, root, method, draft_len, slots,
                                   max_waiting, served_model_name, decided, schedule)
        except ManifestError as e:
            raise explain_engines(e, root, why) from None
    scheduler = engine.scheduler
    chunking = getattr(scheduler, "prefill_chunk", None)  # trtspec's scheduler, no heads
    for knob, value in (("prefill_chunk", prefill_chunk), ("prefill_stall", prefill_stall)):
        flag = "--" + knob.replace("_", "-")
        if value is None:
            continue
        if not hasattr(scheduler, knob):
            raise click.UsageError(f"{flag} is trtspec's scheduler's: TensorRT-LLM chunks "
                                   "prompts by itself within limits.max_num_tokens")
        if chunking is None:
            notes.append(f"{flag}: draft heads read a prompt's hidden states from one call, "
                         "so prompts are prefilled whole")
        else:
            setattr(scheduler, knob, value)
    chunking = getattr(scheduler, "prefill_chunk", None)
    if chunking is not None:
        paced = getattr(scheduler, "prefill_stall", None)
        context = None if paced else getattr(scheduler, "prefill_context", None)
        notes.append(f"prompts are prefilled {'≤ ' if paced else ''}{chunking} tokens a step"
                     + (f", paced to {paced:g}× a round while others decode" if paced else "")
                     + (f" at a prompt's start, fewer further in (a token at position p "
                        f"counts 1 + p/{context:.0f}; at least "
                        f"{scheduler.least_chunk(chunking)})"
                        if context else "")
                     + f" (at most {scheduler.max_num_tokens} tokens a step in all)")
    if schedule is not None and scheduler.speculates:
        scheduler.policy = schedule
        if schedule.unreachable(scheduler.slots):
            notes.append("schedule entries past --slots "
                         f"{scheduler.slots} never apply: " + ",".join(
                             f"{c}:{d}" for c, d in schedule.unreachable(scheduler.slots)))
    if recipe is not None and backend != "toy":
        notes += exactness_notes(recipe, overrides, engine.method)
    engine.policy, engine.spec_metrics = describe_policy(engine), spec_metrics
    frozen, pass_s = freeze_heap()  # after warm-up: what the server holds for good
    notes.append(f"{frozen:,} objects held for good are out of the garbage collector's "
                 f"passes (the collection before the freeze took {pass_s:.2f} s; in "
                 "service every stream would wait through a full one)")
    key = api_key or os.environ.get("TRTSPEC_API_KEY")
    click.echo(f"trtspec serve: http://{host}:{port}/v1  model {engine.model}  slots "
               f"{scheduler.slots} (waiting ≤ {scheduler.max_waiting}"
               f"{', API key required' if key else ''})  ready in "
               f"{time.perf_counter() - began:.0f} s")
    if registered:
        click.echo(f"policy: {registered}")
    click.echo(f"policy: {engine.policy}")
    for note in notes:
        click.echo(f"note: {note}")

    class Draining(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:  # /health 503 from now on
            engine.draining = True
            super().handle_exit(sig, frame)

    # uvicorn re-raises the signal it shut down on; SIGTERM is a normal stop here (exit 0)
    signal.signal(signal.SIGTERM, lambda *_: None)
    Draining(uvicorn.Config(make_app(engine, key), host=host, port=port, log_level="warning",
                            timeout_graceful_shutdown=30)).run()
    click.echo(f"trtspec serve: stopped ({scheduler.running} requests were still running)")


def exactness_notes(recipe_path: str, overrides: tuple[str, ...], method: str) -> list[str]:
    """A TensorRT-LLM recipe's line on whether what is served keeps the target's output
    distribution at its temperature (nothing for the torch backend, or plain decoding)."""
    from trtspec.build.open import trtllm_exactness
    from trtspec.build.recipe import load_recipe

    recipe_file = Path(recipe_path)
    if recipe_file.is_dir():
        from trtspec.build.manifest import BUILT_RECIPE

        recipe_file = recipe_file / BUILT_RECIPE
    found = trtllm_exactness(load_recipe(recipe_file, list(overrides))).get(method)
    if found is None:
        return []
    return [f"TensorRT-LLM mode {found['mode']}: exact at the recipe's temperature: "
            f"{found['exact']} ({found['why']})"]


def describe_policy(engine: Any) -> str:
    """The whole policy as it will run: method, D by load, and what else shapes drafts."""
    scheduler = engine.scheduler
    if not scheduler.speculates:
        return "plain decoding"
    text = f"{engine.method}, " + scheduler.policy.describe(scheduler.slots, scheduler.draft_len)
    arm = getattr(scheduler, "arm", None)
    if arm is not None:  # TensorRT-LLM's batch
        return text + (f"; TensorRT-LLM {arm.decoding_type} drafts" if arm.mode == "native"
                       else "; trtspec drafts, TensorRT-LLM verifies")
    proposer = scheduler.executor.proposer
    if hasattr(proposer, "describe"):  # suffix: whose text drafts come from; heads: which
        text += f"; {proposer.describe()}"
    return text


def recipe_engine(recipe_path: str, overrides: tuple[str, ...], root: Path,
                  method: str | None, draft_len: int | str | None, slots: int | None,
                  max_waiting: int, name: str | None,
                  decided: tuple[str, str | None] | None = None, schedule: Any = None) -> Any:
    """The served model of a recipe's build (or a build folder): its runner warmed up for
    ``slots`` before the scheduler takes its rows. ``decided``: a --policy and the build
    digest it was decided on; another build is refused before any warm-up. ``schedule``: the
    policy's D by load, which a TensorRT-LLM arm (native, drafter) is made with."""
    from trtspec.build.open import open_build
    from trtspec.serve.llmapi import make_scheduler
    from trtspec.serve.server import Engine, Limits, TokenizerTexts

    build, _ = open_build(recipe_path, overrides, root,
                          say=lambda line: click.echo(line, err=True))
    recipe = build.recipe
    if decided and decided[1] and decided[1] != build.manifest.build_digest:
        raise click.UsageError(f"--policy {decided[0]} was decided on another build "
                               f"({decided[1][:12]}; this one is "
                               f"{str(build.manifest.build_digest)[:12]}): evaluate this build, "
                               "or serve the build that eval measured")
    if method is None and not build.method_names:  # every method left out (heads untrained)
        raise click.UsageError(f"the build runs none of the recipe's methods ("
                               f"{'; '.join(build.manifest.left_out().values())}): give "
                               "--method none for plain decoding")
    method = method or build.method_names[0]
    build.check_method(method)  # before any warm-up
    d = recipe.condition_draft_lengths(build.manifest.draft_lengths)[0] if draft_len is None \
        else draft_len  # an int, or adaptive
    slots = slots or recipe.limits.max_batch_size
    if getattr(recipe.backend, "mode", "exact") == "exact":  # trtspec's runner: its graphs for
        build.warm_up(slots, watch=True)  # that batch, before any request
    arm = build.arm(method, d, schedule)  # an LlmArm: TensorRT-LLM's batch (native, drafter)
    limits = Limits(max_input_len=recipe.limits.max_input_len,
                    max_seq_len=recipe.limits.max_seq_len)
    return Engine(make_scheduler(arm, slots, max_waiting=max_waiting,
                                 max_num_tokens=recipe.limits.max_num_tokens),
                  TokenizerTexts(build.tokenizer), name or recipe.target.model, limits,
                  method=method)


def toy_engine(method: str, draft_len: int | str | None, slots: int, max_waiting: int,
               name: str) -> Any:
    """The toy models `trtspec generate --backend toy` uses by default (vocab 32, order 2,
    seed 0; the draft diverged 0.3 with seed 1), so their outputs can be compared."""
    from trtspec.build.open import executor_for
    from trtspec.runtime.toy import MarkovLM, ToyRunner
    from trtspec.serve.scheduler import Scheduler
    from trtspec.serve.server import Engine, IdTexts, Limits
    from trtspec.spec.propose import make_proposer, method_named

    if method not in (PLAIN, "draft_model", "ngram", "suffix"):
        raise click.BadParameter("the toy backend runs none, draft_model, ngram or suffix",
                                 param_hint="--method")
    target = MarkovLM(32, 2, seed=0)
    runner = ToyRunner(target)
    proposer = make_proposer(method_named(method), runner,
                             draft=ToyRunner(target.diverged(0.3, seed=1)))
    executor = executor_for(runner, proposer, method, 4 if draft_len is None else draft_len,
                            time_models=False, say=click.echo)  # toy models are not timed
    return Engine(Scheduler(executor, slots, max_waiting=max_waiting), IdTexts(), name,
                  Limits(), method=method)
