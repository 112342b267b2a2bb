"""Speculation under load: which draft length policy pays at 1, 2, 4, 8 (or more) clients.

SmolLM2-135M-Instruct on this CPU, greedy, the built-in workload's copy-heavy and open-ended
categories run separately, through `trtspec serve`'s scheduler (8 slots) on the runner serve
uses by default (the compiled one; eager with ``--quick``). For n-gram and suffix lookup:
plain decoding, fixed D = 2 and 4, the per-request adaptive D (each request's own acceptance
and the one-row cost curve; what trtspec shipped before the round cost), and the batch-aware
adaptive D (one width per round from every running row's acceptance and the round cost
t(B, W), measured here as `trtspec build` measures it). Also TPOT p50, AL and mean D. HF
``generate`` runs the first group's prompts one at a time beside it, as the reference a user
has.

Paired blocks: at c clients a group's prompts run as blocks of 2c (two waves of closed-loop
load; all of them where 2c reaches the group's size), and every arm (plain and each method ×
policy) runs a block before any arm runs the next, in the order of a Williams design
(:func:`arm_order`: no arm always first, last or beside plain). A cell's ratio is exp of the
time-weighted mean over blocks of
log(the arm's tokens/s over plain's on the same block, moments apart), with a 95 % CI over the
blocks (trtspec's own t ∧ bootstrap-t); on this 2-core machine the speed drifts by ±10 %
within a minute, which arms run minutes apart turned into ratios of 0.87–1.14 for one and the
same cell. A pass runs every block once, each arm made anew and warmed; a cell runs passes
until it has ``--min-blocks`` blocks (8), ``--repeats`` times that. ``--aa`` adds a second
plain arm: a check that two identical arms come out alike (its CI should hold 1.00).
``--lookups`` picks the proposers (n-gram, suffix, or both: the default); with one lookup and
one policy a block's two arms run back to back, whose ratio the machine's drift moves least.

Writes reports/bench-serve.md. ``--quick`` runs the open-ended group, 1 prompt a category, 4
tokens, clients 1 and 2,
fixed D = 2 and both adaptive policies, a round cost of 2 rows timed once (a smoke test).
``--mixed-lengths`` draws each prompt's max_tokens (seeded, the same for every arm) instead
of giving all ``--max-tokens`` (:func:`output_lengths` says why).

``--admission`` instead measures admission under the token-budget step (the "## Admission"
section): three plain-decoding streams while a 2,000-token prompt is admitted, their largest
inter-token gap over their median before it arrived, with the prompt prefilled whole (one
call, as before chunked prefill), in chunks of 2, 4, 8, 16, 32 (the CPU default) and 64
tokens a step, and in chunks of at most 32 paced to 1.5 and 1 rounds (``prefill_stall``); and TTFT
p50/p99 when 32 built-in prompts arrive at once on 8 slots, whole, in chunks of 8, 16 and 32,
and paced to 1.5 rounds. A control runs the three streams with no prompt arriving for as
long as the longest admission: each row is shown beside the largest of as many of the
control's gaps, what the machine's noise alone gave.

``--live-rows`` instead measures scoring only the live rows (the "## Live rows" section):
rounds that feed some of the 8 slots while the others hold sequences, with every row in the
slot range scored and with the live rows packed together first, and what the packing swap
costs once.

``--soak`` instead runs `trtspec serve` over HTTP for a long run (see serve_soak.py) and writes
(or replaces) the report's "## Soak" section; ``--soak --quick``: 40 requests on the toy
backend.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import platform
import random
import shlex
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from serve_soak import soak, write_report  # same folder: the --soak run

from trtspec.analysis.stats import MIN_UNITS, mean_log_interval
from trtspec.eval.clients import run_clients
from trtspec.eval.workloads import builtin, per_category
from trtspec.runtime.kinds import built_runner
from trtspec.runtime.models import encode, load
from trtspec.serve.scheduler import Scheduler
from trtspec.serve.server import freeze_heap
from trtspec.spec.adaptive import AdaptiveDraft
from trtspec.spec.cost_curve import measure, measure_rounds
from trtspec.spec.counters import SpecStats
from trtspec.spec.executor import SpecExecutor
from trtspec.spec.propose.ngram import NgramProposer
from trtspec.spec.propose.suffix import SuffixProposer
from trtspec.spec.round_cost import RoundCost
from trtspec.spec.sample.probs import SamplingParams

SLOTS, K = 8, 8
GROUPS = {"copy-heavy": ("summarise", "edit", "answer_from_text", "code_refactor"),
          "open-ended": ("chat", "story", "reasoning", "explain")}
POLICIES = ("D = 2", "D = 4", "adaptive, per request", "adaptive, batch-aware")
LOOKUPS = ("ngram", "suffix")  # the model-free proposers, each run with every policy
AA = "again (A/A)"  # --aa: a second plain arm, the noise floor of the paired design


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def arm(runner, method: str, policy: str, costs: tuple[list[float], RoundCost],
        warm: list[list[int]], warm_tokens: int = 16) -> SpecExecutor:
    """One arm's executor, warmed: ``warm`` (prompts of the group's categories, not the
    measured ones) as one batch, ``warm_tokens`` each, so its chooser's prior has seen the
    category and its clock has timed rounds of that many rows, as a running server's has (a
    cold start's exploration is not what is compared); suffix's global trie then holds their
    outputs, not the measured prompts'."""
    proposer = None if method == "plain" else NgramProposer(1, 3) if method == "ngram" \
        else SuffixProposer()
    curve, rounds = costs
    if policy.startswith("adaptive"):
        batch = "batch" in policy  # timed, as serve's chooser from a build's costs is
        chooser = AdaptiveDraft(K, curve, 0.0, round_cost=rounds if batch else None, timed=batch)
        executor = SpecExecutor(runner, proposer, K, adaptive=chooser)
    else:  # fixed D scored at the widths the round cost says are cheapest, as serve does
        d = 0 if proposer is None else int(policy.removeprefix("D = "))
        executor = SpecExecutor(runner, proposer, d, round_cost=rounds)
    executor.generate(warm, [SamplingParams(temperature=0.0, max_tokens=warm_tokens, seed=i)
                             for i in range(len(warm))])
    return executor


