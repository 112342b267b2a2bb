"""The serving scheduler under load: SmolLM2-135M-Instruct on this CPU, greedy, in one run.

For plain decoding and for n-gram speculation (D = 4), 1, 4 and 8 closed-loop clients send
the same prompts through `trtspec serve`'s scheduler (8 slots) on the runner serve uses by
default (the compiled one; eager with ``--quick``). Per cell: output tokens/s
(tokens over the wall time the load ran), TTFT and TPOT p50 / p99, AL, and the scheduler's
overhead: the share of wall time outside model forwards (target and draft scoring). HF
``generate`` runs the same prompts one at a time beside it, as the reference a user has.

Writes reports/bench-serve.md. ``--quick`` runs 4 prompts and 8 tokens (a smoke test).

``--soak`` instead runs `trtspec serve` over HTTP for a long run (see serve_soak.py) and writes
(or replaces) the report's "## Soak" section; ``--soak --quick``: 40 requests on the toy
backend.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from serve_soak import soak, write_report  # same folder: the --soak run

from trtspec.eval.clients import run_clients
from trtspec.eval.workloads import builtin, per_category
from trtspec.executor import SpecExecutor
from trtspec.metrics import SpecStats
from trtspec.models import encode, load
from trtspec.propose.ngram import NgramProposer
from trtspec.runtime.kinds import built_runner
from trtspec.sampling import SamplingParams

SLOTS = 8
FORWARD = [0.0]  # seconds in the runner's score() since the last reset


def timed(runner):
    """The runner, its score() adding up its seconds in FORWARD (to isolate the overhead)."""
    score = runner.score

    def timed_score(tokens, last_only=False):
        t0 = time.perf_counter()
        try:
            return score(tokens, last_only)
        finally:
            FORWARD[0] += time.perf_counter() - t0

    runner.score = timed_score
    return runner


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def cell(runner, prompts, params, method: str, clients: int) -> dict[str, float]:
    proposer = NgramProposer(1, 3) if method == "ngram" else None
    executor = SpecExecutor(runner, proposer, 4)
    executor.generate([prompts[0]], params[0].model_copy(update={"max_tokens": 4}))  # warm
    FORWARD[0] = 0.0
    start = time.perf_counter()
    sent, _ = run_clients(executor, prompts, params, clients, SLOTS)
    wall = time.perf_counter() - start
    tokens = sum(len(s.ticket.token_ids) for s in sent)
    ttft = [s.token_times[0] for s in sent if s.token_times]
    tpot = [(s.token_times[-1] - s.token_times[0]) / (len(s.token_times) - 1)
            for s in sent if len(s.token_times) > 1]
    stats = SpecStats.merge(s.ticket.stats for s in sent)
    return {"tok_s": tokens / wall, "ttft50": percentile(ttft, 50) * 1e3,
            "ttft99": percentile(ttft, 99) * 1e3, "tpot50": percentile(tpot, 50) * 1e3,
            "tpot99": percentile(tpot, 99) * 1e3, "al": stats.summary()["al_pooled"],
            "overhead": 1 - FORWARD[0] / wall, "wall": wall, "tokens": tokens}


def hf_reference(lm, prompts, max_tokens: int) -> float:
    """HF generate, greedy, one request at a time: output tokens/s."""
    tokens, start = 0, time.perf_counter()
    for p in prompts:
        ids = torch.tensor([p])
        out = lm.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                max_new_tokens=max_tokens,
                                pad_token_id=lm.tokenizer.eos_token_id)
        tokens += out.shape[1] - ids.shape[1]
    return tokens / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", type=Path, default=Path("reports/bench-serve.md"))
    parser.add_argument("--soak", action="store_true",
                        help="instead, soak `trtspec serve` over HTTP (serve_soak.py)")
    parser.add_argument("--soak-requests", type=int, default=None,
                        help="--soak: requests measured [default: 2000; 40 with --quick]")
    parser.add_argument("--soak-clients", type=int, default=16,
                        help="--soak: concurrent streaming clients")
    parser.add_argument("--soak-warmup", type=int, default=None,
                        help="--soak: requests before the first memory reading "
                             "[default: 2 × clients]")
    parser.add_argument("--backend", choices=["recipe", "toy"], default=None,
                        help="--soak: what `trtspec serve` runs [default: recipe; toy "
                             "with --quick]")
    parser.add_argument("--recipe", default="recipes/cpu-smollm2.yaml",
                        help="--soak: the recipe or build folder served "
                        "(--backend recipe)")
    parser.add_argument("--method", default=None,
                        help="--soak: `trtspec serve --method` [default: the recipe's "
                        "first]")
    parser.add_argument("--seed", type=int, default=0, help="--soak: seeds its requests and drops")
    args = parser.parse_args()
    if args.soak:
        sys.exit(soak(args))
    torch.manual_seed(0)
    lm = load("smollm2-135m-instruct", device="cpu")
    requests = per_category(builtin(), 1 if args.quick else 2, seed=0)[: 4 if args.quick else 16]
    max_tokens = 8 if args.quick else 48
    prompts = [encode(lm.tokenizer, r.chat()) for r in requests]
    params = [SamplingParams(temperature=0.0, max_tokens=max_tokens, seed=i)
              for i in range(len(prompts))]
    kind = "eager" if args.quick else "compiled"
    t0 = time.perf_counter()
    runner = timed(built_runner(lm.model, kind, rows=SLOTS, eos_token_id=lm.tokenizer.eos_token_id,
                                cache_dir=Path(tempfile.mkdtemp(prefix="bench-inductor-"))))
    compile_s = time.perf_counter() - t0
    rows = {(m, c): cell(runner, prompts, params, m, c) for m in ("plain", "ngram")
            for c in (1, 4, 8)}
    hf = hf_reference(lm, prompts, max_tokens)
    lines = [
        "# Serving scheduler under load (CPU)", "",
        f"SmolLM2-135M-Instruct, float32, greedy, {len(prompts)} built-in prompts (2 per "
        f"category), {max_tokens} output tokens each, {SLOTS} slots, closed-loop clients, "
        f"the {kind} runner (made and warmed up in {compile_s:.0f} s); "
        f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads. "
        "One run; absolute times on a shared machine are noisy, ratios less so.", "",
        "| policy | clients | tokens/s | × plain, same clients | TTFT p50 / p99 ms | "
        "TPOT p50 / p99 ms | AL | outside forwards |",
        "|---|---:|---:|---:|---|---|---:|---:|"]
    for (method, clients), r in rows.items():
        ratio = r["tok_s"] / rows[("plain", clients)]["tok_s"]
        lines.append(f"| {method} | {clients} | {r['tok_s']:.1f} | {ratio:.2f}× | "
                     f"{r['ttft50']:.0f} / {r['ttft99']:.0f} | {r['tpot50']:.1f} / "
                     f"{r['tpot99']:.1f} | {r['al']:.2f} | {100 * r['overhead']:.1f} % |")
    lines += ["", f"HF `generate` (greedy, one request at a time, same prompts): {hf:.1f} "
                  f"tokens/s; trtspec plain at 1 client is "
                  f"{rows[('plain', 1)]['tok_s'] / hf:.2f}× that.", "",
              "*outside forwards* = 1 − (seconds in target and draft forwards) / wall time: "
              "the scheduler, sampling, verification, n-gram lookup and Python around them (the "
              "runner's own input and mask building counts as forward time). In process, on "
              "the scheduler `trtspec serve` runs: HTTP and SSE are not in it.",
              "Command: `.venv/bin/python benchmarks/bench_serve.py`", ""]
    write_report(args.out, "\n".join(lines), soak_section=False)
    print("\n".join(lines))
    median = statistics.median(r["tpot50"] for r in rows.values())
    print(f"wrote {args.out}  (median TPOT p50 {median:.1f} ms)")


if __name__ == "__main__":
    main()
