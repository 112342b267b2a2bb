"""What a prompt's chunk adds to a step by where in the prompt it is: the measurement behind the
compiled runner's ``attention_context`` (and so behind the scheduler's priced chunks).

SmolLM2-135M-Instruct on the compiled runner, 8 slots: three rows at 32 tokens decode one token
each (a round), and a fourth row holds a prompt prefilled to ``--positions``; at each, a round
alone and a round with a chunk of 8 and of 16 of the prompt's next tokens in the same call
(``score_pair``, as the scheduler rides it) are timed, each call rolled back, the median of
``--calls`` calls, ``--repeats`` passes (the median over them). A token's cost is taken as
linear in its position, a + b·p (least squares over the 16-token chunk's per-token cost), so
a / b is the context at which its attention costs what its projections do; over the FLOP
parity (the runner's attention_context at a rate of 1) it is the rate attention runs at
against the GEMMs, ATTENTION_RATE's "cpu". Writes the "## Chunk cost by position" section of
``--out``.

    .venv/bin/python benchmarks/bench_chunk_cost.py
"""

from __future__ import annotations

import argparse
import platform
import shlex
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
from bench_serve import replace_section, smollm2_runner  # same folder

from trtspec.eval.workloads import builtin
from trtspec.runtime import compiled
from trtspec.runtime.models import encode

TITLE = "## Chunk cost by position"


def beside_streams(tokens: int):
    """SmolLM2 on the compiled runner, 8 slots: three rows at 32 tokens and a prompt of
    ``tokens`` (built-in prompts repeated) in row 3, its first 16 in. Returns (the runner's
    kind, the runner, the prompt, the rows' lengths now)."""
    lm, kind, runner = smollm2_runner(False)
    ids = [t for r in builtin() for t in encode(lm.tokenizer, r.chat())]
    prompt = (ids * (1 + tokens // len(ids)))[:tokens]
    streams = [[1 + i, 2, 3, 4, 5, 6, 7, 8] * 4 for i in range(3)]
    runner.prefill(streams + [prompt[:16]] + [[1]] * 4)
    return kind, runner, prompt, runner.lengths()


def prompt_up_to(runner, prompt: list[int], done: int, upto: int, step: int) -> int:
    """Row 3 fed the prompt from ``done`` to ``upto``, ``step`` tokens a call; returns where
    it is now."""
    while done < upto:
        n = min(step, upto - done)
        feed: list[list[int]] = [[] for _ in range(8)]
        feed[3] = prompt[done: done + n]
        runner.score(feed, last_only=True)
        done += n
    return done


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--positions", type=int, nargs="+", default=[64, 500, 1000, 1500, 1900])
    parser.add_argument("--calls", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("reports/bench-serve.md"))
    args = parser.parse_args()
    kind, runner, prompt, start = beside_streams(max(args.positions) + 16)
    rnd = [[5]] * 3 + [[]] * 5

    def timed(call, at: list[int]) -> float:
        times = []
        for _ in range(args.calls):
            runner.rollback(at)
            began = time.perf_counter()
            call()
            times.append(time.perf_counter() - began)
        runner.rollback(at)
        return statistics.median(times[2:]) * 1e3

    ms: dict[tuple[int, int], list[float]] = {}
    with torch.inference_mode():
        for _ in range(args.repeats):
            runner.rollback(start)
            done = 16
            for p in sorted(args.positions):
                done = prompt_up_to(runner, prompt, done, p, 16)
                at = runner.lengths()
                for k in (0, 8, 16):
                    chunk = prompt[p: p + k]
                    call = (lambda: runner.score(rnd)) if k == 0 else \
                        (lambda c=chunk: runner.score_pair(rnd, 3, c))
                    ms.setdefault((p, k), []).append(timed(call, at))
    rows = {p: {k: statistics.median(ms[(p, k)]) for k in (0, 8, 16)} for p in args.positions}
    per_token = {p: (r[16] - r[0]) / 16 for p, r in rows.items()}
    b, a = np.polyfit(list(per_token), list(per_token.values()), 1)
    fitted = a / b if b > 0 else float("inf")
    parity = runner.attention_context / compiled.ATTENTION_RATE["cpu"] \
        if runner.attention_context else float("nan")
    lines = [TITLE, "",
             f"SmolLM2-135M-Instruct on the {kind} runner, 8 slots; "
             f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} "
             f"threads. A round of three rows at 32 tokens, alone and with a chunk of 8 or 16 "
             f"of a prompt's next tokens in the same call, the prompt at each position; the "
             f"median of {args.calls} calls (each rolled back), the median of {args.repeats} "
             "passes. *+k*: what the chunk of k added to the round.", "",
             "| prompt at | round | +8 | +16 | +16 a token |", "|---:|---:|---:|---:|---:|"]
    for p, r in rows.items():
        lines.append(f"| {p} | {r[0]:.1f} ms | {r[8] - r[0]:.1f} ms | {r[16] - r[0]:.1f} ms | "
                     f"{per_token[p]:.2f} ms |")
    lines += ["", f"A token's cost fitted as a + b·p: a = {a:.2f} ms, b = {b * 1e3:.2f} µs a "
              f"key; a / b = {fitted:.0f} keys, where its attention costs what its "
              f"projections do, against the FLOP parity of {parity:.0f}: a rate of "
              f"{fitted / parity:.2f} (ATTENTION_RATE's cpu: {compiled.ATTENTION_RATE['cpu']}).",
              "", "Command: `.venv/bin/python benchmarks/bench_chunk_cost.py " +
              shlex.join(sys.argv[1:]) + "`", ""]
    replace_section(args.out, TITLE, "\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
