"""What a round costs beside one long request, its longest row in a group of its own (the
compiled runner's default where that spares ``SPLIT_KEYS`` keys or more: ``_split``) against
every row attending over the longest row's span (one group), side by side in one run.

SmolLM2-135M-Instruct on the compiled runner, 8 slots: three rows at 32 tokens and a fourth
holding a prompt prefilled to each of ``--positions``; a round feeds all four rows one token
(plain decoding) or four (a verify round of D = 3), the three short rows alone as the floor.
Each call is rolled back; the median of ``--calls`` calls after two warm ones, the arms
alternating call by call, which goes first swapping each time (drift on a shared machine falls
on both alike), ``--repeats`` passes (the median over them). The long row sits on top of the
rows, where a split needs no swap: what a swap costs (once an order change) is not timed.
Writes the "## A round beside a long request" section of ``--out``.

    .venv/bin/python benchmarks/bench_split.py
"""

from __future__ import annotations

import argparse
import platform
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch
from bench_chunk_cost import beside_streams, prompt_up_to  # same folder
from bench_serve import replace_section

TITLE = "## A round beside a long request"
NEVER = 10**12  # split_keys no round reaches: one group always


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--positions", type=int, nargs="+", default=[256, 1000, 2000, 4000])
    parser.add_argument("--widths", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--calls", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("reports/bench-serve.md"))
    args = parser.parse_args()
    kind, runner, prompt, start = beside_streams(max(args.positions))

    default = runner.split_keys
    did: dict[tuple[int, int], bool] = {}  # whether the split arm's call split

    def timed(feed: list[list[int]], at: list[int]) -> dict[str, float]:
        """Median ms of a call per arm (after two warm calls each), the arms alternating,
        which goes first swapping each time."""
        times: dict[str, list[float]] = {"split": [], "one": []}
        for i in range(args.calls + 2):
            for arm in ("split", "one") if i % 2 == 0 else ("one", "split"):
                runner.split_keys = default if arm == "split" else NEVER
                runner.rollback(at)
                began = time.perf_counter()
                runner.score(feed)
                times[arm].append(time.perf_counter() - began)
                if arm == "split":
                    did[(max(at), len(feed[0]))] = runner.last_split
        runner.rollback(at)
        runner.split_keys = default
        return {arm: statistics.median(t[2:]) * 1e3 for arm, t in times.items()}

    ms: dict[tuple[int, int, str], list[float]] = {}
    fired: dict[tuple[int, int], bool] = {}
    with torch.inference_mode():
        for _ in range(args.repeats):
            runner.rollback(start)
            done = 16
            for p in sorted(args.positions):
                done = prompt_up_to(runner, prompt, done, p, 256)
                at = runner.lengths()
                for w in args.widths:
                    short = [[5] * w] * 3 + [[]] * 5
                    alone = timed(short, at)["one"]  # (three rows: nothing to split)
                    ms.setdefault((p, w, "alone"), []).append(alone)
                    for arm, t in timed([[5] * w] * 4 + [[]] * 4, at).items():
                        ms.setdefault((p, w, arm), []).append(t)
                    fired[(p, w)] = did[(max(at), w)]
    med = {key: statistics.median(v) for key, v in ms.items()}
    lines = [TITLE, "",
             f"SmolLM2-135M-Instruct on the {kind} runner, 8 slots; "
             f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} "
             "threads. Three rows at 32 tokens and a fourth at each position; a round feeds "
             "the four rows *width* tokens each (1: plain decoding, 4: a verify round of "
             "D = 3); *split*: the longest row attends in a group of its own (the runner's "
             f"default at {default:,} keys spared or more; *split?* whether it did), *one "
             "group*: every row attends over the longest row's span; *three alone*: the short "
             f"rows' round without the long one. The median of {args.calls} calls after two "
             "warm ones (each rolled back, the arms alternating, which goes first swapping "
             f"each time), the median of {args.repeats} passes; the long row on top of the "
             "rows (no swap timed).", "",
             "| long row at | width | three alone | one group | split | split? | "
             "split / one group |", "|---:|---:|---:|---:|---:|---|---:|"]
    for p in args.positions:
        for w in args.widths:
            one, split = med[(p, w, "one")], med[(p, w, "split")]
            lines.append(f"| {p} | {w} | {med[(p, w, 'alone')]:.1f} ms | {one:.1f} ms | "
                         f"{split:.1f} ms | {'yes' if fired[(p, w)] else 'no'} | "
                         f"{split / one:.2f}× |")
    lines += ["", "Command: `.venv/bin/python benchmarks/bench_split.py " +
              shlex.join(sys.argv[1:]) + "`", ""]
    replace_section(args.out, TITLE, "\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
