"""The `trtspec` command. Each command parses its options and makes one library call."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import click
from pydantic import ValidationError
from rich.console import Console
from rich.table import Table

from trtspec import __version__
from trtspec.executor import Completion, Delta, SpecExecutor
from trtspec.metrics import SpecStats
from trtspec.propose import make_proposer
from trtspec.runtime.toy import MarkovLM, ToyRunner
from trtspec.sampling import SamplingParams


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="trtspec")
def cli() -> None:
    """Measure whether speculative decoding pays off for your model, workload and GPU."""


@cli.command()
@click.option("--backend", type=click.Choice(["torch", "toy"]), default="torch", show_default=True,
              help="torch = a real model via transformers; toy = exact Markov-chain models")
@click.option("--model", "-m", default="smollm2-135m-instruct", show_default=True,
              help="built-in name, .gguf file, local HF directory or cached hub id (torch)")
@click.option("--method", type=click.Choice(["none", "ngram", "layer_skip", "draft_model"]),
              default="ngram", show_default=True, help="none = plain decoding (the baseline)")
@click.option("--draft-len", "-D", type=click.IntRange(0, 64), default=4, show_default=True)
@click.option("--draft-model", default=None, help="the draft for --method draft_model (torch)")
@click.option("--draft-layers", type=click.IntRange(1), default=None,
              help="layer_skip: target layers the draft keeps [default: half]")
@click.option("--ngram-min", type=click.IntRange(1), default=1, show_default=True)
@click.option("--ngram-max", type=click.IntRange(1), default=3, show_default=True)
@click.option("--prompt", "-p", default=None,
              help="text (torch; a chat turn when the model has a template) or token ids (toy)")
@click.option("--chat/--no-chat", default=True, show_default=True,
              help="wrap a text prompt in the tokenizer's chat template")
@click.option("--num-requests", "-n", type=click.IntRange(1), default=1, show_default=True,
              help="copies of the prompt in one batch (seeds seed, seed+1, …)")
@click.option("--max-tokens", type=click.IntRange(1), default=64, show_default=True)
@click.option("--temperature", type=click.FloatRange(0), default=1.0, show_default=True)
@click.option("--top-k", type=click.IntRange(0), default=0, show_default=True)
@click.option("--top-p", type=click.FloatRange(0, 1, min_open=True), default=1.0,
              show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--device", default="auto", show_default=True, help="cpu, cuda, cuda:1 … (torch)")
@click.option("--dtype", default="auto", show_default=True,
              help="auto = float32 on CPU, bfloat16 on CUDA (torch)")
@click.option("--vocab-size", type=click.IntRange(2, 4096), default=32, show_default=True,
              help="toy vocabulary")
@click.option("--order", type=click.IntRange(1, 3), default=2, show_default=True,
              help="toy Markov order (context tokens)")
@click.option("--divergence", type=click.FloatRange(0, 1), default=0.3, show_default=True,
              help="toy draft: 0 = the target itself, 1 = unrelated")
@click.option("--eos-id", type=int, default=None, help="toy EOS token id (default: none)")
@click.option("--json", "as_json", is_flag=True, help="print one JSON object instead of text")
def generate(backend: str, model: str, method: str, draft_len: int, draft_model: str | None,
             draft_layers: int | None, ngram_min: int, ngram_max: int, prompt: str | None,
             chat: bool, num_requests: int, max_tokens: int, temperature: float, top_k: int,
             top_p: float, seed: int, device: str, dtype: str, vocab_size: int, order: int,
             divergence: float, eos_id: int | None, as_json: bool) -> None:
    """Generate with exact speculative sampling; print the output and speculation stats."""
    params = [SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed + i,
                             max_tokens=max_tokens) for i in range(num_requests)]
    knobs = {"draft_len": draft_len, "draft_layers": draft_layers, "ngram_min": ngram_min,
             "ngram_max": ngram_max}
    tokenizer = None
    if backend == "toy":
        if method in ("layer_skip",):
            raise click.BadParameter("the toy backend has no layers to skip",
                                     param_hint="--method")
        ids = _token_ids(prompt or "1 2 3")
        target = MarkovLM(vocab_size, order, seed=seed, eos_token_id=eos_id)
        draft = ToyRunner(target.diverged(divergence, seed=seed + 1))
        runner = ToyRunner(target)
        proposer = make_proposer(method, draft=draft, **knobs)
    else:
        from trtspec.models import encode, load
        from trtspec.runtime.hf import HFRunner

        lm = load(model, device, dtype)
        tokenizer = lm.tokenizer
        ids = encode(tokenizer, prompt or "Write a haiku about speculative decoding.", chat)
        draft = load(draft_model, device, dtype) if draft_model else None
        runner = HFRunner(lm.model, eos_token_id=tokenizer.eos_token_id)
        proposer = make_proposer(method, lm, draft=draft, **knobs)
    executor = SpecExecutor(runner, proposer, draft_len)
    stream = None if as_json or num_requests > 1 or tokenizer is None else TextStream(tokenizer)
    started = time.perf_counter()
    completions = executor.generate([ids] * num_requests, params, on_step=stream)
    elapsed = time.perf_counter() - started
    _print_completions(completions, as_json, tokenizer, elapsed, show_tokens=stream is None)


@cli.command()
@click.argument("recipe", type=click.Path(dir_okay=False))
@click.option("--gpu", default=None, help="plan for this GPU (H200, A100-80GB, …) instead of "
              "the recipe's / this machine's")
@click.option("--dry-run", is_flag=True, help="print the plan as shell and stop")
@click.option("--force", is_flag=True, help="rebuild even if the manifest is up to date")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
              help="override a recipe value, e.g. --set limits.max_batch_size=16")
@click.option("--engines", default="engines", show_default=True, type=click.Path(),
              help="root folder for build outputs")
def build(recipe: str, gpu: str | None, dry_run: bool, force: bool, overrides: tuple[str, ...],
          engines: str) -> None:
    """Build (TensorRT-LLM engines, or torch checkpoints) for RECIPE and write a manifest."""
    from trtspec.build import build as run_build

    say = (lambda text: click.echo(text, err=True)) if dry_run else click.echo
    result = run_build(recipe, overrides, gpu, dry_run, force, engines, say)
    if dry_run:
        click.echo(result.plan.shell(), nl=False)


@cli.command("eval")
@click.argument("recipe", type=click.Path(dir_okay=False))
@click.option("--workload", "-w", "workloads", multiple=True,
              help="builtin, speed-bench:<config> or a JSONL file [default: the recipe's]")
@click.option("--per-category", type=click.IntRange(1), default=None,
              help="stratified sample: at most N requests per category")
@click.option("--eval-id", default=None, help="folder name under --reports [default: timestamp]")
@click.option("--resume", type=click.Path(exists=True, file_okay=False), default=None,
              help="continue an interrupted eval folder, skipping what is recorded")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE")
@click.option("--engines", default="engines", show_default=True, type=click.Path())
@click.option("--reports", default="reports", show_default=True, type=click.Path())
@click.option("--speed-bench-dir", default="data/speed-bench", show_default=True,
              type=click.Path())
@click.option("--mlflow-uri", default=None,
              help="tracking URI [default: $MLFLOW_TRACKING_URI, else sqlite:///mlflow.db]")
@click.option("--no-mlflow", is_flag=True, help="keep results local only")
@click.option("--endpoint", default=None,
              help="evaluate an OpenAI-compatible server (…/v1) instead of in-process models")
@click.option("--model", default=None, help="the model name the endpoint serves")
@click.option("--baseline-endpoint", default=None,
              help="the same model served without speculation (the baseline arm)")
def eval_command(recipe: str, workloads: tuple[str, ...], per_category: int | None,
                 eval_id: str | None, resume: str | None, overrides: tuple[str, ...],
                 engines: str, reports: str, speed_bench_dir: str, mlflow_uri: str | None,
                 no_mlflow: bool, endpoint: str | None, model: str | None,
                 baseline_endpoint: str | None) -> None:
    """Baseline vs speculative on RECIPE's built models; records land in reports/<eval-id>/."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeRemainingColumn

    from trtspec.eval import evaluate, evaluate_endpoint

    if endpoint and not model:
        raise click.UsageError("--endpoint needs --model (the name the server serves)")
    with Progress("[progress.description]{task.description}", BarColumn(), MofNCompleteColumn(),
                  TimeRemainingColumn(), transient=True) as bar:
        task = bar.add_task("requests measured", total=None)

        def tick(done: int, total: int) -> None:
            bar.update(task, completed=done, total=total)

        if endpoint:
            out = evaluate_endpoint(recipe, endpoint, model or "", baseline_endpoint, overrides,
                                    workloads, per_category, eval_id, resume, reports,
                                    speed_bench_dir, tick)
        else:
            out = evaluate(recipe, overrides, workloads, per_category, eval_id, resume, engines,
                           reports, speed_bench_dir, tick)
    _print_summary(out)
    if not no_mlflow:
        _log_to_mlflow(out, mlflow_uri)


