"""`trtspec distill`: train Medusa or EAGLE-3 heads for a recipe's target
(:mod:`trtspec.train.distill`)."""

from __future__ import annotations

import random
import sys
import time
from pathlib import Path
from typing import Any

import click

from trtspec.cli.measure import MLFLOW_URI_HELP


@click.command()
@click.argument("recipe", type=click.Path(dir_okay=False))
@click.option("--method", type=click.Choice(["eagle", "medusa"]), default=None,
              help="the heads to train [default: the recipe's one eagle or medusa method]")
@click.option("--out", default=None, type=click.Path(file_okay=False),
              help="where the heads go [default: the recipe's path for them (Eagle.model or "
              "Medusa.heads), relative to the current directory]")
@click.option("--prompts", "prompts_spec", default="train", show_default=True,
              help="train (built-in training prompts, disjoint from the eval's), builtin (the "
              "eval's own: evals on it are then in-distribution), speed-bench[:DIR] or a JSONL "
              "file")
@click.option("--num-prompts", type=click.IntRange(2), default=None,
              help="a seeded sample of N prompts [default: all]")
@click.option("--max-new-tokens", type=click.IntRange(0), default=128, show_default=True,
              help="tokens the target generates per prompt (at the recipe's temperature)")
@click.option("--max-len", type=click.IntRange(3), default=512, show_default=True,
              help="sequences (prompt + continuation) are cut to this many tokens")
@click.option("--epochs", type=click.IntRange(1), default=8, show_default=True)
@click.option("--lr", type=click.FloatRange(0, min_open=True), default=1e-3, show_default=True,
              help="AdamW peak learning rate (warm-up, then cosine)")
@click.option("--minutes", type=float, default=15.0, show_default=True,
              help="training wall-clock budget of this run: stops cleanly, saves")
@click.option("--tokens", type=int, default=None,
              help="training-token budget of this run [default: none]")
@click.option("--batch-tokens", type=click.IntRange(8), default=2048, show_default=True,
              help="tokens per training step (fewer when the vocabulary is large)")
@click.option("--draft-vocab", type=click.IntRange(1), default=16384, show_default=True,
              help="EAGLE: the draft vocabulary, the most frequent ids (capped at the target's)")
@click.option("--num-heads", type=click.IntRange(1, 8), default=None,
              help="Medusa heads [default: the recipe's num_heads, else 4]")
@click.option("--head-layers", type=click.IntRange(0), default=1, show_default=True,
              help="Medusa: residual blocks per head")
@click.option("--shared-head", is_flag=True,
              help="Medusa: project through the target's own LM head (frozen): far fewer "
              "weights to train and save; only trtspec reads such a folder")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--resume", is_flag=True,
              help="continue from OUT/.distill (refused when the run differs)")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
              help="recipe overrides")
@click.option("--speed-bench-dir", default="data/speed-bench", show_default=True,
              type=click.Path(), help="where --prompts speed-bench looks")
