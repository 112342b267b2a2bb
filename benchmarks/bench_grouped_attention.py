"""Grouped query heads: the compiled runner's calls with a key/value head's query heads attending
as one head of g·T queries (``decoder_layer.GROUP_HEADS``, the default) against SDPA's own
grouped-query form (``enable_gqa``), on SmolLM2-135M (9 query heads, 3 key/value heads) on this CPU.

Each setting runs in a process of its own (its graphs compiled there), the two alternating,
``--runs`` times each: plain rounds (W = 1) and verify rounds (W = 3) of 1, 4 and 8 rows at
contexts of 100 and 400 slots, and a round of 3 one-token rows with a 4-token chunk of a prompt
at 1,900 slots in the same call (``score_pair``). A cell is the median of 30 calls after 3; the
report gives each run's grouped time over the ungrouped one's from the run beside it, and the
median of those ratios. Writes reports/bench-grouped-attention.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROUNDS = [(1, 1), (4, 1), (8, 1), (1, 3), (4, 3), (8, 3)]  # (rows B, tokens a row W)
CONTEXTS = (100, 400)


def child(grouped: bool, cache_dir: str, calls: int) -> dict[str, float]:
    """Milliseconds a call (medians) with grouping on or off, in this process."""
    import torch

    from trtspec.runtime import decoder_layer
    from trtspec.runtime.kinds import built_runner
    from trtspec.runtime.models import load

    decoder_layer.GROUP_HEADS = grouped
    torch.manual_seed(0)
    lm = load("smollm2-135m-instruct", device="cpu")
    runner = built_runner(lm.model, "compiled", rows=8, eos_token_id=lm.tokenizer.eos_token_id,
                          cache_dir=Path(cache_dir))
    runner.warm_up(8)
    g = torch.Generator().manual_seed(1)

    def median_ms(fn, base) -> float:
        times = []
        for _ in range(calls + 3):
            began = time.perf_counter()
            fn()
            times.append(time.perf_counter() - began)
            runner.rollback(base)
        return statistics.median(times[3:]) * 1e3

    out: dict[str, float] = {}
    for ctx in CONTEXTS:
        runner.prefill([torch.randint(100, 20000, (ctx + 7 * i,), generator=g).tolist()
                        for i in range(8)])
        base = runner.lengths()
        for b, w in ROUNDS:
            feed = [[11] * w] * b + [[]] * (8 - b)
            out[f"round B={b} W={w} at {ctx}"] = median_ms(lambda f=feed: runner.score(f), base)
    runner.prefill([torch.randint(100, 20000, (30,), generator=g).tolist() for _ in range(3)]
                   + [torch.randint(100, 20000, (1900,), generator=g).tolist()] + [[9]] * 4)
    base = runner.lengths()
    streams = [[11], [12], [13]] + [[]] * 5
    out["3 rows + a 4-token chunk at 1,900"] = median_ms(
        lambda: runner.score_pair(streams, 3, list(range(200, 204))), base)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=2, help="processes per setting")
    parser.add_argument("--calls", type=int, default=30, help="timed calls a cell")
    parser.add_argument("--out", type=Path, default=Path("reports/bench-grouped-attention.md"))
    parser.add_argument("--child", choices=["on", "off"], help=argparse.SUPPRESS)
    parser.add_argument("--cache-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child == "on", args.cache_dir, args.calls)))
        return
    cache = tempfile.mkdtemp(prefix="bench-inductor-")
    runs: list[dict[str, dict[str, float]]] = []
    for run in range(args.runs):
        pair = {}
        for setting in ("off", "on") if run % 2 == 0 else ("on", "off"):
            done = subprocess.run([sys.executable, __file__, "--child", setting, "--cache-dir",
                                   cache, "--calls", str(args.calls)], check=True,
                                  capture_output=True, text=True)
            pair[setting] = json.loads(done.stdout.strip().splitlines()[-1])
            print(f"run {run + 1}/{args.runs} grouped {setting}: done", flush=True)
        runs.append(pair)
    cells = list(runs[0]["on"])
    lines = ["# Grouped query heads on the CPU", "",
             "SmolLM2-135M-Instruct, float32, the compiled runner (8 rows), x86_64 "
             "(2 threads here). *grouped / apart*: the median call with a key/value head's "
             "query heads attending as one head of g·T queries over the median call with "
             "SDPA's grouped-query form, per run (the two settings in processes run one after "
             "the other), and the median of those ratios. Under 1: grouped is faster.", "",
             "| call | " + " | ".join(f"run {i + 1}: apart, grouped ms" for i in range(len(runs)))
             + " | grouped / apart |", "|---|" + "---:|" * (len(runs) + 1)]
    for cell in cells:
        ratios = [r["on"][cell] / r["off"][cell] for r in runs]
        lines.append(f"| {cell} | " + " | ".join(
            f"{r['off'][cell]:.1f}, {r['on'][cell]:.1f}" for r in runs)
            + f" | {statistics.median(ratios):.2f} ({', '.join(f'{x:.2f}' for x in ratios)}) |")
    lines += ["", f"Command: `.venv/bin/python benchmarks/bench_grouped_attention.py --runs "
              f"{args.runs}`", ""]
    args.out.write_text("\n".join(lines))
    print("\n".join(lines))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