def _log_to_mlflow(out: Path, uri: str | None) -> None:
    """Log after the measurements are on disk; a tracking failure costs nothing measured."""
    from trtspec.tracking import log_eval, tracking_uri

    try:
        receipt = log_eval(out, uri)
    except Exception as e:  # unreachable server, auth, disk: the eval folder is intact
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        click.secho(f"MLflow: not logged ({reason}). Everything is kept in {out}; run "
                    f"`trtspec sync {out}` when the server is back.", fg="yellow", err=True)
        return
    click.echo(f"MLflow: run {receipt['run_id']} at {tracking_uri(uri)} "
               "(compare runs with `mlflow ui`)")


@cli.command()
@click.argument("eval_dir", type=click.Path(exists=True, file_okay=False))
def decide(eval_dir: str) -> None:
    """Go / no-go per condition for an eval; exit 0 when every condition is GO, 1 otherwise
    (NO-GO or INCONCLUSIVE), 2 on error: usable as a CI gate."""
    from trtspec.eval.run import read_records
    from trtspec.recipe import load_recipe
    from trtspec.report import all_go, make_decision

    out = Path(eval_dir)
    recipe = load_recipe(out / "recipe.yaml", json.loads((out / "eval.json").read_text())
                         .get("overrides", []) if (out / "eval.json").is_file() else [])
    verdicts, _ = make_decision(out, recipe, read_records(out))
    table = Table(title=f"decision {out.name}")
    for column in ("condition", "verdict", "speedup", "95 % CI", "why"):
        table.add_column(column)
    for v in verdicts:
        if v.category == "all":
            ci = "—" if v.ci[0] != v.ci[0] else f"{v.ci[0]:.2f}–{v.ci[1]:.2f}×"
            table.add_row(v.condition, v.verdict, f"{v.speedup:.2f}×", ci,
                          "; ".join(v.reasons) or "—")
    Console(width=None if sys.stdout.isatty() else 160).print(table)
    click.echo(f"report: {out / 'report.md'}")
    sys.exit(0 if all_go(verdicts) else 1)