@click.option("--mlflow-uri", default=None, help=MLFLOW_URI_HELP)
@click.option("--no-mlflow", is_flag=True, help="keep results local only")
def distill(recipe: str, method: str | None, out: str | None, prompts_spec: str,
            num_prompts: int | None, max_new_tokens: int, max_len: int, epochs: int, lr: float,
            minutes: float, tokens: int | None, batch_tokens: int, draft_vocab: int,
            num_heads: int | None, head_layers: int, shared_head: bool, seed: int,
            resume: bool, overrides: tuple[str, ...], speed_bench_dir: str,
            mlflow_uri: str | None, no_mlflow: bool) -> None:
    """Train Medusa or EAGLE-3 heads for RECIPE's target against the frozen target, on text
    the target generates itself; writes the heads (the layout the recipe and TensorRT-LLM
    read) and distill.json to --out, and logs a run to MLflow."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeRemainingColumn

    from trtspec.build.recipe import load_recipe
    from trtspec.runtime.models import encode, load
    from trtspec.train.config import DistillConfig, DistillError
    from trtspec.train.data import load_prompts
    from trtspec.train.distill import STATE
    from trtspec.train.distill import distill as run_distill

    r = load_recipe(recipe, overrides)
    heads = [m for m in r.methods if m.method in ("eagle", "medusa")]
    if method is None:
        if len(heads) != 1:
            raise DistillError(f"{recipe}: say --method eagle or --method medusa (the recipe "
                               f"has {len(heads) or 'no'} such methods)")
        method = heads[0].method
    mine = next((m for m in heads if m.method == method), None)
    if out is None:
        if mine is None:
            raise DistillError(f"{recipe} has no {method} method to take the heads' path from: "
                               "give --out DIR")
        out = mine.model if method == "eagle" else mine.heads
    if num_heads is None:
        num_heads = mine.num_heads if method == "medusa" and mine is not None else 4
    config = DistillConfig(method=method, epochs=epochs, lr=lr, minutes=minutes, tokens=tokens,
                           max_new_tokens=max_new_tokens, max_len=max_len,
                           batch_tokens=batch_tokens, seed=seed, draft_vocab=draft_vocab,
                           num_heads=num_heads, head_layers=head_layers,
                           shared_head=shared_head)
    config.check()
    if resume and not (Path(out) / STATE / "checkpoint.pt").is_file():
        raise DistillError(f"--resume: no checkpoint in {Path(out) / STATE} (drop --resume to "
                           "start)")
    requests, warning = load_prompts(prompts_spec, speed_bench_dir)
    if warning:
        click.secho(warning, fg="yellow", err=True)
    if num_prompts is not None and num_prompts < len(requests):
        keep = sorted(random.Random(seed).sample(range(len(requests)), num_prompts))
        requests = [requests[i] for i in keep]
    device = r.backend.device if r.backend.kind == "torch" else "auto"
    dtype = r.target.dtype if r.target.dtype != "fp8" else "auto"
    loaded = load(r.target.model, device=device, dtype=dtype)
    tok = loaded.tokenizer
    prompts = [encode(tok, q.chat()) for q in requests]
    sampling = r.sampling.params(ignore_eos=False, max_tokens=max(1, max_new_tokens))
    tty = sys.stderr.isatty() or sys.stdout.isatty()
    with Progress("[progress.description]{task.description}", BarColumn(), MofNCompleteColumn(),
                  TimeRemainingColumn(), transient=True, disable=not tty) as bar:
        ticker = DistillTicker(bar, tty)
        result = run_distill(
            loaded.model, prompts, out, config, target=r.target.model, recipe=r.name,
            prompts_spec=prompts_spec, sampling=sampling, eos_token_id=tok.eos_token_id,
            special_ids=list(getattr(tok, "all_special_ids", []) or []), resume=resume,
            say=ticker.say, progress=ticker)
    first, last = result.history[0], result.history[-1]
    al = next(k for k in last if k.startswith("al_d"))
    vocab = f", draft vocabulary {result.draft_vocab}" if result.draft_vocab else ""
    click.echo(f"{method} heads: {result.out} ({result.sequences} sequences, {result.tokens} "
               f"training tokens, {result.epochs} epochs, {result.seconds:.0f} s{vocab})")
    click.echo(f"held-out top-1 agreement {last['agreement'][0]:.3f} (before training "
               f"{first['agreement'][0]:.3f}); expected AL at D={al[4:]}: {last[al]:.2f} "
               f"({last['al_note']}); {result.out / 'distill.json'}")
    if not no_mlflow:
        try:
            from trtspec.report.tracking.distill import log_distill

            run_id = log_distill(result, mlflow_uri)
        except Exception as e:  # the heads are on disk: a tracking failure costs nothing
            reason = (str(e).strip().splitlines() or [type(e).__name__])[0]
            click.secho(f"MLflow: not logged ({reason}); the heads are in {result.out}",
                        fg="yellow", err=True)
        else:
            from trtspec.report.tracking.client import tracking_uri

            click.echo(f"MLflow: logged as run {run_id} at {tracking_uri(mlflow_uri)}")


class DistillTicker:
    """Progress of generation, the teacher pass and training: a bar per phase on a terminal;
    elsewhere a plain line when a phase starts, every ``every`` seconds, and when it ends."""

    def __init__(self, bar: Any, tty: bool, every: float = 10.0) -> None:
        self.names = {"generate": "generating", "teacher": "teacher pass", "train": "training"}
        self.bar, self.tty, self.every = bar, tty, every
        self.tasks: dict[str, Any] = {}
        self.last = 0.0

    def say(self, text: str) -> None:
        if self.tty:
            self.bar.console.print(text, highlight=False, markup=False)
        else:
            click.echo(text, err=True)

    def __call__(self, phase: str, done: int, total: int, note: str) -> None:
        name = self.names.get(phase, phase) + (f" ({note})" if note else "")
        if self.tty:
            if phase not in self.tasks:
                self.tasks[phase] = self.bar.add_task(name, total=total)
            self.bar.update(self.tasks[phase], completed=done, total=total, description=name)
            return
        now = time.monotonic()
        if phase in self.tasks and done < total and now - self.last < self.every:
            return
        self.tasks.setdefault(phase, None)
        self.last = now
        click.echo(f"{name}: {done}/{total}", err=True)
