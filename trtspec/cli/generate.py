"""`trtspec generate`: one batch through the exact speculative sampler, with its stats.

The generated text goes to stdout and everything about it (headers, the stats table) to stderr,
so ``trtspec generate … > out.txt`` keeps just the text; ``--json`` prints one object to stdout.
"""

from __future__ import annotations

import json
import time
from typing import Any

import click
from rich.console import Console
from rich.table import Table

from trtspec.build.open import executor_for
from trtspec.cli.serve import DraftLen
from trtspec.runtime.toy import MarkovLM, ToyRunner, parse_token_ids
from trtspec.spec.counters import SpecStats
from trtspec.spec.executor import Completion, Delta
from trtspec.spec.propose import make_proposer
from trtspec.spec.sample.probs import SamplingParams


@click.command()
@click.option("--backend", type=click.Choice(["torch", "toy"]), default="torch", show_default=True,
              help="torch = a real model via transformers; toy = exact Markov-chain models")
@click.option("--model", "-m", default="smollm2-135m-instruct", show_default=True,
              help="built-in name, .gguf file, local HF directory or cached hub id (torch)")
@click.option("--method", type=click.Choice(["none", "ngram", "suffix", "layer_skip",
                                            "draft_model"]),
              default="ngram", show_default=True, help="none = plain decoding (the baseline); "
              "suffix uses the recipe defaults (max_depth 24, …)")
@click.option("--draft-len", "-D", type=DraftLen(), default=4, show_default=True,
              help="D per round, or adaptive: each request chooses D ≤ 8 per round")
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
@click.option("--runner", "runner_kind", type=click.Choice(["eager", "compiled", "transformers"]),
              default="eager", show_default=True,
              help="torch: trtspec's decoder (eager, or compiled: slower start, no build "
              "cache here) or the model's own transformers modules")
@click.option("--json", "as_json", is_flag=True, help="print one JSON object instead of text")
def generate(backend: str, model: str, method: str, draft_len: int | str,
             draft_model: str | None,
             draft_layers: int | None, ngram_min: int, ngram_max: int, prompt: str | None,
             chat: bool, num_requests: int, max_tokens: int, temperature: float, top_k: int,
             top_p: float, seed: int, device: str, dtype: str, vocab_size: int, order: int,
             divergence: float, eos_id: int | None, runner_kind: str, as_json: bool) -> None:
    """Generate with exact speculative sampling: the text to stdout, the speculation stats to
    stderr (--json: one object to stdout)."""
    params = [SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed + i,
                             max_tokens=max_tokens) for i in range(num_requests)]
    tokenizer = None
    if backend == "toy":
        if method in ("layer_skip",):
            raise click.BadParameter("the toy backend has no layers to skip",
                                     param_hint="--method")
        ids = _token_ids(prompt or "1 2 3")
        target = MarkovLM(vocab_size, order, seed=seed, eos_token_id=eos_id)
        runner = ToyRunner(target)
        proposer = make_proposer(_method(method, ngram_min, ngram_max, draft_layers or 1),
                                 runner, draft=ToyRunner(target.diverged(divergence,
                                                                         seed=seed + 1)))
        eos = None
    else:
        from trtspec.build.open import eos_token_ids
        from trtspec.runtime.kinds import make_runner
        from trtspec.runtime.models import check_device, encode, load

        if method == "draft_model" and not draft_model:  # before loading any weights
            raise click.UsageError("--method draft_model needs a draft model: pass "
                                   "--draft-model NAME (same tokenizer as --model)")
        try:
            check_device(device)
        except ValueError as e:
            raise click.BadParameter(str(e), param_hint="--device") from None
        lm = load(model, device, dtype)
        tokenizer = lm.tokenizer
        ids = encode(tokenizer, prompt or "Write a haiku about speculative decoding.", chat)
        draft = load(draft_model, device, dtype) if draft_model else None
        runner = make_runner(lm.model, runner_kind, eos_token_id=tokenizer.eos_token_id)
        layers = draft_layers or max(1, len(lm.model.get_decoder().layers) // 2)
        try:
            proposer = make_proposer(_method(method, ngram_min, ngram_max, layers), runner,
                                     draft=draft, target_tokenizer=tokenizer)
        except ValueError as e:
            raise click.BadParameter(str(e), param_hint="--method") from None
        eos = eos_token_ids(lm)
    executor = executor_for(runner, proposer, method, draft_len, time_models=tokenizer is not None,
                            eos_token_ids=eos, say=lambda text: click.echo(text, err=True))
    stream = None if as_json or num_requests > 1 or tokenizer is None else Printer(tokenizer)
    started = time.perf_counter()
    completions = executor.generate([ids] * num_requests, params, on_step=stream)
    elapsed = time.perf_counter() - started
    _print_completions(completions, as_json, tokenizer, elapsed, show_tokens=stream is None)


def _method(name: str, ngram_min: int, ngram_max: int, layers: int) -> Any:
    from trtspec.spec.propose import method_named

    try:
        return method_named(name, layers=layers, ngram_min=ngram_min, ngram_max=ngram_max)
    except ValueError as e:  # e.g. --ngram-min above --ngram-max
        raise click.BadParameter(str(e).splitlines()[0], param_hint="--method") from None


def _token_ids(text: str) -> list[int]:
    try:
        return parse_token_ids(text)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--prompt") from None


class Printer:
    """Prints request 0's text as tokens arrive, through the server's incremental
    detokenizer (a trailing partial character is held back until it resolves)."""

    def __init__(self, tokenizer: Any) -> None:
        from trtspec.serve.openai_api import TextStream

        self.text = TextStream(lambda ids: tokenizer.decode(ids, skip_special_tokens=True))

    def __call__(self, deltas: list[Delta]) -> None:
        for d in deltas:
            if d.index == 0:
                click.echo(self.text.push(d.token_ids), nl=False)
                if d.finish_reason is not None:
                    click.echo(self.text.flush(), nl=False)


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
    console = Console(stderr=True)  # statistics; the text alone goes to stdout
    if not show_tokens:
        click.echo()
    for i, c in enumerate(completions if show_tokens else []):
        body = text(c) if tokenizer else " ".join(map(str, c.token_ids))
        console.print(f"[bold]request {i}[/] ({c.finish_reason}, {len(c.token_ids)} tokens):")
        click.echo(body)
    table = Table(title="speculation stats",
                  caption="the first token (from prefill) is in no counter")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key, value in stats.summary().items():
        table.add_row(key, _cell(value))
    table.add_row("acceptance per position",
                  " ".join(f"{a:.2f}" for a in stats.acceptance_per_position) or "—")
    table.add_row("output tokens / s", f"{tokens / elapsed:.1f}")
    console.print(table)


def _cell(value: float | int) -> str:
    """Undefined rates (nothing proposed, e.g. --method none) show as —, not nan."""
    if isinstance(value, float):
        return "—" if value != value else f"{value:.3f}"
    return str(value)


def _finite(value: float | int) -> float | int | None:
    """JSON has no NaN: undefined rates (nothing proposed) become null."""
    return None if value != value else value