@cli.command("prepare-data")
@click.argument("dataset", type=click.Choice(["speed-bench"]))
@click.option("--out", default="data/speed-bench", show_default=True, type=click.Path())
@click.option("--config", "configs", multiple=True, default=("qualitative",), show_default=True,
              help="SPEED-Bench configs: qualitative, throughput_1k … throughput_32k")
def prepare_data(dataset: str, out: str, configs: tuple[str, ...]) -> None:
    """Download a benchmark (needs `datasets` and hub access) into local JSONL files."""
    from trtspec.eval import speed_bench

    for path in speed_bench.prepare(out, configs):
        click.echo(f"wrote {path}")


@cli.command()
@click.argument("eval_dir", type=click.Path(exists=True, file_okay=False))
@click.option("--mlflow-uri", default=None,
              help="tracking URI [default: $MLFLOW_TRACKING_URI, else sqlite:///mlflow.db]")
def sync(eval_dir: str, mlflow_uri: str | None) -> None:
    """Log an eval folder to MLflow (after the server was down); never duplicates."""
    from trtspec.tracking import log_eval

    receipt = log_eval(eval_dir, mlflow_uri)
    click.echo(f"MLflow: run {receipt['run_id']} (experiment {receipt['experiment_id']})")


def _print_summary(out: Path) -> None:
    summary = json.loads((out / "summary.json").read_text())
    table = Table(title=f"eval {out.name}")
    for column in ("condition", "requests", "TPOT p50 base→spec ms", "speedup TPOT p50",
                   "AL pooled", "AL per-request", "acceptance"):
        table.add_column(column, justify="left" if column == "condition" else "right")
    for key, entry in summary.items():
        base, spec = entry.get("baseline", {}), entry.get("spec", {})
        table.add_row(key, str(int(spec.get("requests", 0))),
                      f"{base.get('tpot_ms_p50', float('nan')):.1f} → "
                      f"{spec.get('tpot_ms_p50', float('nan')):.1f}",
                      f"{entry.get('speedup_tpot_p50', float('nan')):.2f}×",
                      f"{spec.get('al_pooled', float('nan')):.2f}",
                      f"{spec.get('al_request_mean', float('nan')):.2f}",
                      f"{spec.get('acceptance_rate', float('nan')):.2f}")
    Console(width=None if sys.stdout.isatty() else 160).print(table)  # logs: no truncation
    click.echo(f"records: {out / 'records.jsonl'}\nsummary: {out / 'summary.json'}")


