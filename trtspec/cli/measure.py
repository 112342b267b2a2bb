"""The measuring commands: build, eval, audit, decide, sync, prepare-data, doctor."""

from __future__ import annotations

import sys
from pathlib import Path

import click
from rich.console import Console
from rich.table import Table

from trtspec.cli.evaluation import ENGINES_HELP, engines_root, explain_engines, log_to_mlflow


@click.command()
@click.argument("recipe", type=click.Path(dir_okay=False))
@click.option("--gpu", default=None, help="plan for this GPU (H200, A100-80GB, …) instead of "
              "the recipe's / this machine's")
@click.option("--dry-run", is_flag=True, help="print the plan as shell and stop")
@click.option("--force", is_flag=True, help="rebuild even if the manifest is up to date")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
              help="override a recipe value, e.g. --set limits.max_batch_size=16")
@click.option("--engines", default=None, type=click.Path(), help=ENGINES_HELP)
def build(recipe: str, gpu: str | None, dry_run: bool, force: bool, overrides: tuple[str, ...],
          engines: str | None) -> None:
    """Build (TensorRT-LLM engines, or torch checkpoints) for RECIPE and write a manifest."""
    from trtspec.build import build as run_build

    say = (lambda text: click.echo(text, err=True)) if dry_run else click.echo
    root, _ = engines_root(recipe, engines)
    result = run_build(recipe, overrides, gpu, dry_run, force, root, say)
    if dry_run:
        click.echo(result.plan.shell(), nl=False)


MLFLOW_URI_HELP = "tracking URI [default: the eval's, $MLFLOW_TRACKING_URI, sqlite:///mlflow.db]"


def _draft_lengths(_ctx: click.Context, _param: click.Parameter, values: tuple[str, ...]
                   ) -> list[int | str]:
    out: list[int | str] = []
    for value in values:
        if value == "adaptive":
            out.append(value)
        elif value.isdigit() and 1 <= int(value) <= 64:
            out.append(int(value))
        else:
            raise click.BadParameter(f"{value!r}: give D as 1 … 64 or adaptive")
    return list(dict.fromkeys(out))


@click.command()
@click.argument("source", required=False, type=click.Path(exists=True))
@click.option("--samples", "-n", type=click.IntRange(50, 1_000_000), default=None,
              help="seeded samples per test (a method at one D on one prompt) [default: 1600; "
              "with --endpoint, per server and prompt: 2000]")
@click.option("--prompt", "prompts", multiple=True,
              help="audit prompt (plain text, repeatable) [default: a built-in list of cars of "
              "random colours, 600 tokens]")
@click.option("--draft-len", "-D", "draft_lengths", multiple=True, callback=_draft_lengths,
              help="D of the audited rounds, repeatable: 1 … 64 or adaptive [default: the "
              "eval's largest fixed D, and adaptive if it has it]")
@click.option("--temperature", type=click.FloatRange(0, min_open=True), default=None,
              help="[default: the recipe's (with --endpoint: --eval's), or 1.0 when greedy]")
@click.option("--alpha", type=click.FloatRange(0, 1, min_open=True), default=1e-3,
              show_default=True, help="false-alarm rate of the whole audit (Bonferroni; with "
              "--endpoint: of the one combined test)")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
              help="recipe overrides (when SOURCE is a recipe)")
@click.option("--engines", default=None, type=click.Path(), help=ENGINES_HELP)
@click.option("--out", default=None, type=click.Path(file_okay=False),
              help="where audit.json goes [default: the eval folder, or reports/<recipe>-audit-…"
              " (with --endpoint: --eval's folder, or reports/endpoint-audit-…)]")
@click.option("--endpoint", default=None, metavar="URL",
              help="audit a speculating OpenAI-compatible server (…/v1) against "
              "--baseline-endpoint instead of SOURCE's models")
@click.option("--baseline-endpoint", default=None, metavar="URL",
              help="the same model served without speculation")
@click.option("--model", default=None, help="with --endpoint: the model name the servers "
              "serve [default: the first /v1/models lists]")
@click.option("--tokens", "-k", type=click.IntRange(1, 16), default=None,
              help="with --endpoint: the first k output tokens compared [default: 3]")
