"""trtspec vs HF transformers on SmolLM2-135M-Instruct, CPU, greedy, batch 1, in one run.

Six decoders on the same model and prompts: trtspec plain / ngram / layer_skip and HF
``generate`` plain / ``prompt_lookup_num_tokens`` / ``assistant_model`` (the same layer-skip
draft, as a separate model, constant D). Two prompt sets: copy-heavy (summarise / edit / answer
from a given text) and open-ended chat. The same run also measures

* the bandwidth floor: weight bytes / read bandwidth (a large ``sum``), and trtspec plain's
  ms/token as a multiple of it;
* the target's scoring time for 1, 2, 3, 5, 9, 17 new tokens, i.e. t(D+1)/t(1), which the cost
  model needs; and the draft's step time, for c = t_draft / t_target;
* Leviathan's ideal speedup next to each measured one, and a cost-adjusted prediction that
  charges verification its measured t(D+1) instead of one target step.

Writes reports/bench-cpu.md. ``--quick`` runs 1 prompt per set and 8 tokens (a smoke test).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from bench_verify import median_seconds  # same folder: one timing helper

from trtspec.executor import SpecExecutor
from trtspec.metrics import SpecStats
from trtspec.models import encode, load
from trtspec.propose.draft_model import DraftModelProposer
from trtspec.propose.ngram import NgramProposer
from trtspec.runtime.hf import HFRunner, layer_skip_view
from trtspec.sampling import SamplingParams

ARTICLE = (
    "The city council met on Tuesday to discuss the new bicycle lanes on Main Street. "
    "Supporters said the lanes would make cycling safer and reduce traffic near the school. "
    "Shop owners worried that removing parking spaces would hurt their business. After two "
    "hours of debate, the council voted five to two to build the lanes, with a review after "
    "one year. The mayor said the city would add parking on Elm Street to help the shops."
)
CODE = (
    "def mean(values):\n    total = 0\n    for v in values:\n        total = total + v\n"
    "    return total / len(values)\n\n\ndef variance(values):\n    m = mean(values)\n"
    "    total = 0\n    for v in values:\n        total = total + (v - m) ** 2\n"
    "    return total / len(values)\n"
)
PROMPT_SETS = {
    "copy-heavy": [
        f"Summarise this article in three sentences, reusing its wording:\n\n{ARTICLE}",
        f"Rewrite this code with type hints, keeping everything else identical:\n\n{CODE}",
        f"Answer from the text only: how did the council vote, and what happens next?\n\n"
        f"{ARTICLE}",
        f"Fix the spelling and repeat the text: {ARTICLE.replace('the ', 'teh ', 4)}",
    ],
    "open-ended chat": [
        "Write a short story about a lighthouse keeper who finds a message in a bottle.",
        "What are three good habits for learning a new language?",
        "Explain why the sky is blue to a ten-year-old.",
        "Give me ideas for a rainy weekend at home.",
    ],
}
D = 4
# of 30: the layer-skip draft keeps the first 24, the early exit that agrees best with the model
SKIP_LAYERS = 24


@dataclass
class Result:
    method: str
    seconds: float
    tokens: int
    stats: SpecStats | None = None
    outside: float | None = None  # seconds outside model forwards (trtspec only)

    @property
    def ms_per_token(self) -> float:
        return self.seconds * 1e3 / self.tokens


def read_gbps(nbytes: int = 1 << 30, repeats: int = 5) -> float:
    x = torch.rand(nbytes // 4)
    return nbytes / median_seconds(lambda: x.sum(), repeats) / 1e9


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes a decode step must read: every parameter once (tied embeddings counted once)."""
    seen, total = set(), 0
    for p in model.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel() * p.element_size()
    return total


def scoring_times(model, prompt: list[int], sizes: list[int], repeats: int) -> dict[int, float]:
    runner = HFRunner(model)
    runner.prefill([prompt])
    base = runner.lengths()
    out = {}
    for n in sizes:
        def step(n: int = n) -> None:
            runner.score([list(range(100, 100 + n))])
            runner.rollback(base)
        out[n] = median_seconds(step, repeats)
    return out


class TimedRunner(HFRunner):
    """HFRunner that adds up the time spent in model forwards (to isolate executor overhead)."""

    forward_seconds = 0.0

    def score(self, tokens, last_only=False):
        t0 = time.perf_counter()
        try:
            return super().score(tokens, last_only)
        finally:
            TimedRunner.forward_seconds += time.perf_counter() - t0


