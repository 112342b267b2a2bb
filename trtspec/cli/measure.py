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


@click.command()
@click.argument("source", type=click.Path(exists=True))
@click.option("--samples", "-n", type=click.IntRange(50), default=1000, show_default=True,
              help="seeded samples per method and prompt")
@click.option("--prompt", "prompts", multiple=True,
              help="audit prompt (plain text, repeatable) [default: two built-in ones]")
@click.option("--draft-len", "-D", type=click.IntRange(1, 64), default=1, show_default=True,
              help="D of the audited round (x₁ depends only on the first draft position)")
@click.option("--temperature", type=click.FloatRange(0, min_open=True), default=None,
              help="[default: the recipe's, or 1.0 when the recipe is greedy]")
@click.option("--alpha", type=click.FloatRange(0, 1, min_open=True), default=1e-3,
              show_default=True, help="false-alarm rate of the whole audit (Bonferroni)")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
              help="recipe overrides (when SOURCE is a recipe)")
@click.option("--engines", default=None, type=click.Path(), help=ENGINES_HELP)
@click.option("--out", default=None, type=click.Path(file_okay=False),
              help="where audit.json goes [default: the eval folder, or reports/<recipe>-audit-…]")
def audit(source: str, samples: int, prompts: tuple[str, ...], draft_len: int,
          temperature: float | None, alpha: float, overrides: tuple[str, ...],
          engines: str | None, out: str | None) -> None:
    """Exactness audit: sample the first two output tokens through speculative sampling on the
    actual models and test them against the target's exact probabilities (chi-square), per
    method. SOURCE is an eval folder (audits the models it measured; `trtspec decide` then uses
    the result as a gate) or a recipe. Exit 0 when every method passes, 1 otherwise."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeRemainingColumn

    from trtspec.audit import run_audit
    from trtspec.manifest import ManifestError

    root, why = engines_root(source, engines)
    with Progress("[progress.description]{task.description}", BarColumn(), MofNCompleteColumn(),
                  TimeRemainingColumn(), transient=True) as bar:
        task = bar.add_task("samples drawn", total=None)
        try:
            where, report = run_audit(source, overrides, root, out, prompts, samples,
                                      draft_len, temperature, alpha, progress=lambda d, t:
                                      bar.update(task, completed=d, total=t))
        except ManifestError as e:
            raise explain_engines(e, root, why) from None
    table = Table(title=f"exactness audit ({report['samples']} samples per prompt, "
                        f"T = {report['sampling']['temperature']})")
    for column in ("method", "result", "min p-value", "threshold", "speculated", "rejected"):
        table.add_column(column)
    for method, m in report["methods"].items():
        spec = sum(p["speculated"] for p in m["prompts"]) / len(m["prompts"])
        rej = sum(p["rejected"] for p in m["prompts"]) / len(m["prompts"])
        table.add_row(method, ("PASS" if m["passed"] else "FAIL") + (" (weak)" if m["weak"]
                                                                      else ""),
                      f"{m['p_value']:.3g}", f"{m['threshold']:.2g}", f"{100 * spec:.0f} %",
                      f"{100 * rej:.0f} %")
    Console(width=None if sys.stdout.isatty() else 160).print(table)
    click.echo(f"audit: {where / 'audit.json'}")
    sys.exit(0 if all(m["passed"] for m in report["methods"].values()) else 1)


@click.command()
@click.argument("eval_dir", type=click.Path(exists=True, file_okay=False))
@click.option("--mlflow-uri", default=None, help=MLFLOW_URI_HELP)
@click.option("--no-mlflow", is_flag=True, help="write the report locally only")
def decide(eval_dir: str, mlflow_uri: str | None, no_mlflow: bool) -> None:
    """Go / no-go per condition for an eval; writes report.html, report.md and decision.json
    next to the records and logs them to the eval's MLflow run. Exit 0 when every condition is
    GO, 1 otherwise (NO-GO or INCONCLUSIVE), 2 on error: usable as a CI gate."""
    from trtspec.eval import eval_recipe, require_files
    from trtspec.eval.run import read_records
    from trtspec.recipe import RecipeError
    from trtspec.report import all_go, incomplete_note, make_decision, unpaired_note

    out = Path(eval_dir)
    recipe = eval_recipe(out)
    records = read_records(require_files(out, "records.jsonl"))
    if not records:
        raise RecipeError(f"{out}/records.jsonl has no records yet: resume the eval "
                          f"(`trtspec eval RECIPE --resume {out}`) before deciding")
    verdicts, decision = make_decision(out, recipe, records)
    table = Table(title=f"decision {out.name}")
    for column in ("condition", "verdict", "speedup", "95 % CI", "why"):
        table.add_column(column)
    for v in verdicts:
        if v.category == "all":
            why = v.reasons + [f"caveat: {c}" for c in v.caveats]
            table.add_row(v.condition, v.verdict, v.speedup_text, v.ci_text,
                          "; ".join(why) or "—")
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
    from trtspec.eval import speed_bench

    for path in speed_bench.prepare(out, configs):
        click.echo(f"wrote {path}")


@click.command()
@click.argument("eval_dir", type=click.Path(exists=True, file_okay=False))
@click.option("--mlflow-uri", default=None, help=MLFLOW_URI_HELP)
def sync(eval_dir: str, mlflow_uri: str | None) -> None:
    """Log an eval folder to MLflow (after the server was down); never duplicates."""
    from trtspec.tracking import log_eval

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
    from trtspec.doctor import machine, recipe_needs

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


