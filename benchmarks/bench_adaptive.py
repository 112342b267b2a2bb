"""Adaptive draft length on open-ended chat: plain decoding vs each method's adaptive D, the
decoders interleaved round by round and the median taken, so the machine's drift (which moves
one run by several percent on a shared 2-core machine) does not decide a 3 % question.

SmolLM2-135M-Instruct fp32 on the compiled runner, greedy, batch 1, bench_cpu's open-ended
prompts and settings (cap K, layer-skip layers; the layer-skip draft over the target's cache).
Writes reports/bench-adaptive.md. ``--quick``: eager runner, one prompt, 8 tokens, one round.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

import torch
from bench_cpu import PROMPT_SETS, SKIP_LAYERS, K, run_trtspec  # same folder, same settings

from trtspec.runtime.kinds import built_runner
from trtspec.runtime.models import encode, load
from trtspec.spec.adaptive import AdaptiveDraft
from trtspec.spec.cost_curve import measure
from trtspec.spec.propose.layer_skip import LayerSkipProposer
from trtspec.spec.propose.ngram import NgramProposer
from trtspec.spec.propose.suffix import SuffixProposer
from trtspec.spec.sample.probs import SamplingParams

SET = "open-ended chat"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("reports/bench-adaptive.md"))
    args = parser.parse_args()
    rounds, new_tokens = (1, 8) if args.quick else (args.rounds, 96)
    lm = load("smollm2-135m-instruct", device="cpu")
    tok = lm.tokenizer
    kind = "eager" if args.quick else "compiled"
    runner = built_runner(lm.model, kind, rows=1, eos_token_id=tok.eos_token_id,
                          cache_dir=Path(tempfile.mkdtemp(prefix="bench-inductor-")))
    cost, c = measure(runner, K + 1, {"layer_skip": runner.view(SKIP_LAYERS)}
                      ).relative("layer_skip")
    decoders = {
        "trtspec plain": lambda: (None, 0, None),
        "ngram adaptive": lambda: (NgramProposer(1, 3), K, AdaptiveDraft(K, cost, 0.0)),
        "suffix adaptive": lambda: (SuffixProposer(), K, AdaptiveDraft(K, cost, 0.0)),
        "layer_skip adaptive": lambda: (LayerSkipProposer(runner.view(SKIP_LAYERS,
                                                                     share_cache=True)),
                                        K, AdaptiveDraft(K, cost, c)),
    }
    params = SamplingParams(temperature=0, max_tokens=new_tokens)
    warm = [encode(tok, "Say hello in French.")]
    warm_params = params.model_copy(update={"max_tokens": 8})
    texts = PROMPT_SETS[SET][:1] if args.quick else PROMPT_SETS[SET]
    prompts = [encode(tok, t) for t in texts]
    ms: dict[str, list[float]] = {name: [] for name in decoders}
    for r in range(rounds):
        for name, make in decoders.items():
            proposer, d, chooser = make()
            run_trtspec(runner, warm, warm_params, proposer, d, chooser)  # untimed warm-up
            if hasattr(proposer, "forget"):
                proposer.forget()
            seconds, outputs, _, _ = run_trtspec(runner, prompts, params, proposer, d, chooser)
            ms[name].append(seconds * 1e3 / sum(len(o) for o in outputs))
            print(f"round {r + 1} {name:<22} {ms[name][-1]:6.1f} ms/token", flush=True)
    base = statistics.median(ms["trtspec plain"])
    lines = [
        "# Adaptive draft length on open-ended chat (CPU), interleaved rounds", "",
        f"SmolLM2-135M-Instruct fp32, {kind} runner, {torch.get_num_threads()} threads, greedy, "
        f"batch 1, up to {new_tokens} new tokens, {len(prompts)} prompts (bench_cpu's "
        f"{SET!r} set), adaptive cap K = {K}, layer_skip = first {SKIP_LAYERS} of 30 layers "
        f"over the target's KV cache (c = {c:.2f}). {rounds} rounds; in each, every decoder "
        "runs the prompts once, in the order below, after an untimed warm-up."
        + (" **--quick smoke run: numbers are not meaningful.**" if args.quick else ""), "",
        "| decoder | ms/token per round | median | vs trtspec plain (median) |",
        "|---|---|---:|---:|"]
    for name, values in ms.items():
        median = statistics.median(values)
        lines.append(f"| {name} | {' / '.join(f'{v:.1f}' for v in values)} | {median:.1f} | "
                     f"{median / base - 1:+.1%} |")
    lines += ["", "Command: `.venv/bin/python benchmarks/bench_adaptive.py`", ""]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