def run_trtspec(model, prompts, params, proposer_factory, d: int
                ) -> tuple[float, int, SpecStats, float]:
    """→ seconds, output tokens, stats, seconds outside model forwards (target and draft)."""
    seconds, tokens, stats = 0.0, 0, []
    TimedRunner.forward_seconds = 0.0
    for prompt in prompts:  # batch 1, like HF's assisted generation
        proposer = proposer_factory() if proposer_factory else None
        executor = SpecExecutor(TimedRunner(model), proposer, d)
        t0 = time.perf_counter()
        out = executor.generate([prompt], params)[0]
        seconds += time.perf_counter() - t0
        tokens += len(out.token_ids)
        stats.append(out.stats)
    return seconds, tokens, SpecStats.merge(stats), seconds - TimedRunner.forward_seconds


def run_hf(model, prompts, new_tokens: int, **kwargs) -> tuple[float, int]:
    seconds, tokens = 0.0, 0
    for prompt in prompts:
        ids = torch.tensor([prompt])
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=new_tokens, **kwargs)
        seconds += time.perf_counter() - t0
        tokens += out.shape[1] - ids.shape[1]
    return seconds, tokens


def leviathan(alpha: float, d: int, c: float, verify_cost: float = 1.0) -> float:
    """Expected speedup: (1 − α^(D+1)) / (1 − α) tokens per (D·c + verify_cost) target steps."""
    emitted = d + 1 if alpha >= 1.0 else (1 - alpha ** (d + 1)) / (1 - alpha)
    return emitted / (d * c + verify_cost)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1 prompt per set, 8 tokens")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--out", type=Path, default=Path("reports/bench-cpu.md"))
    args = parser.parse_args()
    new_tokens = 8 if args.quick else args.new_tokens
    repeats = 3 if args.quick else 9

    lm = load("smollm2-135m-instruct", device="cpu")
    model, tok = lm.model, lm.tokenizer
    draft_view = layer_skip_view(model, SKIP_LAYERS)
    params = SamplingParams(temperature=0, max_tokens=new_tokens)
    eos = tok.eos_token_id

    bandwidth = read_gbps()
    nbytes = weight_bytes(model)
    floor_ms = nbytes / bandwidth / 1e6
    probe = encode(tok, PROMPT_SETS["copy-heavy"][0])
    sizes = [1, 2, 3, 5, 9, 17]
    t_target = scoring_times(model, probe, sizes, repeats)
    t_draft = scoring_times(draft_view, probe, [1], repeats)[1]
    c = t_draft / t_target[1]
    verify_cost = t_target[D + 1] / t_target[1]

    warm = [encode(tok, PROMPT_SETS["copy-heavy"][0])]
    warm_params = params.model_copy(update={"max_tokens": 8})
    proposers = {
        "trtspec plain": None,
        "trtspec ngram": lambda: NgramProposer(1, 3),
        "trtspec layer_skip": lambda: DraftModelProposer(TimedRunner(draft_view,
                                                                     eos_token_id=eos)),
    }
    sections = {}
    for set_name, texts in PROMPT_SETS.items():
        prompts = [encode(tok, t) for t in (texts[:1] if args.quick else texts)]
        results = []
        for name, factory in proposers.items():
            run_trtspec(model, warm, warm_params, factory, D)  # identical untimed warm-up
            seconds, tokens, stats, outside = run_trtspec(model, prompts, params, factory, D)
            results.append(Result(name, seconds, tokens, stats, outside=outside))
            print(f"{set_name:>16} {name:<22} {seconds * 1e3 / tokens:7.1f} ms/token", flush=True)
        hf = {
            "HF generate": {},
            "HF prompt_lookup_num_tokens": {"prompt_lookup_num_tokens": D},
            "HF assistant_model": {"assistant_model": draft_view},
        }
        draft_view.generation_config = model.generation_config.__class__.from_dict(
            {**model.generation_config.to_dict(), "num_assistant_tokens": D,
             "num_assistant_tokens_schedule": "constant", "assistant_confidence_threshold": 0.0})
        for name, kwargs in hf.items():
            run_hf(model, warm, 8, **kwargs)  # identical untimed warm-up
            seconds, tokens = run_hf(model, prompts, new_tokens, **kwargs)
            results.append(Result(name, seconds, tokens))
            print(f"{set_name:>16} {name:<22} {seconds * 1e3 / tokens:7.1f} ms/token", flush=True)
        sections[set_name] = results

    text = report(sections, bandwidth, nbytes, floor_ms, t_target, t_draft, c, verify_cost,
                  new_tokens, args.quick)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(text)
    print(f"wrote {args.out}")