@click.option("--effect", type=click.FloatRange(0, 1, min_open=True, max_open=True),
              default=None, help="the total variation the power is stated against (in "
              "process: of the distribution a token is recovered from after a rejection; with "
              "--endpoint: between the servers' outputs) [default: 0.1]")
@click.option("--eval", "eval_dir", default=None, type=click.Path(exists=True, file_okay=False),
              help="with --endpoint: the endpoint eval (reports/<eval-id>) this audit is for: "
              "audit.json goes there and `trtspec decide` uses it; its servers and model are "
              "the defaults")
def audit(source: str | None, samples: int | None, prompts: tuple[str, ...],
          draft_lengths: list[int | str], temperature: float | None, alpha: float,
          overrides: tuple[str, ...], engines: str | None, out: str | None,
          endpoint: str | None, baseline_endpoint: str | None, model: str | None,
          tokens: int | None, effect: float | None, eval_dir: str | None) -> None:
    """Exactness audit: sample the first four output tokens through the serving scheduler
    (staggered admissions, the eval's D, rounds after a rejection) on the actual models and
    test them against the target's exact probabilities (chi-square), per method. SOURCE is an
    eval folder (audits the models and D it measured; `trtspec decide` then uses the result as
    a gate) or a recipe. With --endpoint URL --baseline-endpoint URL instead of SOURCE, any
    server: the first k tokens sampled from both are compared (chi-square test of
    homogeneity) and the power against --effect is reported. Exit 0 when every method passes
    with power (in process: ≥ 0.8 against --effect), 1 otherwise (a weak PASS too)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeRemainingColumn

    from trtspec.audit.inprocess import run_audit
    from trtspec.build.manifest import ManifestError

    endpoint_only = {"--model": model, "--tokens": tokens, "--eval": eval_dir}
    if source is not None and (endpoint or baseline_endpoint):
        raise click.UsageError("give SOURCE (in-process models) or --endpoint and "
                               "--baseline-endpoint (servers), not both")
    if source is None and (endpoint or baseline_endpoint or eval_dir):
        _audit_endpoints(endpoint, baseline_endpoint, model, eval_dir, out, prompts, samples,
                         tokens, temperature, alpha, effect, draft_lengths, overrides, engines)
        return
    if source is None:
        raise click.UsageError("give SOURCE (an eval folder or a recipe), or --endpoint URL "
                               "--baseline-endpoint URL")
    given = [k for k, v in endpoint_only.items() if v is not None]
    if given:
        raise click.UsageError(f"{', '.join(given)} go with --endpoint: drop them with SOURCE")
    from trtspec.audit.inprocess import EFFECT, SAMPLES

    samples = samples or SAMPLES
    root, why = engines_root(source, engines)
    tty = sys.stderr.isatty() or sys.stdout.isatty()
    with Progress("[progress.description]{task.description}", BarColumn(), MofNCompleteColumn(),
                  TimeRemainingColumn(), transient=True, disable=not tty) as bar:
        ticker = AuditTicker(bar, tty)
        try:
            where, report = run_audit(source, overrides, root, out, prompts, samples,
                                      draft_lengths, temperature, alpha, progress=ticker,
                                      say=ticker.say, effect=effect or EFFECT)
        except ManifestError as e:
            raise explain_engines(e, root, why) from None
    console = Console(width=None if sys.stdout.isatty() else 160)
    tests = Table(title=f"exactness audit: x₀ … x₃, {report['samples']} samples per test, "
                        f"{report['slots']} slots, T = {report['sampling']['temperature']}")
    for column in ("method", "D", "prompt", "p-value (alone)", "speculated", "recovered",
                   "rejected", "staggered", "seconds"):
        tests.add_column(column)
    methods = Table(title=f"per method: its tests summed; power against a post-rejection "
                          f"total variation of {report['effect']} (as the bins see it)")
    for column in ("method", "result", "p-value", "level", "χ² / dof", "power"):
        methods.add_column(column)
    for method, m in report["methods"].items():
        for p in m["prompts"]:
            tests.add_row(method, str(p["draft_len"]), p["prompt"], f"{p['p_value']:.3g}",
                          f"{100 * p['speculated']:.0f} %", f"{100 * p['recovered']:.0f} %",
                          f"{100 * p['rejected']:.0f} %",
                          f"{100 * p['staggered']:.0f} %", f"{p['seconds']:.0f}")
        result = "FAIL" if not m["passed"] else "PASS (weak)" if m["weak"] else "PASS"
        methods.add_row(method, result, f"{m['p_value']:.3g}", f"{m['threshold']:.2g}",
                        f"{m['chi2']:.1f} / {m['dof']}", f"{m['power']:.2f}")
    console.print(tests)
    console.print(methods)
    click.echo(f"audit: {where / 'audit.json'}")
    sys.exit(0 if all(m["passed"] and not m["weak"] for m in report["methods"].values())
             else 1)


def _audit_endpoints(endpoint: str | None, baseline: str | None, model: str | None,
                     eval_dir: str | None, out: str | None, prompts: tuple[str, ...],
                     samples: int | None, tokens: int | None, temperature: float | None,
                     alpha: float, effect: float | None, draft_lengths: list[int | str],
                     overrides: tuple[str, ...], engines: str | None) -> None:
    """`trtspec audit --endpoint URL --baseline-endpoint URL`: the two servers' first k
    tokens compared (:mod:`trtspec.audit.endpoint`); exit 0 on a pass, 1 otherwise."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeRemainingColumn

    from trtspec.audit.endpoint import EFFECT, SAMPLES, TOKENS, run_endpoint_audit

    in_process_only = [k for k, v in (("--draft-len", draft_lengths), ("--set", overrides),
                                      ("--engines", engines)) if v]
    if in_process_only:
        raise click.UsageError(f"{', '.join(in_process_only)} go with SOURCE (in-process "
                               "models): drop them with --endpoint")
    if eval_dir and out:
        raise click.UsageError("--eval puts audit.json in the eval folder: drop --out")
    sampling = None
    if eval_dir:
        from trtspec.eval import eval_recipe, in_process
        from trtspec.eval.folder import meta_if_any

        if in_process(eval_dir):
            raise click.UsageError(f"--eval {eval_dir} is an in-process eval: audit it with "
                                   f"`trtspec audit {eval_dir}`")
        meta = meta_if_any(Path(eval_dir))
        if meta.get("launch"):
            raise click.UsageError(f"--eval {eval_dir} launched its servers and stopped them: "
                                   "an endpoint audit of a --launch eval is not built yet")
        measured = {"--endpoint": meta.get("endpoint"),
                    "--baseline-endpoint": meta.get("baseline_endpoint"),
                    "--model": meta.get("model")}
        for flag, given in (("--endpoint", endpoint), ("--baseline-endpoint", baseline),
                            ("--model", model)):
            if given and measured[flag] and given != measured[flag]:
                raise click.UsageError(f"--eval {eval_dir} measured {flag} {measured[flag]}: "
                                       f"an audit of {given} cannot gate it (drop {flag})")
        endpoint = endpoint or measured["--endpoint"]
        baseline = baseline or measured["--baseline-endpoint"]
        model = model or measured["--model"]
        sampling = eval_recipe(eval_dir).sampling
        if temperature and sampling.temperature and temperature != sampling.temperature:
            raise click.UsageError(f"--eval {eval_dir} sampled at temperature "
                                   f"{sampling.temperature}: drop --temperature")
    if not endpoint or not baseline:
        raise click.UsageError("an endpoint audit compares two servers: give --endpoint URL "
                               "(speculating) and --baseline-endpoint URL (plain decoding)")
    if endpoint.rstrip("/") == baseline.rstrip("/"):
        raise click.UsageError("--endpoint and --baseline-endpoint are the same server: the "
                               "baseline is the same model served without speculation")
    t = temperature or (sampling.temperature if sampling is not None else 0) or 1.0
    tty = sys.stderr.isatty() or sys.stdout.isatty()
    with Progress("[progress.description]{task.description}", BarColumn(), MofNCompleteColumn(),
                  TimeRemainingColumn(), transient=True, disable=not tty) as bar:
        ticker = AuditTicker(bar, tty)
        where, report = run_endpoint_audit(
            endpoint, baseline, model, prompts, samples or SAMPLES, tokens or TOKENS, t, alpha,
            effect or EFFECT, seed=(sampling.seed if sampling is not None else None) or 0,
            out=eval_dir or out, top_p=sampling.top_p if sampling is not None else 1.0,
            top_k=sampling.top_k if sampling is not None else 0, progress=ticker,
            say=ticker.say)
    m = report["methods"]["endpoint"]
    table = Table(title=f"exactness audit of {endpoint} against {baseline}: the first "
                        f"{report['tokens']} tokens, {report['samples']} samples per server "
                        f"and prompt, T = {t}")
    for column in ("prompt", "outcomes", "bins", "chi²", "dof", "p-value", "TV seen",
                   "shorter (spec / base)", "seconds"):
        table.add_column(column)
    for p in m["prompts"]:
        table.add_row(p["prompt"], str(p["outcomes"]), str(p["bins"]), f"{p['chi2']:.1f}",
                      str(p["dof"]), f"{p['p_value']:.3g}", f"{p['tv']:.3f}",
                      " / ".join(f"{100 * x:.0f} %" for x in p["ended_early"]),
                      f"{p['seconds']:.0f}")
    Console(width=None if sys.stdout.isatty() else 160).print(table)
    result = "PASS" if m["passed"] else "FAIL"
    click.echo(f"{result}: χ² = {m['chi2']:.1f} on {m['dof']} dof (prompts summed), p = "
               f"{m['p_value']:.3g} vs α = {report['alpha']:g}; power {m['power']:.2f} against "
               f"a total variation of {m['effect']:g} between the servers' binned outputs"
               + (f" (weak: < {report['min_power']:g}, cannot support a GO; raise --samples "
                  "or add --prompt)" if m["weak"] else ""))
    click.echo(f"audit: {where / 'audit.json'}")
    sys.exit(0 if m["passed"] else 1)


