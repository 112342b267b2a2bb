"""trtspec vs HF transformers on SmolLM2-135M-Instruct, CPU, greedy, batch 1, in one run.

Same model, same prompts, same greedy decoding for every decoder:

* trtspec plain decoding on three runners: ``transformers`` (the model's own modules, eager),
  ``eager`` (trtspec's fused decoder) and ``compiled`` (the same decoder under torch.compile),
  and ``compiled`` with its weights as the model has them (not prepacked for oneDNN: the
  runner before prepacking, its t(T) too);
* trtspec ngram, suffix and layer_skip on the compiled runner, at fixed D and with the adaptive
  draft length (cap K);
* HF ``generate`` eager, HF with its static cache + ``torch.compile`` (its strongest CPU setup),
  HF ``prompt_lookup_num_tokens`` and HF ``assistant_model`` (the same layer-skip draft).

Three prompt sets: copy-heavy (summarise / edit / answer from a given text), open-ended chat, and
repeated-pattern (requests that share a template, run one after another: drafting across
requests helps). The run also measures the compiled runner's cost curve t(T), its compile time
cold and from the cache in a new process, the bandwidth floor, and each decoder's cost-adjusted
ideal: the speedup over plain decoding if nothing but the target's forwards cost time, each round
charged its measured t(n + 1)/t(1) (plus n draft steps for a model draft).

Writes reports/bench-cpu.md. ``--quick``: 1 prompt per set, 8 tokens, no compiling and no
warm-up (a smoke test: every decoder runs, no number means anything).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from bench_verify import median_seconds  # same folder: one timing helper

from trtspec.runtime.hf import HFRunner, layer_skip_view
from trtspec.runtime.kinds import make_runner
from trtspec.runtime.models import encode, load
from trtspec.spec.adaptive import AdaptiveDraft
from trtspec.spec.cost_curve import measure
from trtspec.spec.counters import SpecStats
from trtspec.spec.executor import SpecExecutor
from trtspec.spec.propose.layer_skip import LayerSkipProposer
from trtspec.spec.propose.ngram import NgramProposer
from trtspec.spec.propose.suffix import SuffixProposer
from trtspec.spec.sample.probs import SamplingParams

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
PEOPLE = [("Ana Silva", 34, "Lisbon", "nurse"), ("Tom Becker", 51, "Hamburg", "baker"),
          ("Mei Chen", 27, "Taipei", "engineer"), ("Omar Haddad", 45, "Amman", "teacher"),
          ("Lena Novak", 39, "Prague", "pilot")]
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
    "repeated pattern": [
        f"Write a JSON object with the keys name, age, city, job, hobbies (a list of three) and "
        f"a one-sentence bio for this person: {n}, {a}, lives in {c}, works as a {j}."
        for n, a, c, j in PEOPLE],
}
D, K = 4, 8  # fixed draft length; the adaptive draft length's cap
SKIP_LAYERS = 24  # of 30: the early exit that agrees best with the model


@dataclass
class Result:
    method: str
    seconds: float
    tokens: int
    stats: SpecStats | None = None
    ideal: float | None = None  # cost-adjusted ideal speedup over plain decoding
    rss_mb: float = 0.0  # resident memory after the run
    outputs: list[list[int]] | None = None  # token ids per prompt
    decode_seconds: float | None = None  # after each request's first token (trtspec only)

    @property
    def ms_per_token(self) -> float:
        return self.seconds * 1e3 / self.tokens

    @property
    def decode_ms_per_token(self) -> float:
        """ms per token after each request's first (prefill's): what the ideal speaks of."""
        assert self.decode_seconds is not None and self.outputs is not None
        return self.decode_seconds * 1e3 / (self.tokens - len(self.outputs))


def rss_mb(field: str = "VmRSS") -> float:
    """This process's resident memory (VmRSS) or its peak so far (VmHWM), MB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    return float("nan")


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


def ideal_speedup(stats: list[SpecStats], cost: list[float], c: float) -> float:
    """Tokens the rounds emitted / target steps they cost: a round that drafted n tokens costs
    t(n + 1)/t(1) + n·c (c = one draft step / t(1), 0 without a draft model)."""
    emitted = sum(s.emitted_tokens for s in stats)
    steps = sum(cost[min(n, len(cost) - 1)] + n * c for s in stats for n in s.proposed_lens)
    return emitted / steps if steps else float("nan")