@cli.command()
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
    for path in paths:
        needs = recipe_needs(path)
        status = "[green]ready[/]" if not needs else "[yellow]needs[/] " + "; ".join(needs)
        console.print(f"{path}: {status}", highlight=False)


def _token_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.replace(",", " ").split()]
    except ValueError:
        raise click.BadParameter("toy prompts are token ids, e.g. '1 2 3'",
                                 param_hint="--prompt") from None


class TextStream:
    """Prints request 0's text as tokens arrive (holding back a trailing partial character)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer, self.shown, self.ids = tokenizer, 0, []

    def __call__(self, deltas: list[Delta]) -> None:
        for d in deltas:
            if d.index == 0:
                self.ids += d.token_ids
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if text.endswith("\ufffd"):
            return
        click.echo(text[self.shown:], nl=False)
        self.shown = len(text)


def _print_completions(completions: list[Completion], as_json: bool, tokenizer: Any,
                       elapsed: float, show_tokens: bool) -> None:
    stats = SpecStats.merge(c.stats for c in completions)
    tokens = sum(len(c.token_ids) for c in completions)

    def text(c: Completion) -> str | None:
        return tokenizer.decode(c.token_ids, skip_special_tokens=True) if tokenizer else None

    if as_json:
        click.echo(json.dumps({
            "completions": [{"token_ids": c.token_ids, "text": text(c),
                             "finish_reason": c.finish_reason} for c in completions],
            "seconds": elapsed,
            "stats": {k: _finite(v) for k, v in stats.summary().items()},
            "acceptance_per_position": [_finite(a) for a in stats.acceptance_per_position],
        }))
        return
    console = Console()
    if not show_tokens:
        click.echo()
    for i, c in enumerate(completions if show_tokens else []):
        body = text(c) if tokenizer else " ".join(map(str, c.token_ids))
        console.print(f"[bold]request {i}[/] ({c.finish_reason}, {len(c.token_ids)} tokens):")
        console.print(body, highlight=False, markup=False)
    table = Table(title="speculation stats",
                  caption="the first token (from prefill) is in no counter")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key, value in stats.summary().items():
        table.add_row(key, f"{value:.3f}" if isinstance(value, float) else str(value))
    table.add_row("acceptance per position",
                  " ".join(f"{a:.2f}" for a in stats.acceptance_per_position) or "-")
    table.add_row("output tokens / s", f"{tokens / elapsed:.1f}")
    console.print(table)


def _finite(value: float | int) -> float | int | None:
    """JSON has no NaN: undefined rates (nothing proposed) become null."""
    return None if value != value else value


def main(argv: list[str] | None = None) -> None:
    """Entry point: library errors become one red line and exit code 2, never a traceback."""
    try:
        cli.main(args=argv, prog_name="trtspec", standalone_mode=False)
    except click.exceptions.Abort:
        click.echo("aborted", err=True)
        sys.exit(130)
    except click.ClickException as e:
        e.show()
        sys.exit(e.exit_code)
    except (ValueError, ValidationError, RuntimeError, FileExistsError) as e:
        if os.environ.get("TRTSPEC_DEBUG"):
            raise
        message = str(e).splitlines()[0] if not isinstance(e, ValidationError) else (
            "; ".join(f"{'.'.join(map(str, err['loc']))}: {err['msg']}" for err in e.errors()))
        click.secho(f"error: {message}", fg="red", err=True)
        sys.exit(2)