def block(executor: SpecExecutor, prompts, params, clients: int) -> dict:
    """``prompts`` through a fresh scheduler with ``clients`` closed-loop clients: output
    tokens, the wall time the load ran, each request's TPOT and the merged counters."""
    start = time.perf_counter()
    sent, _ = run_clients(executor, prompts, params, clients, SLOTS)
    wall = time.perf_counter() - start
    tpot = [(s.token_times[-1] - s.token_times[0]) / (len(s.token_times) - 1)
            for s in sent if len(s.token_times) > 1]
    return {"tokens": sum(len(s.ticket.token_ids) for s in sent), "wall": wall, "tpot": tpot,
            "stats": SpecStats.merge(s.ticket.stats for s in sent)}


def output_lengths(n: int, max_tokens: int, mixed: bool) -> list[int]:
    """Each prompt's max_tokens: all ``max_tokens``, or (``mixed``) drawn uniformly from
    ½–1½ × it, seeded. All alike, the requests of a block end together under plain decoding
    and the next ones are admitted with nothing decoding (whole prompts, full rounds), a
    schedule speculation breaks as soon as one request gains a token: the two arms then run
    different kinds of schedule, which real traffic (outputs of many lengths) does not give
    plain decoding."""
    if not mixed:
        return [max_tokens] * n
    rng = random.Random(0)
    return [rng.randint(max(1, max_tokens // 2), max_tokens + max_tokens // 2)
            for _ in range(n)]


def blocks_of(n: int, clients: int) -> list[list[int]]:
    """Prompt indices 0 … n − 1 in blocks of min(2·``clients``, n): a block is two waves of
    closed-loop load (the c clients send the next prompt as one finishes), which every arm
    runs in turn. n must be a multiple of the block (:func:`check_clients`)."""
    size = min(2 * clients, n)
    return [list(range(i, i + size)) for i in range(0, n, size)]


def check_clients(n: int, clients: int) -> str | None:
    """Why ``clients`` cannot be measured on n prompts, or None."""
    if clients > n or n % min(2 * clients, n):
        return (f"--clients {clients} on {n} prompts a group: blocks of 2 × clients (or all "
                f"{n}) must divide them (and clients ≤ prompts)")
    return None


def arms_of(lookups: Sequence[str], policies: Sequence[str], aa: bool = False
            ) -> list[tuple[str, str]]:
    """A cell's arms as (method, policy): plain first (every ratio's baseline), then the A/A
    arm (``aa``), then each lookup with each policy. Fewer arms put each block's pair closer
    together: with one lookup and one policy, two arms, back to back."""
    return [("plain", "plain"), *([("plain", AA)] if aa else []),
            *((m, p) for m in lookups for p in policies)]


def arm_order(arms: list, k: int) -> list:
    """The order the arms run a cell's k-th block in: a Williams design, row k mod n of the
    Latin square whose first row is 0, 1, n−1, 2, n−2, … (n arms), its rows reversed in
    turn for an odd n. Over n blocks (2n for an odd n) every arm runs at every position
    equally often, and every arm runs right after every other equally often (balanced over
    whole multiples of those blocks: a cell of 8 blocks with 3 arms is not quite): no arm is
    always first, last or beside plain, and what one arm leaves the next (the cache's size,
    one-off work) falls on each arm alike."""
    n = len(arms)
    first = [0] + [(j + 1) // 2 if j % 2 else n - j // 2 for j in range(1, n)]
    row = [arms[(i + k) % n] for i in first]
    return row[::-1] if n % 2 and (k // n) % 2 else row


def paired(arm_blocks: list[dict], base_blocks: list[dict], threshold: float = 0.97
           ) -> dict[str, float]:
    """An arm's throughput over a baseline's from blocks run moments apart (pairs by index):
    exp(θ), θ = Σ w·log r / Σ w, r a block's tokens/s over the baseline's on the same
    prompts and w the geometric mean of the two arms' wall times on it (time-weighted, so
    ≈ the ratio of the two arms' throughput over all blocks, which an unweighted mean of
    short and long blocks is not; symmetric: a slow block weighs more whichever arm it
    slowed, where plain's time alone would weigh up plain's slow blocks only), its
    95 % CI over the blocks as units (Student's t ∧ bootstrap-t on the ratio
    estimator, :func:`trtspec.analysis.stats.mean_log_interval`; none under MIN_UNITS
    blocks) and the one-sided p of H₀: ratio ≤ ``threshold`` (small: above it shown)."""
    pairs = list(zip(arm_blocks, base_blocks, strict=True))
    w = np.sqrt([a["wall"] * b["wall"] for a, b in pairs])  # both arms' time alike (the
    w = w / w.mean()  # baseline's alone weighs up its own slow blocks only: a bias upward)
    log_r = np.array([math.log(a["tokens"] / a["wall"]) - math.log(b["tokens"] / b["wall"])
                      for a, b in pairs])
    if len(pairs) < MIN_UNITS:
        return {"ratio": math.exp(float(np.sum(w * log_r) / np.sum(w))), "low": math.nan,
                "high": math.nan, "p": math.nan, "blocks": len(pairs)}
    theta, (low, high), _, p_go, _ = mean_log_interval(w * log_r, w, threshold)
    return {"ratio": math.exp(theta), "low": math.exp(low), "high": math.exp(high),
            "p": float(p_go), "blocks": len(pairs)}


def done_once(runner) -> dict[str, int]:
    """One-off work the runner has done so far: all of it (``one_offs``: cache tensors grown
    or shrunk, rows swapped, graphs compiled late: the compiled runner counts them; 0 where
    a runner does not) and the late compiles alone (each a stall of seconds, not ms)."""
    return {"one_offs": getattr(runner, "one_offs", 0),
            "late_compiles": getattr(runner, "late_compiles", 0)}


def summary(blocks: list[dict]) -> dict[str, float]:
    """An arm's blocks together: tokens/s over all of them, TPOT p50 (ms), AL, mean D."""
    stats = SpecStats.merge(b["stats"] for b in blocks).summary()
    tpot = [t for b in blocks for t in b["tpot"]]
    return {"tok_s": sum(b["tokens"] for b in blocks) / sum(b["wall"] for b in blocks),
            "tpot50": percentile(tpot, 50) * 1e3 if tpot else math.nan,
            "al": stats["al_pooled"], "mean_d": stats.get("draft_len_mean", 0.0)}


def ci(r: dict[str, float]) -> str:
    """`` [low–high]`` where a paired ratio has a CI, else nothing."""
    return "" if math.isnan(r["low"]) else f" [{r['low']:.2f}–{r['high']:.2f}]"


def verdict(r: dict[str, float], line: float = 0.97) -> str:
    """Where a paired ratio stands against ``line``: shown above (the 95 % CI's lower end
    ≥ line: one-sided p < 0.025), shown below (its upper end < line), or not resolved by
    its CI; too few blocks for one: the point alone."""
    if math.isnan(r["low"]):
        return "no CI"
    return "≥ line" if r["low"] >= line else "< line" if r["high"] < line else "open"


WHOLE = 8192  # a prefill chunk as big as the step budget: each prompt in one call


def admission_gaps(runner, long_prompt: list[int] | None, chunk: int,
                   stall: float | None = None, streams: int = 3, window: float = 0.0,
                   priced: bool = True) -> dict:
    """``streams`` plain-decoding requests run 24 steps, then ``long_prompt`` arrives and is
    admitted in chunks of ``chunk`` tokens a step (paced to ``stall``, the scheduler's
    prefill_stall; not ``priced``: ``chunk`` tokens wherever they are, not priced by their
    position, the scheduler's prefill_context); after its first token, 8 more steps. With no
    ``long_prompt`` (the
    control: the noise floor), the streams just go on for ``window`` seconds.
    Returns the running streams' median inter-token gap before it arrived, their largest gap
    from its arrival to its first token (its 95th percentile, the largest leaving out the
    steps in which the KV cache's capacity changed), its TTFT (seconds), ``n`` those gaps'
    number and ``gaps``: (when it ended, its length) for each of them in time order, leaving
    out those in which the capacity changed (the control's streams pass its first capacity
    and grow it whole; an admission reserves its room)."""
    scheduler = Scheduler(SpecExecutor(runner, None, 0), SLOTS, prefill_chunk=chunk,
                          prefill_stall=stall)
    if not priced:
        scheduler.prefill_context = None
    arrivals: list[list[float]] = [[] for _ in range(streams)]

    def clock(i: int):
        def on_delta(delta) -> None:  # returns None: no stop string
            if delta.token_ids:
                arrivals[i].append(time.perf_counter())
        return on_delta

    params = SamplingParams(temperature=0.0, max_tokens=2000, ignore_eos=True)
    running = [scheduler.submit([1 + i, 2, 3, 4, 5, 6, 7, 8], params, clock(i))
               for i in range(streams)]
    for _ in range(24):
        scheduler.step()
    sent = time.perf_counter()
    long = None if long_prompt is None else \
        scheduler.submit(long_prompt, params.model_copy(update={"max_tokens": 8}))
    grew: list[tuple[float, float]] = []  # steps in which the KV cache grew (a copy)
    while not long.token_ids if long is not None else time.perf_counter() < sent + window:
        capacity, began = getattr(runner, "_capacity", 0), time.perf_counter()
        scheduler.step()
        if getattr(runner, "_capacity", 0) != capacity:
            grew.append((began, time.perf_counter()))
    first = time.perf_counter()
    for _ in range(8):
        scheduler.step()
    for ticket in [*running, *([long] if long is not None else [])]:
        scheduler.cancel(ticket)
    scheduler.run_until_idle()
    before = [b - a for times in arrivals for a, b in itertools.pairwise(times)
              if b <= sent]
    during = [(a, b) for times in arrivals for a, b in itertools.pairwise(times)
              if b > sent and a < first + 1e-9]
    quiet = [(a, b) for a, b in during  # not across a step that changed the capacity
             if not any(a < g1 and b > g0 for g0, g1 in grew)]
    calm = [b - a for a, b in quiet]
    return {"median": percentile(before, 50), "max": max(b - a for a, b in during),
            "p95": percentile([b - a for a, b in during], 95),
            "calm": max(calm, default=float("nan")), "grew": len(grew), "ttft": first - sent,
            "n": len(during), "gaps": sorted((b, b - a) for a, b in quiet)}


def burst_ttft(runner, prompts: list[list[int]], chunk: int, stall: float | None = None
               ) -> dict[str, float]:
    """Every prompt arrives at once (8 slots, 16 greedy tokens each): TTFT p50 / p99 and the
    wall time until the last one finished (seconds)."""
    scheduler = Scheduler(SpecExecutor(runner, None, 0), SLOTS, prefill_chunk=chunk,
                          prefill_stall=stall)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    firsts: dict[int, float] = {}

    def clock(i: int):
        def on_delta(delta) -> None:  # returns None: no stop string
            if delta.token_ids and i not in firsts:
                firsts[i] = time.perf_counter()
        return on_delta

    start = time.perf_counter()
    for i, p in enumerate(prompts):
        scheduler.submit(p, params, clock(i))
    scheduler.run_until_idle()
    ttft = [firsts[i] - start for i in range(len(prompts))]
    return {"p50": percentile(ttft, 50), "p99": percentile(ttft, 99),
            "wall": time.perf_counter() - start}


def smollm2_runner(quick: bool):
    """(SmolLM2, the runner kind, its runner on SLOTS rows): eager with ``--quick``, else the
    compiled runner serve uses, compiling into a fresh inductor cache; then the heap frozen
    (``freeze_heap``) at the point ``trtspec serve`` freezes it: after the runner's own
    warm-up, before a bench's warm-up runs (graphs compiled there stay in the collector's
    view, as a server's late ones would)."""
    torch.manual_seed(0)
    lm = load("smollm2-135m-instruct", device="cpu")
    kind = "eager" if quick else "compiled"
    runner = built_runner(lm.model, kind, rows=SLOTS, eos_token_id=lm.tokenizer.eos_token_id,
                          cache_dir=Path(tempfile.mkdtemp(prefix="bench-inductor-")))
    freeze_heap()  # where `trtspec serve` does: after the runner's warm-up
    return lm, kind, runner


def admission_report(args) -> None:
    """The "## Admission" section (module docstring, ``--admission``)."""
    lm, kind, runner = smollm2_runner(args.quick)
    ids = [t for r in builtin() for t in encode(lm.tokenizer, r.chat())]
    length = 200 if args.quick else 2000
    long_prompt = (ids * (1 + length // len(ids)))[:length]
    chunks = [(WHOLE, None), (16, None), (16, 2.0)] if args.quick else \
        [(WHOLE, None), (2, None), (4, None), (8, None), (16, None), (32, None), (64, None),
         (32, 1.5), (32, 1.0)]
    for c, stall in chunks:  # warm: every graph, span and cache size a measured run needs
        admission_gaps(runner, long_prompt, c, stall)
    gaps = {(c, stall): admission_gaps(runner, long_prompt, c, stall) for c, stall in chunks}
    control = admission_gaps(runner, None, WHOLE, window=max(g["ttft"] for g in gaps.values()))

    def floor(n: int) -> float:
        """The control's largest of its first ``n`` gaps (a row's count), over its median:
        what the machine's noise alone gives over as many gaps (the control runs for the
        longest admission's time, at a round a gap: it has at least as many as any row)."""
        return max(g for _, g in control["gaps"][:n]) / control["median"]

    for (c, stall), g in gaps.items():
        print(f"admission chunk={c} stall={stall}: max gap {g['max'] * 1e3:.0f} ms, median "
              f"{g['median'] * 1e3:.0f} ms ({g['max'] / g['median']:.1f}×; "
              f"{g['calm'] / g['median']:.1f}× without {g['grew']} growths; no prompt over "
              f"as many: {floor(g['n']):.1f}×), TTFT {g['ttft']:.2f} s", flush=True)
    burst_prompts = [encode(lm.tokenizer, r.chat())
                     for r in per_category(builtin(), 1 if args.quick else 4, seed=0)]
    burst_ttft(runner, burst_prompts[:SLOTS], 16)  # warm
    bursts = {(c, stall): burst_ttft(runner, burst_prompts, c, stall) for c, stall in (
        [(WHOLE, None), (16, None), (16, 2.0)] if args.quick else
        [(WHOLE, None), (8, None), (16, None), (32, None), (32, 1.5)])}
    for (c, stall), b in bursts.items():
        print(f"burst chunk={c} stall={stall}: TTFT p50 {b['p50']:.2f} s p99 {b['p99']:.2f} s, "
              f"wall {b['wall']:.1f} s", flush=True)

    def name(c: int, stall: float | None) -> str:
        return "whole (one call; before chunked prefill)" if c == WHOLE else \
            f"{c} tokens a step" + (f", paced to {stall:g}× a round" if stall else "")

    lines = [
        "## Admission", "",
        f"SmolLM2-135M-Instruct on the {kind} runner, {SLOTS} slots, plain decoding, greedy; "
        f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads. "
        f"Three streams decode, then a {len(long_prompt)}-token prompt arrives; *N tokens "
        "a step*: the chunk at the prompt's start, "
        + ("priced by position further in (the scheduler's default on this runner: a "
           f"token at p counts 1 + p/{runner.attention_context:.0f}, at least a quarter of "
           "the chunk)" if getattr(runner, "attention_context", None) else "wherever it is")
        + ". *gap ×*: "
        "the streams' largest inter-token gap from its arrival to its first token, over "
        "their median gap before it arrived (target ≤ 3×); *without growth*: the same, "
        "leaving out the steps in which the KV cache's capacity changed (its growth to the "
        "prompt's size is spread over the admitting steps, a few tensors a call: the step "
        "counted is the one that completes it); *p95 gap ×*: the 95th percentile "
        "of those gaps over the median; TTFT is the long prompt's. *paced to X× a round*: "
        "`--prefill-stall X`, the chunk (at most the one named) learnt so that a step's "
        "prompt call aims at X times its round. *no prompt, as many*: the control, the "
        "same three streams with no prompt arriving, run once after the rows for the "
        "longest TTFT: the largest of its first as many gaps as the row counted, over its "
        "median gap, what the machine's noise alone gives over that many gaps (one run, so "
        "the rows' floors are prefixes of one another; leaving out the step in which its "
        "streams grew the cache past its first capacity). One run a row.", "",
        "| prefill | median gap | largest gap | gap × | without growth | p95 gap × | growths "
        "| TTFT | no prompt, as many |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for (c, stall), g in gaps.items():
        lines.append(f"| {name(c, stall)} | {g['median'] * 1e3:.0f} ms | "
                     f"{g['max'] * 1e3:.0f} ms | {g['max'] / g['median']:.1f}× | "
                     + (f"{g['calm'] / g['median']:.1f}×" if g['calm'] == g['calm'] else "—")
                     + f" | {g['p95'] / g['median']:.1f}× | "
                     f"{g['grew']} | {g['ttft']:.2f} s | {floor(g['n']):.1f}× |")
    lines += ["", f"A burst: {len(burst_prompts)} built-in prompts ({min(map(len, burst_prompts))}"
              f"–{max(map(len, burst_prompts))} tokens) arrive at once, 16 tokens each:", "",
              "| prefill | TTFT p50 | TTFT p99 | all done |", "|---|---:|---:|---:|"]
    for (c, stall), b in bursts.items():
        lines.append(f"| {name(c, stall)} | {b['p50']:.2f} s | "
                     f"{b['p99']:.2f} s | {b['wall']:.1f} s |")
    lines += ["", "Command: `.venv/bin/python benchmarks/bench_serve.py " +
              shlex.join(sys.argv[1:]) + "`", ""]
    replace_section(args.out, "## Admission", "\n".join(lines))
    print("\n".join(lines))
    print(f"wrote {args.out}")


def live_rows_timing(runner, prompts: list[list[int]], live: list[int], width: int,
                     repeats: int) -> dict[str, float]:
    """Rounds that feed ``width`` tokens to each of the batch rows ``live`` while every other
    row holds a prompt: median ms with every row in the slot range scored (``pack_rows``
    off) and with only the live rows (on), the call that swapped and the
    swaps it made. Each call is rolled back; the two settings alternate in blocks of
    ``repeats`` (three blocks each), after a prefill that puts the rows back in order, each
    block's first two calls untimed (a set is packed from its second call)."""
    feed = [[(11 * j + 5) % runner.vocab_size for j in range(width)] if b in live else []
            for b in range(len(prompts))]
    times: dict[bool, list[float]] = {False: [], True: []}
    scored: dict[bool, list[int]] = {False: [], True: []}  # rows each timed call scored
    first, swaps = [], []
    for _ in range(3):
        for pack in (False, True):
            runner.prefill(prompts)
            runner.pack_rows, before = pack, runner.swaps
            lengths = runner.lengths()
            for i in range(repeats + 2):  # a set is packed once it recurs: the second call
                start, had = time.perf_counter(), runner.swaps
                runner.score(feed)
                took = (time.perf_counter() - start) * 1e3
                runner.rollback(lengths)
                if runner.swaps != had:
                    first.append(took)
                elif i >= 2:
                    times[pack].append(took)
                    scored[pack].append(runner.last_scored)
            if pack:
                swaps.append(runner.swaps - before)
    runner.pack_rows = True
    return {"spread": percentile(times[False], 50), "packed": percentile(times[True], 50),
            "first": percentile(first, 50) if first else float("nan"), "swaps": max(swaps),
            "rows_spread": percentile(scored[False], 50),
            "rows_packed": percentile(scored[True], 50)}


def live_rows_report(args) -> None:
    """The "## Live rows" section (module docstring, ``--live-rows``)."""
    _, kind, runner = smollm2_runner(args.quick)
    runner.warm_up(SLOTS)
    context = 64 if args.quick else 512
    prompts = [[(7 * i + 3 + b) % runner.vocab_size for i in range(context)]
               for b in range(SLOTS)]
    repeats = 2 if args.quick else 10
    cases = [([0, SLOTS - 1], 1), ([0, SLOTS - 1], 4), ([0, 3, SLOTS - 1], 1),
             (list(range(SLOTS - 1)), 1)]
    results = [(live, width, live_rows_timing(runner, prompts, live, width, repeats))
               for live, width in cases]
    slot = runner.keys[0][0, 0].numel() * runner.keys[0].element_size()  # a row's token, a layer
    swap_mib = 2 * 2 * len(runner.keys) * context * slot / 2**20  # keys and values of 2 rows
    lines = [
        "## Live rows", "",
        f"SmolLM2-135M-Instruct on the {kind} runner, {SLOTS} slots each holding a "
        f"{context}-token sequence; {platform.processor() or platform.machine()}, "
        f"{torch.get_num_threads()} threads. A round feeds W tokens to the live rows only. "
        "*spread*: every row from the first live one to the last is scored, as before "
        "(`pack_rows` off); *packed*: the runner first swaps rows so the live ones are "
        "contiguous, then scores them alone. Median ms of "
        f"{3 * repeats} calls each; *swapping call*: the call that swapped, once (a set of rows "
        "is packed from the second call that feeds it). A swap "
        f"copies two rows' keys and values in every layer ({swap_mib:.1f} MiB for two rows "
        f"of {context} tokens here).", "",
        "| live rows | W | rows scored (spread → packed) | spread | packed | packed ÷ spread "
        "| swapping call (swaps) |", "|---|---:|---|---:|---:|---:|---|"]
    for live, width, r in results:
        lines.append(f"| {', '.join(map(str, live)) if len(live) < 5 else f'0 … {live[-1]}'}"
                     f" of {SLOTS} | {width} | {r['rows_spread']} → {r['rows_packed']} | "
                     f"{r['spread']:.1f} ms | {r['packed']:.1f} ms | "
                     f"{r['packed'] / r['spread']:.2f}× | "
                     + ("—" if r["first"] != r["first"] else f"{r['first']:.1f} ms")
                     + f" ({r['swaps']}) |")
    lines += ["", "The KV cache itself is not smaller: it stays dense, one row per slot at "
              "the power of two above the longest row, shrunk when the rows hold a quarter of "
              "it.", "", "Command: `.venv/bin/python benchmarks/bench_serve.py " +
              shlex.join(sys.argv[1:]) + "`", ""]
    replace_section(args.out, "## Live rows", "\n".join(lines))
    print("\n".join(lines))
    print(f"wrote {args.out}")


def replace_section(path: Path, title: str, text: str) -> None:
    """Put ``text`` (a section starting with ``title``) in the report in place of the one
    there, or before the Soak section, leaving the rest as it was."""
    old = path.read_text() if path.exists() else ""
    if f"\n{title}\n" in f"\n{old}":
        head, _, rest = f"\n{old}".partition(f"\n{title}\n")
        _, nxt, tail = rest.partition("\n## ")
        new = head.strip("\n") + "\n\n" + text.rstrip() + ("\n\n## " + tail if nxt else "")
    elif "\n## Soak\n" in old:
        head, _, tail = old.partition("\n## Soak\n")
        new = head.rstrip() + "\n\n" + text.rstrip() + "\n\n## Soak\n" + tail
    else:
        new = old.rstrip() + "\n\n" + text
    path.write_text(new.strip("\n") + "\n")


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
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--per-category", type=int, default=2,
                        help="prompts per built-in category (4 categories a group)")
    parser.add_argument("--max-tokens", type=int, default=40)
    parser.add_argument("--mixed-lengths", action="store_true",
                        help="each prompt's max_tokens drawn (seeded) from ½–1½ × "
                             "--max-tokens, the same for every arm, instead of all alike")
    parser.add_argument("--repeats", type=int, default=1,
                        help="multiplies the passes of each (group, clients) cell (each pass: "
                        "every arm anew, every block in turn)")
    parser.add_argument("--min-blocks", type=int, default=8,
                        help="paired blocks a cell runs at least (passes are added until it "
                        f"has them; a CI needs ≥ {MIN_UNITS})")
    parser.add_argument("--aa", action="store_true",
                        help="also run a second plain arm (A/A): the design's noise floor")
    parser.add_argument("--policies", nargs="+", choices=POLICIES, default=list(POLICIES),
                        help="the speculative policies to run (plain always runs)")
    parser.add_argument("--groups", nargs="+", choices=list(GROUPS), default=list(GROUPS),
                        help="which category groups to run")
    parser.add_argument("--lookups", nargs="+", choices=LOOKUPS, default=list(LOOKUPS),
                        help="the lookup proposers to run with each policy (plain always "
                        "runs): one lookup with one policy (and no --aa) gives two arms a "
                        "block, so each block's pair runs back to back")
    parser.add_argument("--admission", action="store_true",
                        help="instead, the admission section (module docstring)")
    parser.add_argument("--live-rows", action="store_true",
                        help="instead, the live-rows section (module docstring)")
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
    if args.repeats < 1 or args.min_blocks < 1:
        parser.error(f"--repeats and --min-blocks must be ≥ 1, got {args.repeats} and "
                     f"{args.min_blocks}")
    if args.soak:
        sys.exit(soak(args))
    if args.admission:
        return admission_report(args)
    if args.live_rows:
        return live_rows_report(args)
    torch.manual_seed(0)
    lm = load("smollm2-135m-instruct", device="cpu")
    n, max_tokens = (1, 4) if args.quick else (args.per_category, args.max_tokens)
    groups = ["open-ended"] if args.quick else args.groups
    everything = builtin()
    workload = per_category(everything, n, seed=0)
    sets = {g: [encode(lm.tokenizer, r.chat()) for r in workload if r.category in cats]
            for g, cats in GROUPS.items() if g in groups}
    # each cell's warm-up: up to a batch of the group's prompts not measured, its categories
    # in turn (else two measured ones: the report says so)
    measured_ids = {r.id for r in workload}
    left = {c: [r for r in everything if r.category == c and r.id not in measured_ids]
            for cats in GROUPS.values() for c in cats}
    spare = {g: [r for turn in itertools.zip_longest(*(left[c] for c in GROUPS[g]))
                 for r in turn if r is not None][:SLOTS] for g in sets}
    warmups = {g: [encode(lm.tokenizer, r.chat()) for r in spare[g]] or sets[g][:2]
               for g in sets}
    clients_list = (1, 2) if args.quick else tuple(args.clients)
    for prompts in sets.values():
        for clients in clients_list:
            if (why := check_clients(len(prompts), clients)) is not None:
                parser.error(why)
    warm_tokens = 2 if args.quick else 16
    lengths = output_lengths(64, max_tokens, args.mixed_lengths)
    params = [SamplingParams(temperature=0.0, max_tokens=m, seed=i)
              for i, m in enumerate(lengths)]
    kind = "eager" if args.quick else "compiled"
    t0 = time.perf_counter()
    runner = built_runner(lm.model, kind, rows=SLOTS, eos_token_id=lm.tokenizer.eos_token_id,
                          cache_dir=Path(tempfile.mkdtemp(prefix="bench-inductor-")))
    runner.warm_up(SLOTS)
    compile_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    curve = measure(runner, K + 1).relative("ngram")[0]
    measured = measure_rounds(runner, 2, K + 1, 16, 0, 1) if args.quick else \
        measure_rounds(runner, SLOTS, K + 1, 128)
    rounds = RoundCost(measured)
    cost_s = time.perf_counter() - t0
    frozen, _ = freeze_heap()  # where `trtspec serve` does: after the runner's warm-up
    policies = POLICIES[:1] + POLICIES[-2:] if args.quick else tuple(args.policies)
    min_blocks = 2 if args.quick else args.min_blocks
    args.lookups = list(dict.fromkeys(args.lookups))  # once each: the arms and the tables
    arms = arms_of(args.lookups, list(dict.fromkeys(policies)), args.aa)
    blocks: dict[tuple[str, int, str, str], list[dict]] = {}
    passes_at: dict[tuple[str, int], int] = {}
    ran: list[dict] = []  # every block as it ran: the .json beside the report
    began = time.perf_counter()
    for group, prompts in sets.items():
        # unmeasured: the group's shapes and cache sizes (its longest prompts), compiled and
        # grown once, so the first measured block does not pay for them
        block(arm(runner, "plain", "plain", (curve, rounds), warmups[group], warm_tokens),
              prompts, params[: len(prompts)], max(clients_list))
        for clients in clients_list:
            parts = blocks_of(len(prompts), clients)
            passes = args.repeats * math.ceil(min_blocks / len(parts))
            passes_at[group, clients] = passes
            # unmeasured: every arm runs a block at this load, so what only it makes (the
            # shapes of a row alone at 1 client and of its drafts' widths, the cache at its
            # contexts) is there before any arm is timed: the arms share one runner, so the
            # first arm to need a shape would pay for it (in a run without this block, the
            # first arm on a block at 1 client took 2.2× its pair's time; with it run plain
            # only, the first speculative arm at 4 clients took 1.9× plain's)
            for a in arms:
                block(arm(runner, *a, (curve, rounds), warmups[group], warm_tokens),
                      [prompts[i] for i in parts[0]], [params[i] for i in parts[0]], clients)
            k = 0  # the cell's blocks so far: arm_order's turn
            for run in range(passes):  # each pass: every arm made anew and warmed, so
                executors = {a: arm(runner, *a, (curve, rounds), warmups[group], warm_tokens)
                             for a in arms}  # suffix's trie never holds a prompt's output
                for j, idx in enumerate(parts):  # from an earlier pass (within a pass: the
                    for position, a in enumerate(arm_order(arms, k)):  # pass's earlier blocks')
                        start, one_offs = time.perf_counter() - began, done_once(runner)
                        r = block(executors[a], [prompts[i] for i in idx],
                                  [params[i] for i in idx], clients)
                        blocks.setdefault((group, clients, *a), []).append(r)
                        counters = r["stats"].summary()
                        ran.append({"group": group, "clients": clients, "method": a[0],
                                    "policy": a[1], "pass": run, "block": j,
                                    "position": position, "start_s": round(start, 3),
                                    "tokens": r["tokens"], "wall_s": r["wall"],
                                    **{key: n - one_offs[key]
                                       for key, n in done_once(runner).items()},
                                    "tpot_ms": [round(t * 1e3, 3) for t in r["tpot"]],
                                    "al": counters["al_pooled"],
                                    "mean_d": counters.get("draft_len_mean", 0.0)})
                    k += 1
                done = {a: summary(blocks[(group, clients, *a)][-len(parts):])["tok_s"]
                        for a in arms}
                print(f"{group} c={clients} pass {run + 1}/{passes} "
                      f"({time.perf_counter() - began:.0f} s): " + ", ".join(
                          f"{' '.join(a)} {tok_s:.1f}" for a, tok_s in done.items())
                      + " tok/s", flush=True)
                args.out.with_suffix(".json").write_text(json.dumps(ran))  # what is measured
                # is kept, block by block
    rows = {key: summary(bs) for key, bs in blocks.items()}
    versus = {(g, c, m, pol): paired(blocks[g, c, m, pol], blocks[g, c, "plain", "plain"])
              for g, c, m, pol in blocks if (m, pol) != ("plain", "plain")}
    first = next(iter(sets))
    hf = hf_reference(lm, sets[first], max_tokens)
    table = "\n".join(f"| {b} | " + " ".join(f"{ms / measured[1][1]:.2f}" for ms in ws.values())
                      + " |" for b, ws in measured.items())
    lines = [
        "# Speculation under load (CPU): plain vs fixed D vs adaptive D", "",
        f"SmolLM2-135M-Instruct, float32, greedy, the built-in workload ({n} prompts a "
        "category: " + ", ".join(f"{len(p)} {g}" for g, p in sets.items()) + ", run "
        "separately), "
        + (f"at most {max_tokens // 2}–{max_tokens + max_tokens // 2} output tokens (each "
           "prompt's drawn once, seeded, the same for every arm)" if args.mixed_lengths else
           f"{max_tokens} output tokens each")
        + f", {SLOTS} slots, "
        f"closed-loop clients in paired blocks (below), the {kind} runner (made and warmed "
        f"up in {compile_s:.0f} s; "
        f"cost curve and round cost measured in {cost_s:.0f} s; then {frozen:,} objects "
        "frozen out of the garbage collector's passes, as `trtspec serve` does); "
        f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads. "
        "**Paired blocks**: at c clients a group's prompts run as blocks of 2c (all of them "
        "where 2c reaches the group's size), each through a fresh scheduler by c closed-loop "
        "clients (the next prompt sent as one finishes; the block drains at its end, for "
        "every arm alike), and every arm runs a block before the next block starts, in the "
        "order of a Williams design (every arm at every position, and right after every "
        "other, equally often over its cycle of n orders, 2n for an odd n; a cell's blocks "
        "may cut the cycle), so two arms' runs of a block are seconds apart and a drift of "
        "the machine's speed (on this one, ±10 % within a minute) moves them alike; each cell "
        "first runs one block with every arm, unmeasured, at its load. A pass "
        "runs every block; each pass starts every arm anew: its executor first generates "
        f"{warm_tokens} tokens for a batch of prompts of the group's categories that are not "
        "measured (" + ", ".join(
            f"{len(spare[g])} {g}" if spare[g] else f"{g}: none left, 2 measured ones"
            for g in sets) + "): its adaptive prior and round clock then hold what a running "
        "server's would, not a cold start's guess, and suffix's global trie holds other "
        "requests' outputs" + ("" if all(spare.values()) else
                                " (the measured ones' where none were left)") + " (within a "
        "pass, also those of the pass's earlier blocks: other prompts), never a prompt's "
        f"from an earlier pass. Passes: enough for ≥ {min_blocks} blocks a cell, × "
        f"{args.repeats} (" + ", ".join(
            f"{passes_at[next(iter(sets)), c]} of "
            f"{len(blocks_of(len(next(iter(sets.values()))), c))} blocks at c = {c}"
            for c in clients_list)
        + "). Each group first runs once unmeasured, so its shapes are compiled and the "
        "cache grown. Every block as it ran (pass, position, start, tokens, wall, TPOTs): "
        f"`{args.out.with_suffix('.json').name}`.", "",
        "*× plain* = exp(θ), θ the mean over blocks of log(the arm's output tokens/s over "
        "plain decoding's on the same block), weighted by the two arms' times on the block "
        "(their geometric mean; ≈ the ratio of the two arms' throughput over all blocks); "
        f"[95 % CI] over the blocks as units (Student's t ∧ bootstrap-t; none under "
        f"{MIN_UNITS} blocks); *n* blocks. What the CI covers: the blocks' timing and, where "
        "a cell has several passes, the arms' learning paths, for these prompts "
        "and their greedy outputs (the same prompts recur across passes; another prompt set "
        "is another estimate). plain: output tokens/s over all its blocks. *per request*: "
        "each request's D from its own acceptance and the one-row cost curve; *batch-aware*: "
        "one width per round from every running row's acceptance and the round cost (the "
        f"default of `--draft-len adaptive`). Adaptive D ≤ {K}."
        + (f" *{AA}*: a second plain arm, run and ordered like the others: a check that two "
           "identical arms come out alike here (one draw: a 95 % CI misses 1.00 one time in "
           "20), not a calibration." if args.aa else ""), ""]
    for group in sets:
        lines += [f"## {group}", "", "| method | policy | " + " | ".join(
            f"c = {c}" for c in clients_list) + " |", "|---|---|" + "---:|" * len(clients_list)]
        for method, policy in arms:
            cells = []
            for c in clients_list:
                r = rows[group, c, method, policy]
                if (method, policy) == ("plain", "plain"):
                    cells.append(f"{r['tok_s']:.1f} tok/s")
                    continue
                v = versus[group, c, method, policy]
                cells.append(f"{v['ratio']:.2f}×{ci(v)} (D̄ {r['mean_d']:.1f}, AL "
                             f"{r['al']:.2f}; n {v['blocks']})")
            lines.append(f"| {method} | {policy} | " + " | ".join(cells) + " |")
        lines.append("")
    lines += ["## Against the targets", "",
              "| category | clients | method | batch-aware × plain | vs 0.97 | p (≤ 0.97) | best "
              "fixed D | batch-aware × best fixed | batch-aware × per request |",
              "|---|---:|---|---:|---|---:|---|---:|---:|"]
    for group in sets:
        for c in clients_list:
            for method in args.lookups:
                key = (group, c, method, "adaptive, batch-aware")
                if key not in versus:
                    continue  # --policies without it
                v = versus[key]
                fixed = {p: versus[group, c, method, p]["ratio"] for p in policies
                         if p.startswith("D =")}
                best = max(fixed, key=fixed.__getitem__) if fixed else "plain"
                if fixed.get(best, 0.0) < 1.0:
                    best = "plain"  # the best fixed policy by its ratio to plain
                vs_best = v if best == "plain" else paired(
                    blocks[key], blocks[group, c, method, best], threshold=0.95)
                per = blocks.get((group, c, method, "adaptive, per request"))
                vs_per = "—" if per is None else f"{paired(blocks[key], per)['ratio']:.2f}×"
                p = "—" if v["p"] != v["p"] else f"{v['p']:.3f}"
                lines.append(f"| {group} | {c} | {method} | {v['ratio']:.2f}×{ci(v)} | "
                             f"{verdict(v)} | {p} | {best} | {vs_best['ratio']:.2f}× | "
                             f"{vs_per} |")
    lines += ["", "*vs 0.97*: ≥ line where the CI's lower end is ≥ 0.97 (shown to meet it: "
              "one-sided p < 0.025), < line where its upper end is below (shown to miss it), "
              "open where the CI holds 0.97 (not resolved by this many blocks). *p (≤ 0.97)*: "
              "one-sided, of H₀: batch-aware ≤ 0.97× plain, per cell (every cell ≥ line is "
              "an intersection of tests and needs no correction; a count of cells below it "
              "would, Holm's). *best fixed* is the best of plain and the fixed D at that cell "
              "by its ratio, picked on the same blocks it is compared on (which favours it); "
              "*batch-aware × best fixed* and *× per request* are paired over the same blocks. "
              "Targets: batch-aware ≥ 0.97× plain everywhere, ≥ 0.95× the best fixed, and at "
              "one client ≥ the per-request adaptive D.", "",
              "Round cost t(B, W)/t(1, 1) measured here (B rows × W tokens; a round is scored at "
              "the cheapest width ≥ its own where that is ≥ 5 % cheaper):", "",
              f"| B | t(B, W) for W = 1 … {K + 1} |", "|---|---|", table, "",
              f"HF `generate` (greedy, one request at a time, the {first} prompts): {hf:.1f} "
              f"tokens/s; trtspec plain at {clients_list[0]} client(s) on them: "
              f"{rows[first, clients_list[0], 'plain', 'plain']['tok_s']:.1f} tokens/s "
              f"({rows[first, clients_list[0], 'plain', 'plain']['tok_s'] / hf:.2f}×).", "",
              "Command: `.venv/bin/python benchmarks/bench_serve.py " + shlex.join(sys.argv[1:])
              + "`", ""]
    old = args.out.read_text() if args.out.exists() else ""
    kept = {title: old.partition(f"\n{title}\n")[2].partition("\n## ")[0]
            for title in ("## Admission", "## Live rows")}
    write_report(args.out, "\n".join(lines), soak_section=False)
    for title, text in kept.items():  # the --admission and --live-rows sections stay
        if text:
            replace_section(args.out, title, f"{title}\n{text}")
    print("\n".join(lines))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