def run_trtspec(runner, prompts, params, proposer, d: int, adaptive: AdaptiveDraft | None
                ) -> tuple[float, list[list[int]], list[SpecStats], float]:
    """(seconds, outputs, stats, seconds after each request's first token)."""
    seconds, outputs, stats, decode = 0.0, [], [], 0.0
    for prompt in prompts:  # batch 1, one request after another (a proposer keeps its state)
        executor = SpecExecutor(runner, proposer, d, adaptive=adaptive)
        first: list[float] = []
        t0 = time.perf_counter()
        out = executor.generate([prompt], params, on_step=lambda _, first=first: (
            first or first.append(time.perf_counter())))[0]
        end = time.perf_counter()
        seconds, decode = seconds + end - t0, decode + end - first[0]
        outputs.append(out.token_ids)
        stats.append(out.stats)
    return seconds, outputs, stats, decode


def run_hf(model, prompts, new_tokens: int, **kwargs) -> tuple[float, list[list[int]]]:
    seconds, outputs = 0.0, []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=new_tokens, **kwargs)
        seconds += time.perf_counter() - t0
        outputs.append(out[0, ids.shape[1]:].tolist())
    return seconds, outputs


def compile_from_cache(cache: Path) -> float:
    """Seconds a new process takes to load the compiled graphs from ``cache`` (first token)."""
    code = ("import time, torch; from trtspec.runtime.models import load; "
            "from trtspec.runtime.kinds import make_runner; "
            "m = load('smollm2-135m-instruct', device='cpu').model; t = time.perf_counter(); "
            f"r = make_runner(m, 'compiled', cache_dir={str(cache)!r}); r.warm_up(1); "
            "print(time.perf_counter() - t)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return float(out.stdout.split()[-1])


def same(ours: list[list[int]] | None, theirs: list[list[int]] | None) -> str:
    if ours is None or theirs is None:
        return "—"
    return f"{sum(a == b for a, b in zip(ours, theirs, strict=True))}/{len(theirs)}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1 prompt per set, 8 tokens")
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--out", type=Path, default=Path("reports/bench-cpu.md"))
    args = parser.parse_args()
    new_tokens = 8 if args.quick else args.new_tokens
    kind = "eager" if args.quick else "compiled"

    lm = load("smollm2-135m-instruct", device="cpu")
    model, tok = lm.model, lm.tokenizer
    eos = tok.eos_token_id
    params = SamplingParams(temperature=0, max_tokens=new_tokens)
    notes: dict[str, str] = {}

    cache = Path(tempfile.mkdtemp(prefix="bench-inductor-"))
    t0 = time.perf_counter()
    compiled = make_runner(model, kind, eos_token_id=eos, cache_dir=cache)
    if kind == "compiled":
        compiled.warm_up(1)  # every graph of one row (a long prompt's prefill has its own)
    notes["compile_cold"] = f"{time.perf_counter() - t0:.0f} s"
    notes["compile_cached"] = "—" if args.quick else f"{compile_from_cache(cache):.1f} s"
    draft = compiled.view(SKIP_LAYERS)
    curve = measure(compiled, K + 1, {"layer_skip": draft})
    cost, c = curve.relative("layer_skip")
    unpacked = make_runner(model, kind, eos_token_id=eos, cache_dir=cache, prepacked=False)
    if kind == "compiled":
        unpacked.warm_up(1)
    runners = {"transformers": HFRunner(model, eos_token_id=eos),
               "eager": make_runner(model, "eager", eos_token_id=eos), kind: compiled,
               "unpacked": unpacked}
    hf_curve = measure(runners["transformers"], K + 1)
    unpacked_curve = measure(unpacked, K + 1)

    def skip_draft() -> LayerSkipProposer:  # as eval makes it: over the target's KV cache
        return LayerSkipProposer(compiled.view(SKIP_LAYERS, share_cache=True))

    def adaptive(method: str) -> AdaptiveDraft:
        return AdaptiveDraft(K, cost, 0.0 if method != "layer_skip" else c)

    decoders: dict[str, tuple[str, Callable | None, int, str | None]] = {
        "trtspec plain [transformers]": ("transformers", None, 0, None),
        "trtspec plain [eager]": ("eager", None, 0, None),
        f"trtspec plain [{kind}]": (kind, None, 0, None),
        f"trtspec plain [{kind}, not prepacked]": ("unpacked", None, 0, None),
        f"trtspec ngram D={D}": (kind, lambda: NgramProposer(1, 3), D, None),
        "trtspec ngram adaptive": (kind, lambda: NgramProposer(1, 3), K, "ngram"),
        f"trtspec suffix (≤ {K})": (kind, SuffixProposer, K, None),
        "trtspec suffix adaptive": (kind, SuffixProposer, K, "suffix"),
        f"trtspec layer_skip D={D}": (kind, skip_draft, D, None),
        "trtspec layer_skip adaptive": (kind, skip_draft, K, "layer_skip"),
    }
    hf_static = load("smollm2-135m-instruct", device="cpu").model  # a copy to compile
    hf_static.generation_config.cache_implementation = "static"
    if not args.quick:
        hf_static.forward = torch.compile(hf_static.forward, fullgraph=True)
    assistant = layer_skip_view(model, SKIP_LAYERS)
    assistant.generation_config = model.generation_config.__class__.from_dict(
        {**model.generation_config.to_dict(), "num_assistant_tokens": D,
         "num_assistant_tokens_schedule": "constant", "assistant_confidence_threshold": 0.0})
    hf = {"HF generate": (model, {}),
          "HF static cache + torch.compile": (hf_static, {}),
          "HF prompt_lookup_num_tokens": (model, {"prompt_lookup_num_tokens": D}),
          "HF assistant_model": (model, {"assistant_model": assistant})}

    warm = [encode(tok, "Say hello in French."), encode(tok, f"Repeat this: {ARTICLE[:200]}")]
    warm_params = params.model_copy(update={"max_tokens": 8})
    sections: dict[str, list[Result]] = {}
    for set_name, texts in PROMPT_SETS.items():
        prompts = [encode(tok, t) for t in (texts[:1] if args.quick else texts)]
        results = []
        for name, (runner_kind, factory, d, method) in decoders.items():
            runner = runners[runner_kind]
            proposer = factory() if factory else None  # one per prompt set: suffix remembers
            chooser = adaptive(method) if method else None
            if not args.quick:  # a smoke run times nothing that matters: no warm-up
                run_trtspec(runner, warm, warm_params, proposer, d, chooser)  # untimed
            if hasattr(proposer, "forget"):
                proposer.forget()  # suffix drafts nothing from the warm-up
            seconds, outputs, stats, decode = run_trtspec(runner, prompts, params, proposer, d,
                                                          chooser)
            tokens = sum(len(o) for o in outputs)
            ideal = ideal_speedup(stats, cost, c if "layer_skip" in name else 0.0) \
                if factory else None
            results.append(Result(name, seconds, tokens, SpecStats.merge(stats), ideal,
                                  rss_mb(), outputs, decode))
            print(f"{set_name:>16} {name:<34} {seconds * 1e3 / tokens:7.1f} ms/token", flush=True)
        for name, (hf_model, kwargs) in hf.items():
            t0 = time.perf_counter()
            if not args.quick:
                run_hf(hf_model, warm, 8, **kwargs)  # untimed warm-up (compiles HF static)
            if name.startswith("HF static") and "hf_compile" not in notes:
                notes["hf_compile"] = f"{time.perf_counter() - t0:.0f} s"
            seconds, outputs = run_hf(hf_model, prompts, new_tokens, **kwargs)
            results.append(Result(name, seconds, sum(len(o) for o in outputs), rss_mb=rss_mb(),
                                  outputs=outputs))
            print(f"{set_name:>16} {name:<34} {seconds * 1e3 / tokens:7.1f} ms/token", flush=True)
        sections[set_name] = results

    floor_ms = weight_bytes(model) / read_gbps() / 1e6
    text = report(sections, curve, hf_curve, unpacked_curve, c, floor_ms, notes, new_tokens,
                  kind, args.quick)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(text)
    print(f"wrote {args.out}")


