"""The `trtspec` command. Each command parses its options and makes one library call."""

from __future__ import annotations

import json
import sys

import click
from pydantic import ValidationError
from rich.console import Console
from rich.table import Table

from trtspec import __version__
from trtspec.executor import Completion, SpecExecutor
from trtspec.metrics import SpecStats
from trtspec.propose.draft_model import DraftModelProposer
from trtspec.runtime.toy import MarkovLM, ToyRunner
from trtspec.sampling import SamplingParams


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="trtspec")
def cli() -> None:
    """Measure whether speculative decoding pays off for your model, workload and GPU."""


@cli.command()
@click.option("--backend", type=click.Choice(["toy"]), default="toy", show_default=True,
              help="toy = exact Markov-chain models (real models come with the torch backend)")
@click.option("--method", type=click.Choice(["none", "draft_model"]), default="draft_model",
              show_default=True, help="none = plain decoding (the baseline)")
@click.option("--draft-len", "-D", type=click.IntRange(0, 64), default=4, show_default=True)
@click.option("--prompt", default="1 2 3", show_default=True, help="token ids, space separated")
@click.option("--num-requests", "-n", type=click.IntRange(1), default=1, show_default=True,
              help="copies of the prompt in one batch (seeds seed, seed+1, …)")
@click.option("--max-tokens", type=click.IntRange(1), default=32, show_default=True)
@click.option("--temperature", type=click.FloatRange(0), default=1.0, show_default=True)
@click.option("--top-k", type=click.IntRange(0), default=0, show_default=True)
@click.option("--top-p", type=click.FloatRange(0, 1, min_open=True), default=1.0,
              show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--vocab-size", type=click.IntRange(2, 4096), default=32, show_default=True)
@click.option("--order", type=click.IntRange(1, 3), default=2, show_default=True,
              help="toy Markov order (context tokens)")
@click.option("--divergence", type=click.FloatRange(0, 1), default=0.3, show_default=True,
              help="toy draft: 0 = the target itself, 1 = unrelated")
@click.option("--eos-id", type=int, default=None, help="toy EOS token id (default: none)")
@click.option("--json", "as_json", is_flag=True, help="print one JSON object instead of tables")
def generate(backend: str, method: str, draft_len: int, prompt: str, num_requests: int,
             max_tokens: int, temperature: float, top_k: int, top_p: float, seed: int,
             vocab_size: int, order: int, divergence: float, eos_id: int | None,
             as_json: bool) -> None:
    """Generate with exact speculative sampling and print tokens and speculation stats."""
    try:
        prompt_ids = [int(t) for t in prompt.replace(",", " ").split()]
    except ValueError:
        raise click.BadParameter("token ids must be integers, e.g. '1 2 3'",
                                 param_hint="--prompt") from None
    target = MarkovLM(vocab_size, order, seed=seed, eos_token_id=eos_id)
    proposer = (DraftModelProposer(ToyRunner(target.diverged(divergence, seed=seed + 1)))
                if method == "draft_model" else None)
    executor = SpecExecutor(ToyRunner(target), proposer, draft_len)
    params = [SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed + i,
                             max_tokens=max_tokens) for i in range(num_requests)]
    completions = executor.generate([prompt_ids] * num_requests, params)
    _print_completions(completions, as_json)


def _print_completions(completions: list[Completion], as_json: bool) -> None:
    stats = SpecStats.merge(c.stats for c in completions)
    if as_json:
        click.echo(json.dumps({
            "completions": [{"token_ids": c.token_ids, "finish_reason": c.finish_reason}
                            for c in completions],
            "stats": {k: _finite(v) for k, v in stats.summary().items()},
            "acceptance_per_position": [_finite(a) for a in stats.acceptance_per_position],
        }))
        return
    console = Console()
    for i, c in enumerate(completions):
        console.print(f"[bold]request {i}[/] ({c.finish_reason}, {len(c.token_ids)} tokens): "
                      + " ".join(map(str, c.token_ids)))
    table = Table(title="speculation stats",
                  caption="the first token (from prefill) is in no counter")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key, value in stats.summary().items():
        table.add_row(key, f"{value:.3f}" if isinstance(value, float) else str(value))
    table.add_row("acceptance per position",
                  " ".join(f"{a:.2f}" for a in stats.acceptance_per_position) or "-")
    console.print(table)


def _finite(value: float | int) -> float | int | None:
    """JSON has no NaN: undefined rates (nothing proposed) become null."""
    return None if value != value else value


def main() -> None:
    """Entry point: library errors become one red line and exit code 2, never a traceback."""
    try:
        cli.main(standalone_mode=False)
    except click.exceptions.Abort:
        click.echo("aborted", err=True)
        sys.exit(130)
    except click.ClickException as e:
        e.show()
        sys.exit(e.exit_code)
    except (ValueError, ValidationError) as e:
        message = str(e).splitlines()[0] if not isinstance(e, ValidationError) else (
            "; ".join(f"{'.'.join(map(str, err['loc']))}: {err['msg']}" for err in e.errors()))
        click.secho(f"error: {message}", fg="red", err=True)
        sys.exit(2)