class AuditTicker:
    """Progress of an audit, per method: on a terminal a bar each (samples drawn / to draw,
    time left); elsewhere (CI, a log file) a plain line when a method starts, every ``every``
    seconds, and when it ends, with the time left estimated from the method's rate so far."""

    def __init__(self, bar, tty: bool, every: float = 10.0, echo=None, clock=None) -> None:
        import time

        self.bar, self.tty, self.every = bar, tty, every
        self.echo = echo or (lambda text: click.echo(text, err=True))
        self.clock = clock or time.monotonic
        self.tasks: dict[str, object] = {}
        self.started: dict[str, float] = {}
        self.last = 0.0

    def say(self, text: str) -> None:
        if self.tty:
            self.bar.console.print(text, highlight=False, markup=False)
        else:
            self.echo(text)

    def __call__(self, method: str, done: int, total: int) -> None:
        now = self.clock()
        if method not in self.started:
            self.started[method] = now
            if self.tty:
                self.tasks[method] = self.bar.add_task(f"audit {method}", total=total)
            else:
                self.echo(f"audit {method}: {total} samples to draw")
                self.last = now
        if self.tty:
            self.bar.update(self.tasks[method], completed=done, total=total)
            return
        if done < total and now - self.last < self.every:
            return
        self.last = now
        took = now - self.started[method]
        if done >= total:
            self.echo(f"audit {method}: {done}/{total} samples in {_duration(took)}")
        elif done:
            self.echo(f"audit {method}: {done}/{total} samples, about "
                      f"{_duration(took * (total - done) / done)} left")
        else:
            self.echo(f"audit {method}: 0/{total} samples ({_duration(took)} so far)")


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"