def report(sections, bandwidth, nbytes, floor_ms, t_target, t_draft, c, verify_cost,
           new_tokens, quick) -> str:
    lines = [
        "# bench-cpu: trtspec vs HF transformers, SmolLM2-135M-Instruct fp32, CPU, batch 1",
        "",
        f"Machine: {platform.machine()}, {torch.get_num_threads()} torch threads, torch "
        f"{torch.__version__}. Greedy, up to {new_tokens} new tokens (EOS ends a request), "
        f"D = {D}, every decoder warmed up identically (8 untimed tokens)"
        f", layer_skip draft = first {SKIP_LAYERS} of 30 layers. One run, same prompts for all."
        + (" **--quick smoke run: numbers are not meaningful.**" if quick else ""),
        "",
        "| prompt set | method | ms/token | speedup vs HF generate | speedup vs trtspec plain "
        "| AL (pooled) | acceptance rate | α | Leviathan ideal | cost-adjusted "
        "| outside forwards |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for set_name, results in sections.items():
        hf_plain = next(r for r in results if r.method == "HF generate").ms_per_token
        ours = next(r for r in results if r.method == "trtspec plain").ms_per_token
        for r in results:
            al = acc = alpha_text = ideal = adjusted = "—"
            if r.stats is not None and r.stats.proposed_tokens:
                alpha = r.stats.alpha  # per-token acceptance probability, not the rate
                cost = 0.0 if "ngram" in r.method else c
                al, acc = f"{r.stats.al_pooled:.2f}", f"{r.stats.acceptance_rate:.2f}"
                alpha_text = f"{alpha:.2f}"
                ideal = f"{leviathan(alpha, D, cost):.2f}×"
                adjusted = f"{leviathan(alpha, D, cost, verify_cost):.2f}×"
            outside = "—" if r.outside is None else f"{100 * r.outside / r.seconds:.1f} %"
            lines.append(f"| {set_name} | {r.method} | {r.ms_per_token:.1f} | "
                         f"{hf_plain / r.ms_per_token:.2f}× | {ours / r.ms_per_token:.2f}× | "
                         f"{al} | {acc} | {alpha_text} | {ideal} | {adjusted} | {outside} |")
    plain = statistics.mean(next(r for r in rs if r.method == "trtspec plain").ms_per_token
                            for rs in sections.values())
    hf = statistics.mean(next(r for r in rs if r.method == "HF generate").ms_per_token
                         for rs in sections.values())
    lines += [
        "",
        "Leviathan ideal = (1 − α^(D+1)) / ((1 − α)(D·c + 1)) with α the per-token acceptance "
        "probability, estimated as accepted / (accepted + rejected rounds) (the i.i.d. "
        "maximum-likelihood estimate; the acceptance rate accepted / proposed is not α) and "
        f"c = t_draft / t_target = {c:.2f} (ngram: c = 0). "
        f"Cost-adjusted charges verification its measured t({D + 1})/t(1) = {verify_cost:.2f} "
        "target steps instead of 1. \"Outside forwards\" is the share of wall time trtspec "
        "spends outside model forward calls (proposing, sampling, verification, bookkeeping).",
        "",
        "## Bandwidth floor",
        "",
        f"Weights read per decode step: {nbytes / 1e6:.0f} MB; read bandwidth (large `sum`, same "
        f"run): {bandwidth:.1f} GB/s → floor **{floor_ms:.1f} ms/token**. trtspec plain: "
        f"{plain:.1f} ms/token = **{plain / floor_ms:.2f}× the floor**; HF generate: {hf:.1f} "
        f"ms/token = {hf / floor_ms:.2f}×.",
        "",
        "## Target scoring time vs new tokens (the cost model's t(D+1)/t(1))",
        "",
        "| new tokens | ms | × one token |",
        "|---:|---:|---:|",
    ]
    for n, t in t_target.items():
        lines.append(f"| {n} | {t * 1e3:.1f} | {t / t_target[1]:.2f} |")
    lines += ["", f"Draft ({SKIP_LAYERS} layers) one-token step: {t_draft * 1e3:.1f} ms "
                  f"(c = {c:.2f}).", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
