"""`trtspec eval`, and what the measuring commands share: where the build folder is, and
logging to MLflow after the measurements are on disk."""

from __future__ import annotations

import json
import os
import shlex
import sys
from pathlib import Path
from typing import Any

import click
from rich.console import Console
from rich.table import Table

ENGINES_HELP = ("build folder [default: $TRTSPEC_ENGINES, else engines/ in the recipe's project "
                "(the folder holding recipes/), else ./engines]")


def engines_root(recipe_path: str | Path, flag: str | None) -> tuple[Path, str]:
    """(the build folder, how it was chosen): --engines, $TRTSPEC_ENGINES, the recipe's project
    (the folder holding its recipes/), or the working directory. So build, eval and audit agree
    from any folder. Relative to the working directory when inside it (plans stay portable)."""
    if flag:
        root, why = Path(flag), "from --engines"
    elif os.environ.get("TRTSPEC_ENGINES"):
        root, why = Path(os.environ["TRTSPEC_ENGINES"]), "from $TRTSPEC_ENGINES"
    else:
        recipe = Path(recipe_path).absolute()
        project = next((p.parent for p in recipe.parents if p.name == "recipes"), None)
        root, why = (project / "engines", f"the project of {recipe_path}") if project else (
            Path("engines"), f"the working directory ({recipe_path} is in no recipes/)")
    full = Path(os.path.abspath(root))  # normalised (no ..), symlinks kept
    try:
        return full.relative_to(Path.cwd()), why
    except ValueError:
        return full, why


def explain_engines(error: Exception, root: Path, why: str) -> Exception:
    """A build-folder error, with where trtspec looked and how to look elsewhere."""
    return type(error)(f"{error} (looked in {root.absolute()}: {why}; --engines or "
                       "$TRTSPEC_ENGINES choose another)")


def _concurrency(_ctx: click.Context, _param: click.Parameter, value: str | None
                 ) -> tuple[int, ...]:
    if not value:
        return ()
    try:
        levels = tuple(int(v) for v in value.replace(" ", "").split(","))
    except ValueError:
        raise click.BadParameter(f"{value!r}: give levels like 1,4,8") from None
    if any(c < 1 for c in levels) or len(set(levels)) != len(levels):
        raise click.BadParameter(f"{value!r}: give each level once, every level ≥ 1")
    return levels


@click.command("eval")
@click.argument("recipe", type=click.Path(dir_okay=False))
@click.option("--workload", "-w", "workloads", multiple=True,
              help="builtin, speed-bench:<config> or a JSONL file [default: the recipe's]")
@click.option("--per-category", type=click.IntRange(1), default=None,
              help="seeded stratified sample: at most N requests per category [default: the "
                   "recipe's eval.per_category for builtin and SPEED-Bench; a JSONL runs whole]")
@click.option("--num-prompts", type=click.IntRange(1), default=None,
              help="measure N requests (seeded, spread over the categories)")
@click.option("--repeat", type=click.IntRange(1, 100), default=1, show_default=True,
              help="measure each request R times, each a request of its own (id#2 …, its own "
                   "seed): more turns at c > 1 from a small workload")
@click.option("--max-tokens", type=click.IntRange(1), default=None,
              help="output limit of every request (the workload's own too) [default: the "
                   "recipe's sampling.max_tokens]")
@click.option("--ignore-eos", is_flag=True,
              help="generate through EOS: fixed output lengths (with --max-tokens)")
@click.option("--concurrency", callback=_concurrency, default=None, metavar="C[,C…]",
              help="concurrency levels, e.g. 1,4,8 [default: the recipe's eval.concurrency]")
@click.option("--request-rate", type=click.FloatRange(0, min_open=True), default=None,
              help="open-loop Poisson arrivals, requests/s (inf: all at once) instead of "
                   "--concurrency closed-loop clients")
@click.option("--eval-id", default=None, help="folder name under --reports [default: timestamp]")
@click.option("--resume", type=click.Path(exists=True, file_okay=False), default=None,
              help="continue an interrupted eval folder with its own workloads, knobs and "
                   "--set overrides, skipping what is recorded")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE")
@click.option("--engines", default=None, type=click.Path(), help=ENGINES_HELP)
@click.option("--reports", default="reports", show_default=True, type=click.Path())
@click.option("--speed-bench-dir", default=None, type=click.Path(),
              help="SPEED-Bench files [default: data/speed-bench, from here or the recipe's "
                   "project]")
@click.option("--mlflow-uri", default=None,
              help="tracking URI [default: $MLFLOW_TRACKING_URI, else sqlite:///mlflow.db; a "
                   "relative local store is made absolute]")