@click.command()
@click.argument("eval_dir", type=click.Path(exists=True, file_okay=False))
@click.option("--mlflow-uri", default=None, help=MLFLOW_URI_HELP)
@click.option("--no-mlflow", is_flag=True, help="write the report locally only")
@click.option("--gpu", default=None, help="size the report's memory section for this GPU "
              "(H200, A100-80GB, …) instead of the recipe's: the concurrency that fits at "
              "limits.max_seq_len with and without speculation")
def decide(eval_dir: str, mlflow_uri: str | None, no_mlflow: bool, gpu: str | None) -> None:
    """Go / no-go per condition for an eval; writes report.html, report.md and decision.json
    next to the records and logs them to the eval's MLflow run. Exit 0 when every condition is
    GO, 1 otherwise (NO-GO or INCONCLUSIVE), 2 on error: usable as a CI gate."""
    from trtspec.analysis.decide import ci_text
    from trtspec.build.recipe import RecipeError
    from trtspec.eval import eval_recipe, require_files
    from trtspec.eval.run import read_records
    from trtspec.report.decision import make_decision
    from trtspec.report.render import all_go, incomplete_note, unpaired_note

    out = Path(eval_dir)
    recipe = eval_recipe(out)
    if gpu is not None:
        from trtspec.build.gpu import profile

        recipe = recipe.model_copy(update={"gpu": recipe.gpu.model_copy(
            update={"name": profile(gpu).name})})  # ValueError (one line): unknown GPU
    records = read_records(require_files(out, "records.jsonl"))
    if not records:
        raise RecipeError(f"{out}/records.jsonl has no records yet: resume the eval "
                          f"(`trtspec eval RECIPE --resume {out}`) before deciding")
    verdicts, decision = make_decision(out, recipe, records)
    table = Table(title=f"decision {out.name}")
    for column in ("condition", "verdict", f"speedup ({recipe.decide.primary_metric})",
                   "95 % CI", "why"):
        table.add_column(column)
    for v in verdicts:
        if v.category == "all":
            why = v.reasons + [f"caveat: {c}" for c in v.caveats]
            table.add_row(v.condition, v.verdict, v.speedup_text,
                          ci_text(v, recipe.decide), "; ".join(why) or "—")
    Console(width=None if sys.stdout.isatty() else 160).print(table)
    for note in (decision["unpaired_records"] and unpaired_note(decision["unpaired_records"]),
                 incomplete_note(decision)):
        if note:
            click.echo(note)
    click.echo(f"report: {out / 'report.html'}  (markdown: {out / 'report.md'})")
    if not no_mlflow:
        log_to_mlflow(out, mlflow_uri, decision=True)
    sys.exit(0 if all_go(verdicts) else 1)