def report(sections, curve, hf_curve, unpacked_curve, c, floor_ms, notes, new_tokens, kind,
           quick) -> str:
    lines = [
        "# bench-cpu: trtspec vs HF transformers, SmolLM2-135M-Instruct fp32, CPU, batch 1",
        "",
        f"Machine: {platform.machine()}, {torch.get_num_threads()} torch threads, torch "
        f"{torch.__version__}. Greedy, up to {new_tokens} new tokens (EOS ends a request), "
        f"fixed D = {D}, adaptive cap K = {K}, suffix drafts up to {K}; every decoder warmed "
        f"up identically (two untimed 8-token requests); layer_skip draft = first {SKIP_LAYERS} "
        "of 30 layers (it drafts over the target's own KV cache, as eval runs it). Requests "
        "run one after another. One run, same prompts for all."
        + (" **--quick smoke run (no compiling): numbers are not meaningful.**" if quick else ""),
        "",
        "| prompt set | decoder | ms/token | vs HF generate | vs trtspec plain "
        "| AL | acceptance | mean D | cost-adjusted ideal | measured / ideal | RSS MB "
        "| = HF tokens |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for set_name, results in sections.items():
        hf_run = next(r for r in results if r.method == "HF generate")
        hf_plain = hf_run.ms_per_token
        plain_run = next(r for r in results if r.method == f"trtspec plain [{kind}]")
        plain = plain_run.ms_per_token
        for r in results:
            al = acc = mean_d = ideal = ratio = "—"
            if r.stats is not None and r.stats.verification_rounds and r.ideal is not None:
                al, acc = f"{r.stats.al_pooled:.2f}", f"{r.stats.acceptance_rate:.2f}"
                mean_d = f"{r.stats.draft_len_mean:.2f}"
                ideal = f"{r.ideal:.2f}×"
                ratio = f"{plain_run.decode_ms_per_token / r.decode_ms_per_token / r.ideal:.0%}"
            lines.append(f"| {set_name} | {r.method} | {r.ms_per_token:.1f} | "
                         f"{hf_plain / r.ms_per_token:.2f}× | {plain / r.ms_per_token:.2f}× | "
                         f"{al} | {acc} | {mean_d} | {ideal} | {ratio} | {r.rss_mb:.0f} | "
                         f"{same(r.outputs, hf_run.outputs)} |")
    ours = statistics.mean(next(r for r in rs if r.method == f"trtspec plain [{kind}]")
                           .ms_per_token for rs in sections.values())
    hf = statistics.mean(next(r for r in rs if r.method == "HF generate").ms_per_token
                         for rs in sections.values())
    lines += [
        "",
        "**Cost-adjusted ideal**: emitted tokens / Σ over rounds of (t(n + 1)/t(1) + n·c), n the "
        f"tokens the round drafted, t the compiled runner's cost curve below, c = {c:.2f} for "
        "layer_skip (one draft step / t(1)) and 0 for ngram and suffix: the speedup over plain "
        "decoding if proposing, sampling, verification and bookkeeping were free. **measured / "
        "ideal** = (trtspec plain decode ms/token / this decode ms/token) / ideal, decode time "
        "being each request's time after its first token (prefill's), which the ideal leaves "
        "out too; ms/token and the speedup columns include prefill. AL is pooled (Σ emitted / "
        "Σ rounds); mean D is the draft length asked per round (the adaptive chooser's choice, "
        "0 = plain step). RSS is "
        f"this process's resident memory after the decoder ran (peak {rss_mb('VmHWM'):.0f} MB; "
        "the compiled runner keeps prepacked copies of every GEMM's weight; the not-prepacked "
        "one fused copies of the q|k|v and gate|up matrices). **= HF "
        "tokens**: prompts whose greedy output is token for token HF generate's (fp32 rounding "
        "can flip a near-tie; the exactness tests, not this column, prove the distribution).",
        "",
        f"**Compile time**: the compiled runner, cold (empty inductor cache): "
        f"{notes['compile_cold']}; a new process loading the same graphs from the cache: "
        f"{notes['compile_cached']}. HF static cache + torch.compile: "
        f"{notes.get('hf_compile', '—')} (its warm-up, untimed).",
        "",
        f"**Bandwidth floor**: weights / read bandwidth (a large `sum`) = {floor_ms:.1f} ms/token; "
        f"trtspec plain [{kind}] {ours:.1f} ms/token = {ours / floor_ms:.2f}× the floor, HF "
        f"generate {hf:.1f} = {hf / floor_ms:.2f}×.",
        "",
        "## Target scoring time t(T) vs new tokens T",
        "",
        f"| T | {kind} ms | × t(1) | {kind}, not prepacked ms | × t(1) | transformers ms "
        "| × t(1) |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    base, hf_base, un_base = curve.target[1], hf_curve.target[1], unpacked_curve.target[1]
    for t in sorted(curve.target):
        lines.append(f"| {t} | {curve.target[t]:.1f} | {curve.target[t] / base:.2f} | "
                     f"{unpacked_curve.target[t]:.1f} | {unpacked_curve.target[t] / un_base:.2f}"
                     f" | {hf_curve.target[t]:.1f} | {hf_curve.target[t] / hf_base:.2f} |")
    lines += ["", f"Layer-skip draft ({SKIP_LAYERS} layers) step on the {kind} runner: "
              f"{curve.draft['layer_skip']:.1f} ms (c = {c:.2f}).", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