@click.option("--no-mlflow", is_flag=True, help="keep results local only")
@click.option("--endpoint", default=None,
              help="evaluate an OpenAI-compatible server (…/v1) instead of in-process models")
@click.option("--model", default=None, help="the model name the endpoint serves")
@click.option("--baseline-endpoint", default=None,
              help="the same model served without speculation (the baseline arm)")
@click.option("--launch", is_flag=True,
              help="a TensorRT-LLM pytorch-workflow recipe: start trtllm-serve on the build's "
                   "options files (baseline, then each method × D) and evaluate them as "
                   "endpoints, stopping each server after its arm")
@click.option("--side-by-side", is_flag=True,
              help="with --launch: run each condition's baseline and speculating servers at "
                   "once (arms alternate batch by batch), each with --kv-cache-fraction")
@click.option("--kv-cache-fraction", type=click.FloatRange(0, 1, min_open=True), default=None,
              help="with --launch: each server's kv_cache_free_gpu_memory_fraction "
                   "[default: TensorRT-LLM's; 0.4 with --side-by-side]")
@click.option("--until-decided", is_flag=True,
              help="after the plan, add requests (stratified by category, from the workloads' "
                   "unused rows) to the conditions still INCONCLUSIVE until each is decided, "
                   "with α spent over the looks")
@click.option("--max-requests", type=click.IntRange(1), default=None,
              help="with --until-decided: paired requests per condition at most [default: "
                   "4× the plan, at most every row of the workloads]")
@click.option("--confirm", "confirm", default=None,
              type=click.Path(exists=True, file_okay=False),
              help="re-measure only what that decided eval chose (reports/<eval-id>) on "
                   "requests it has not seen; the report shows both verdicts")
