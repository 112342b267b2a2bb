"""The admission gap with a prompt's chunk in the round's own call (the compiled runner's
``score_pair``) against the chunk in a call of its own, side by side in one run; with
``--compare pricing``, chunks priced by their position (the scheduler's default on a runner
with an attention_context: its module docstring, "chunk") against ``--chunks`` tokens
wherever they are, both riding in the round's call.

SmolLM2-135M-Instruct on the compiled runner, 8 slots, plain greedy decoding: three streams
decode, then a 2,000-token prompt arrives and is admitted ``--chunks`` tokens a step
(bench_serve's ``admission_gaps``). Each chunk size runs paired and with two calls
alternately, ``--repeats`` times (drift on a shared machine falls on both alike), after one
warm pass of each. *gap ×*: the streams' largest inter-token gap from the prompt's arrival
to its first token over their median gap before it (the issue's target: ≤ 3×); *p95 ×*:
the 95th percentile of those gaps over the same median; the control floor: the largest of
as many gaps with no prompt arriving, over its median (the machine's noise alone). Writes
the "## Admission: the chunk in the round's call" section of ``--out``.

    .venv/bin/python benchmarks/bench_admission_pairing.py
"""

from __future__ import annotations

import argparse
import platform
import shlex
import sys
from pathlib import Path

import torch
from bench_serve import WHOLE, admission_gaps, replace_section, smollm2_runner  # same folder

from trtspec.eval.workloads import builtin
from trtspec.runtime.models import encode

TITLE = "## Admission: the chunk in the round's call"
PRICING = "## Admission: a chunk priced by its context"
ARMS = {"pairing": ("paired", "two calls"), "pricing": ("priced", "fixed")}


def paired(runner, on: bool) -> None:
    """Let the scheduler score chunks in the round's call (the runner's own score_pair), or
    not (a runner without one: the chunk's call, then the round's)."""
    if on:
        runner.__dict__.pop("score_pair", None)
    else:
        runner.score_pair = None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--chunks", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--stall", type=float, default=None,
                        help="pace the chunks (the scheduler's prefill_stall), at most --chunks;"
                             " a paced scheduler does not pair: both arms run two calls")
    parser.add_argument("--compare", choices=sorted(ARMS), default="pairing",
                        help="the two arms: paired against two calls, or priced chunks "
                             "against fixed ones (both paired)")
    parser.add_argument("--fixed", type=int, default=None,
                        help="with --compare pricing, the tokens a step of the fixed arm "
                             "[default: the priced arm's --chunks]")
    parser.add_argument("--out", type=Path, default=Path("reports/bench-serve.md"))
    args = parser.parse_args()
    pricing = args.compare == "pricing"
    if args.fixed is not None and not pricing:
        parser.error("--fixed is for --compare pricing")
    names = ARMS[args.compare]

    def gaps(c: int, on: bool, **kw) -> dict:
        """One admission, arm ``on`` (the first of ``names``) or the other."""
        paired(runner, on or pricing)
        if pricing and not on and args.fixed is not None:
            c = args.fixed
        return admission_gaps(runner, prompt, c, args.stall, priced=on or not pricing, **kw)

    lm, kind, runner = smollm2_runner(False)
    ids = [t for r in builtin() for t in encode(lm.tokenizer, r.chat())]
    prompt = (ids * (1 + 2000 // len(ids)))[:2000]
    for c in args.chunks:  # warm: every graph, span and cache size a measured run needs
        for on in (True, False):
            gaps(c, on)
    runs: dict[tuple[int, bool], list[dict]] = {}
    for _ in range(args.repeats):
        for c in args.chunks:
            for on in (True, False):
                g = gaps(c, on)
                runs.setdefault((c, on), []).append(g)
                print(f"chunk {c} {names[0] if on else names[1]}: "
                      f"{g['max'] / g['median']:.2f}× (p95 {g['p95'] / g['median']:.2f}×), "
                      f"TTFT {g['ttft']:.1f} s, median gap {g['median'] * 1e3:.0f} ms",
                      flush=True)
    paired(runner, True)
    control = admission_gaps(runner, None, WHOLE,
                             window=max(g["ttft"] for gs in runs.values() for g in gs))

    def floor(n: int) -> float:
        return max(g for _, g in control["gaps"][:n]) / control["median"]

    title = (PRICING if pricing else TITLE) + \
        ("" if args.fixed is None else f", against {args.fixed} tokens a step") + \
        ("" if args.stall is None else f", paced to {args.stall:g}× a round")
    arms = (f"*priced*: a chunk's tokens priced by their position (the scheduler's default "
            f"here: a token at position p counts 1 + p/{runner.attention_context:.0f} of the "
            "tokens a step, the runner's attention_context; at least a quarter of them), "
            "*fixed*: " + (f"{args.fixed} tokens a step" if args.fixed else "that many "
                           "tokens a step") + " wherever they are; both ride in the round's "
            "call" if pricing else
            "*paired*: its chunk scored in the round's own call (`score_pair`, the "
            "scheduler's default where the runner has it), *two calls*: the chunk's call, "
            "then the round's")
    lines = [title, "",
             f"SmolLM2-135M-Instruct on the {kind} runner, 8 slots, plain greedy; "
             f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} "
             f"threads. Three streams decode, a 2,000-token prompt arrives; {arms}. "
             f"Each cell: {args.repeats} runs, alternating {names[0]} and {names[1]}; *gap ×* "
             "the streams' largest gap during the admission over their median before it, "
             "per run; *p95 ×* the 95th percentile; *median gaps* the streams' median gap "
             f"before the prompt arrived, per run ({names[0]} / {names[1]}); *floor* the "
             "control's largest of as "
             "many gaps with no prompt (noise alone)." +
             ("" if args.stall is None else f" Paced (`--prefill-stall {args.stall:g}`): the "
              "chunk learnt so that what it adds to a step aims at that many rounds, at most "
              "the tokens a step named."), "",
             f"| tokens a step | {names[0]} gap × | {names[1]} gap × | {names[0]} p95 × | "
             f"{names[1]} p95 × | {names[0]} TTFT | {names[1]} TTFT | median gaps | floor |",
             "|---:|---|---|---|---|---:|---:|---|---:|"]

    def cell(gs: list[dict], key: str) -> str:
        return ", ".join(f"{g[key] / g['median']:.1f}×" for g in gs)

    for c in args.chunks:
        a, b = runs[(c, True)], runs[(c, False)]
        lines.append(f"| {c} | {cell(a, 'max')} | {cell(b, 'max')} | {cell(a, 'p95')} | "
                     f"{cell(b, 'p95')} | {sum(g['ttft'] for g in a) / len(a):.1f} s | "
                     f"{sum(g['ttft'] for g in b) / len(b):.1f} s | "
                     + ", ".join(f"{g['median'] * 1e3:.0f}" for g in a) + " / "
                     + ", ".join(f"{g['median'] * 1e3:.0f}" for g in b) + " ms | "
                     f"{floor(a[0]['n']):.1f}× |")
    lines += ["", "Command: `.venv/bin/python benchmarks/bench_admission_pairing.py " +
              shlex.join(sys.argv[1:]) + "`", ""]
    replace_section(args.out, title, "\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