@click.command("prepare-data")
@click.argument("dataset", type=click.Choice(["speed-bench"]))
@click.option("--out", default="data/speed-bench", show_default=True, type=click.Path())
@click.option("--config", "configs", multiple=True, default=("qualitative",), show_default=True,
              help="SPEED-Bench configs: qualitative, throughput_1k … throughput_32k")
def prepare_data(dataset: str, out: str, configs: tuple[str, ...]) -> None:
    """Download a benchmark (needs `datasets` and hub access) into local JSONL files."""
    from trtspec.eval.workloads import speed_bench

    for path in speed_bench.prepare(out, configs):
        click.echo(f"wrote {path}")


@click.command()
@click.argument("eval_dir", type=click.Path(exists=True, file_okay=False))
@click.option("--mlflow-uri", default=None, help=MLFLOW_URI_HELP)
def sync(eval_dir: str, mlflow_uri: str | None) -> None:
    """Log an eval folder to MLflow (after the server was down); never duplicates."""
    from trtspec.report.tracking import log_eval

    receipt = log_eval(eval_dir, mlflow_uri)
    what = {"logged": "logged as run", "found": "already logged (found by its eval id) as run",
            "receipt": "already logged (its mlflow.json receipt) as run",
            "relogged": "re-logged (the records changed since) as run"}[receipt["status"]]
    click.echo(f"MLflow: {what} {receipt['run_id']} (experiment {receipt['experiment_id']}) at "
               f"{receipt['uri']}")


@click.command()
@click.argument("recipes", nargs=-1, type=click.Path(exists=True, dir_okay=False))
def doctor(recipes: tuple[str, ...]) -> None:
    """What this machine has, and what each recipe (default: recipes/*.yaml) still needs."""
    from trtspec.build.doctor import machine, recipe_features, recipe_needs

    console = Console()
    table = Table(title="this machine", show_header=False)
    for key, value in machine():
        table.add_row(key, value)
    console.print(table)
    paths = [Path(r) for r in recipes] or sorted(Path("recipes").glob("*.yaml"))
    if not paths:
        console.print(f"no recipes in {Path('recipes').absolute()}: run doctor in a trtspec "
                      "project, or name recipe files (trtspec doctor path/to/recipe.yaml)",
                      highlight=False, markup=False)
    for path in paths:
        needs = recipe_needs(path)
        status = "[green]ready[/]" if not needs else "[yellow]needs[/] " + "; ".join(needs)
        console.print(f"{path}: {status}", highlight=False)
        for line in recipe_features(path):
            console.print(f"  {line}", highlight=False, markup=False)