def eval_command(recipe: str, workloads: tuple[str, ...], per_category: int | None,
                 num_prompts: int | None, repeat: int, max_tokens: int | None,
                 ignore_eos: bool,
                 concurrency: tuple[int, ...], request_rate: float | None,
                 eval_id: str | None, resume: str | None,
                 overrides: tuple[str, ...], engines: str | None, reports: str,
                 speed_bench_dir: str | None, mlflow_uri: str | None, no_mlflow: bool,
                 endpoint: str | None, model: str | None, baseline_endpoint: str | None,
                 launch: bool, side_by_side: bool, kv_cache_fraction: float | None,
                 until_decided: bool, max_requests: int | None, confirm: str | None) -> None:
    """Baseline vs speculative on RECIPE's built models; records land in reports/<eval-id>/.
    Ctrl-C keeps every finished request; `--resume reports/<eval-id>` goes on."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeRemainingColumn

    from trtspec.build.manifest import ManifestError
    from trtspec.eval import Interrupted, Selection, evaluate, evaluate_endpoint

    if resume and eval_id:
        raise click.UsageError("--resume names the eval folder: drop --eval-id")
    launched = _launch_settings(launch, side_by_side, kv_cache_fraction, endpoint,
                                baseline_endpoint, model, until_decided, confirm, resume)
    if resume and not endpoint:  # an endpoint eval resumes against its own servers
        from trtspec.eval.folder import stored_meta

        meta = stored_meta(Path(resume))
        if meta.get("launch") and launched is None:  # it starts them again
            from trtspec.eval.launched import Launch

            known = {k: v for k, v in meta["launch"].items()
                     if k in ("side_by_side", "kv_cache_fraction", "health_timeout")}
            launched = Launch(**known)
        elif meta.get("endpoint"):
            endpoint, model = meta["endpoint"], model or meta.get("model")
            baseline_endpoint = baseline_endpoint or meta.get("baseline_endpoint")
    if endpoint and not model:
        raise click.UsageError("--endpoint needs --model (the name the server serves)")
    if max_requests and not until_decided and not resume:  # a resumed one may be sequential
        raise click.UsageError("--max-requests is the budget of --until-decided: add it")
    if confirm and (resume or endpoint or until_decided):
        raise click.UsageError("--confirm starts a new in-process eval of the chosen setting: "
                               "drop " + ("--resume" if resume else "--endpoint" if endpoint
                                          else "--until-decided"))
    knobs = {"--workload": workloads, "--per-category": per_category,
             "--num-prompts": num_prompts, "--repeat": repeat > 1, "--max-tokens": max_tokens,
             "--ignore-eos": ignore_eos,
             "--concurrency": concurrency, "--request-rate": request_rate, "--set": overrides}
    if confirm and any(knobs.values()):
        given = ", ".join(k for k, v in knobs.items() if v)
        raise click.UsageError(f"--confirm measures with the confirmed eval's workloads, knobs "
                               f"and overrides: drop {given}")
    if until_decided and endpoint:
        raise click.UsageError("--until-decided runs in-process evals; an --endpoint eval "
                               "measures its plan (raise --per-category instead)")
    before = _records_in(resume)
    selection = Selection.make(workloads, per_category=per_category, num_prompts=num_prompts,
                               repeat=repeat,
                               max_tokens=max_tokens, ignore_eos=ignore_eos,
                               concurrency=concurrency, request_rate=request_rate,
                               overrides=overrides,
                               speed_bench_dir=speed_bench_dir)
    root, why = engines_root(recipe, engines)
    console = Console(width=None if sys.stdout.isatty() else 160)
    try:
        with Progress("[progress.description]{task.description}", BarColumn(),
                      MofNCompleteColumn(), TimeRemainingColumn(), transient=True,
                      console=console) as bar:
            task = bar.add_task("requests measured", total=None)
            tick = Ticker(bar, task, bar.console.is_terminal)

            def say(text: str) -> None:
                bar.console.print(text, highlight=False, markup=False)

            if launched is not None:
                from trtspec.eval.launched import evaluate_launched

                out = evaluate_launched(recipe, selection, eval_id, resume, root, reports,
                                        tick, say, launched)
            elif endpoint:
                out = evaluate_endpoint(recipe, endpoint, model or "", baseline_endpoint,
                                        selection, eval_id, resume, reports, tick, say)
            else:
                out = evaluate(recipe, selection, eval_id, resume, root, reports, tick, say,
                               until_decided, max_requests, confirm)
    except ManifestError as e:
        raise explain_engines(e, root, why) from None
    except Interrupted as e:
        if e.discarded:
            click.secho(f"interrupted before any request was measured: nothing kept ({e.out} "
                        "removed)", fg="yellow", err=True)
            sys.exit(130)
        again = ["trtspec", "eval", recipe, "--resume", str(e.out)]
        again += ["--engines", engines] if engines and not endpoint else []
        # a launched eval resumes with its stored settings (eval.json): no --launch here
        again += ["--mlflow-uri", mlflow_uri] if mlflow_uri else []
        again += ["--no-mlflow"] if no_mlflow else []
        total = f" of {e.total}" if e.total else ""
        click.secho(f"interrupted: {e.kept}{total} records kept in {e.out / 'records.jsonl'} "
                    f"(the requests in flight are measured again); continue with:\n  "
                    f"{shlex.join(again)}", fg="yellow", err=True)
        sys.exit(130)
    if resume and _records_in(resume) == before:
        click.echo(f"{out} was already complete ({before} records): nothing was measured; "
                   "its table as recorded:")
    print_summary(out)
    if not no_mlflow:
        log_to_mlflow(out, mlflow_uri)


def _launch_settings(launch: bool, side_by_side: bool, kv_cache_fraction: float | None,
                     endpoint: str | None, baseline_endpoint: str | None, model: str | None,
                     until_decided: bool, confirm: str | None, resume: str | None) -> Any:
    """A :class:`trtspec.eval.launched.Launch` for --launch (None without it), after the
    flags that do not go with it are refused."""
    if not launch:
        if side_by_side or kv_cache_fraction is not None:
            raise click.UsageError("--side-by-side and --kv-cache-fraction set how --launch "
                                   "runs its servers: add --launch")
        return None
    clash = [flag for flag, given in (("--endpoint", endpoint),
                                      ("--baseline-endpoint", baseline_endpoint),
                                      ("--model", model), ("--until-decided", until_decided),
                                      ("--confirm", confirm)) if given]
    if clash:
        raise click.UsageError(f"--launch starts the servers itself: drop {', '.join(clash)}")
    from trtspec.eval.launched import Launch

    if resume:
        from trtspec.eval.folder import stored_meta

        stored = stored_meta(Path(resume)).get("launch")
        if not stored:
            raise click.UsageError(f"--resume {resume}: that eval did not launch its servers: "
                                   "drop --launch")
        asked = {"side_by_side": side_by_side or None, "kv_cache_fraction": kv_cache_fraction}
        other = [k for k, v in asked.items() if v is not None and v != stored.get(k)]
        if other:  # its conditions mix nothing: the settings it started with, or refuse
            raise click.UsageError(f"--resume {resume}: that eval ran with "
                                   + ", ".join(f"{k} {stored.get(k)}" for k in other)
                                   + ": drop the flags (it resumes as it started)")
        return Launch(**{k: v for k, v in stored.items() if k in Launch.__dataclass_fields__})
    return Launch(side_by_side=side_by_side, kv_cache_fraction=kv_cache_fraction)


def _records_in(folder: str | None) -> int:
    from trtspec.eval.run import read_records

    return len(read_records(Path(folder))) if folder else -1


class Ticker:
    """Progress of an eval: the bar on a terminal (what is being measured, done / total, time
    left); elsewhere (CI, a log file) a plain line every ``every`` seconds, so a slow run can
    be told from a hung one."""

    def __init__(self, bar: Any, task: Any, tty: bool, every: float = 10.0,
                 echo: Any = None) -> None:
        import time

        self.bar, self.task, self.tty, self.every = bar, task, tty, every
        self.echo = echo or (lambda text: click.echo(text, err=True))
        self.clock, self.last, self.first = time.monotonic, 0.0, None

    def __call__(self, done: int, total: int, label: str = "") -> None:
        if self.tty:
            self.bar.update(self.task, completed=done, total=total,
                            description=label or "requests measured")
            return
        now = self.clock()
        if self.first is None or done == self.first[1]:  # the rate counts from a record
            self.first = (now, done)
        if now - self.last < self.every and done < total:
            return
        self.last = now
        since, start = now - self.first[0], self.first[1]
        left = ""
        if done > start and done < total:
            left = f", about {_duration((total - done) * since / (done - start))} left"
        self.echo(f"eval: {done}/{total} records{left}" + (f" · now {label}" if label else ""))


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"


def log_to_mlflow(out: Path, uri: str | None, decision: bool = False) -> None:
    """Log after the measurements are on disk; a tracking failure costs nothing measured."""
    from trtspec.report.tracking import log_decision, log_eval
    from trtspec.report.tracking.client import tracking_uri

    try:
        receipt = log_eval(out, uri)
        if decision:
            log_decision(out, receipt)
    except Exception as e:  # unreachable server, auth, disk: the eval folder is intact
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        again = f"trtspec decide {out}" if decision else f"trtspec sync {out}"
        click.secho(f"MLflow: not logged ({reason}). Everything is kept in {out}; run "
                    f"`{again}` when the server is back.", fg="yellow", err=True)
        return
    what = "report, verdicts and audit logged to run" if decision else {
        "relogged": "run (re-logged: the records changed since it was logged)"}.get(
        receipt.get("status", ""), "run")
    store = receipt.get("uri") or tracking_uri(uri)
    look = f"open {store}" if store.startswith(("http://", "https://")) else \
        f"`mlflow ui --backend-store-uri {store}`"
    click.echo(f"MLflow: {what} {receipt['run_id']} at {store} (compare runs: {look})")


def print_summary(out: Path) -> None:
    summary = json.loads((out / "summary.json").read_text())
    table = Table(title=f"eval {out.name}")
    for column in ("condition", "requests", "TPOT p50 base→spec ms", "speedup TPOT p50",
                   "AL pooled", "AL per-request", "acceptance rate", "a per token", "mean D",
                   "failed"):  # a: acceptance probability (α is the tests' significance)
        table.add_column(column, justify="left" if column == "condition" else "right")
    unpaired = 0
    for key, entry in summary.items():
        base, spec = entry.get("baseline", {}), entry.get("spec", {})
        unpaired += entry.get("unpaired_records", 0)
        table.add_row(key, str(int(spec.get("requests", 0))),
                      f"{_num(base.get('tpot_ms_p50'), '.1f')} → "
                      f"{_num(spec.get('tpot_ms_p50'), '.1f')}",
                      _num(entry.get("speedup_tpot_p50"), ".2f", "×"),
                      _num(spec.get("al_pooled")), _num(spec.get("al_request_mean")),
                      _num(spec.get("acceptance_rate")), _num(spec.get("alpha")),
                      _num(spec.get("draft_len_mean")),  # the D asked; adaptive: chosen
                      str(spec.get("failed_requests", 0) + base.get("failed_requests", 0)))
    Console(width=None if sys.stdout.isatty() else 160).print(table)  # logs: no truncation
    if unpaired:
        from trtspec.report.render import unpaired_note

        click.echo(unpaired_note(unpaired))
    click.echo(f"records: {out / 'records.jsonl'}\nsummary: {out / 'summary.json'}")


def _num(value: float | None, fmt: str = ".2f", unit: str = "") -> str:
    """A figure, or — where it is undefined (plain decoding has no acceptance rate)."""
    return "—" if value is None or value != value else f"{value:{fmt}}{unit}"
