"""Are the speedup p-values calibrated where verdicts are taken? The false-GO rate at the boundary
null, for trtspec's p-value and for the percentile bootstrap it replaced, and their power.

A verdict compares ``p_go`` with small levels: Holm's first level over a report's cells, an
early look's spent α. A p-value is calibrated at a level when, at the boundary null (the true
speedup exactly ``min_speedup``), it falls at or below the level at most that often.

Part 1 simulates units directly: G independent units whose log ratios (log baseline / spec
TPOT, the geometric-mean statistic's terms) are log 1.05 plus noise of sd 0.2, for G ∈ {8, 12,
24, 48} and five noises; each cell counts, over ≥ 20,000 simulated evals, how often p_go ≤
each level in {2.5e-4, 1e-3, 2.5e-3, 6e-3, 0.025}. trtspec's p-value is
:func:`trtspec.analysis.stats.mean_log_interval` itself, batched over the simulated evals (Student's
t ∧ bootstrap-t, 20,000 resamples); the percentile bootstrap is the method trtspec used before
(cluster bootstrap of the mean log ratio, replicates widened by √(G/(G − 1)), p = (1 + reps ≤
log m) / (1 + R)), vectorised here and checked against
:func:`trtspec.analysis.stats.percentile_interval` on the first evals of each cell. Power: the same
at a true 1.3×.

Part 2 goes through ``decide``'s own code: seeded synthetic sequential evals
(``until_decided`` + ``decide``) at the boundary null with the demo recipe's settings, and
counts evals with any wrong GO over their 6 cells. ``--compare-with DIR`` runs the same part
with another checkout's trtspec (e.g. a worktree of an earlier commit) for the table's other
column.

Writes reports/bench-calibration.md. ``--quick``: a few hundred evals a cell, 8 and 12 units
(a smoke test).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

LEVELS = (2.5e-4, 1e-3, 2.5e-3, 6e-3, 0.025)
UNITS = (8, 12, 24, 48)
NOISES = ("normal", "t₃", "skewed right", "skewed left", "turns of 4, shared shock")
BEYOND = "skewed left, skewness 1"  # outside the range the method is calibrated for
SD, SKEW_SHAPE, STRONG_SHAPE = 0.2, 16.0, 4.0  # gamma shapes: skewness 2/√k = 0.5 and 1
NULL, ALTERNATIVE = 1.05, 1.3
RESAMPLES = 20000


def simulate(noise: str, g: int, s: int, speedup: float, rng: np.random.Generator
             ) -> tuple[np.ndarray, np.ndarray]:
    """(y [s, g], n [g]): s simulated evals of g units, y a unit's sum of log ratios."""
    theta = math.log(speedup)
    if noise == "turns of 4, shared shock":  # a turn's 4 requests share a shock
        shock, own = 0.75 * SD, SD * math.sqrt(1 - 0.75 ** 2)
        y = 4 * (theta + shock * rng.standard_normal((s, g))) + \
            own * rng.standard_normal((s, g, 4)).sum(-1)
        return y, np.full(g, 4.0)
    if noise == "normal":
        x = rng.standard_normal((s, g))
    elif noise == "t₃":
        x = rng.standard_t(3, (s, g)) / math.sqrt(3)
    else:
        k = STRONG_SHAPE if noise == BEYOND else SKEW_SHAPE
        x = (rng.gamma(k, 1.0, (s, g)) - k) / math.sqrt(k)
        x = -x if "left" in noise else x
    return theta + SD * x, np.ones(g)


def percentile_p(y: np.ndarray, n: np.ndarray, threshold: float, rng: np.random.Generator
                 ) -> np.ndarray:
    """The percentile bootstrap's p_go [s] (module docstring), R = RESAMPLES."""
    s, g = y.shape
    point = y.sum(-1) / n.sum()
    below = np.zeros(s)
    step = max(1, 4_000_000 // (g * s))
    for i in range(0, RESAMPLES, step):
        r = min(step, RESAMPLES - i)
        draws = rng.integers(0, g, size=(r, g)) + g * np.arange(r)[:, None]
        w = np.bincount(draws.ravel(), minlength=r * g).reshape(r, g).astype(float)
        reps = (w @ y.T) / (w @ n)[:, None]  # [r, s] log replicates
        widened = point + (reps - point) * math.sqrt(g / (g - 1))
        below += np.sum(widened <= math.log(threshold), 0)
    return (1 + below) / (1 + RESAMPLES)


def check_vectorised(y: np.ndarray, n: np.ndarray, p_new: np.ndarray, p_old: np.ndarray) -> None:
    """The batched p-values against the product's scalar functions on a few evals."""
    from trtspec.analysis.stats import (
        cluster_replicates,
        geomean_of_ratios,
        percentile_interval,
        speedup_interval,
    )

    for i in range(3):
        units = np.repeat(np.arange(len(n)), n.astype(int))
        logs = np.concatenate([np.full(int(k), v / k) for v, k in zip(y[i], n, strict=True)])
        base, spec = np.exp(logs), np.ones_like(logs)
        new = speedup_interval(base, spec, units, NULL, statistic=geomean_of_ratios,
                               resamples=RESAMPLES, seed=i).p_go
        reps = cluster_replicates(base, spec, units, geomean_of_ratios, RESAMPLES, seed=i)
        old = percentile_interval(float(geomean_of_ratios(base, spec)), reps, len(n),
                                  "request", NULL).p_go
        for got, want in ((p_new[i], new), (p_old[i], old)):  # Monte Carlo: within 5 SE
            tol = 5 * math.sqrt(max(want, 1e-4) / RESAMPLES) + 2 / RESAMPLES
            assert abs(got - want) <= tol, (got, want)


def cell(noise: str, g: int, evals: int, speedup: float, seed: int, old: bool = True
         ) -> dict[str, list[int]]:
    """Counts of p_go ≤ each level over ``evals`` simulated evals, per method."""
    from trtspec.analysis.stats import mean_log_interval

    rng = np.random.default_rng(seed)
    counts = {"trtspec": [0] * len(LEVELS), "percentile bootstrap": [0] * len(LEVELS)}
    chunk = 1000
    for i in range(0, evals, chunk):
        y, n = simulate(noise, g, min(chunk, evals - i), speedup, rng)
        _, _, _, p_new, _ = mean_log_interval(y, n, NULL, resamples=RESAMPLES,
                                              seed=int(rng.integers(2**31)), interval=False)
        p_old = percentile_p(y, n, NULL, rng) if old else None
        if i == 0 and old:
            check_vectorised(y, n, p_new, p_old)
        for k, level in enumerate(LEVELS):
            counts["trtspec"][k] += int(np.sum(p_new <= level))
            if old:
                counts["percentile bootstrap"][k] += int(np.sum(p_old <= level))
    return counts


def ratio_text(count: int, evals: int, level: float) -> str:
    """rate / level, with a mark where it is over 1.5× beyond two simulation SEs."""
    rate = count / evals
    se = math.sqrt(1.5 * level * (1 - 1.5 * level) / evals)
    mark = " ✗" if rate > 1.5 * level + 2 * se else ""
    return f"{rate / level:.2f}×{mark}"


def decide_part(evals: int, seed: int) -> dict[str, int | float | str]:
    """Part 2 with the trtspec on sys.path: ``evals`` sequential evals at the boundary null,
    2 conditions × (all + 2 categories) = 6 cells, plan 24 (12 a category), budget 48."""
    import inspect

    import trtspec
    from trtspec.analysis.decide import decide
    from trtspec.build.recipe import Decide
    from trtspec.eval.run import read_records
    from trtspec.eval.sequential import read_sequential, until_decided
    from trtspec.eval.workloads.request import WorkloadRequest

    criteria = Decide(primary_metric="tpot", min_speedup=NULL, min_requests=6)
    conditions = ["eagle/D4/c1", "ngram/D4/c1"]
    pool = [WorkloadRequest(id=f"{c}-{i}", category=c, prompt=f"{c} {i}")
            for c in ("copy_heavy", "open_ended") for i in range(40)]
    plan = [r for r in pool if int(r.id.rsplit("-", 1)[1]) < 12]
    interim = "interim" in inspect.signature(decide).parameters
    wrong = looks_needed = 0
    start = time.time()
    for e in range(evals):
        rng = np.random.default_rng(seed * 100_003 + e)
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp)
            path = out / "records.jsonl"
            path.write_text("")

            def measure(batch, keys, look, path=path, rng=rng):
                with path.open("a") as sink:
                    for i, r in enumerate(batch):
                        for key in keys:
                            for arm, tpot in (("baseline", 0.05), ("spec", 0.05 / NULL)):
                                t = tpot * rng.lognormal(0, 0.15)
                                sink.write(json.dumps({
                                    "condition": key, "arm": arm, "request_id": r.id,
                                    "category": r.category, "block": f"{look}.{i}",
                                    "token_times_s": [0.05 + k * t for k in range(32)],
                                    "output_tokens": 32, "ttft_s": 0.05,
                                    "e2e_s": 0.05 + 31 * t, "output_digest": "x"}) + "\n")

            def judge(alphas, families, path=path):
                extra = {"interim": True} if interim else {}
                verdicts = decide(read_records(path), criteria, greedy=False, alphas=alphas,
                                  families=families, **extra)
                return {v.condition: (v.verdict, v.family) for v in verdicts
                        if v.category == "all"}

            measure(plan, conditions, 0)
            until_decided(out, plan, pool, 48, conditions, measure, judge, seed,
                          say=lambda _: None)
            looks = read_sequential(out)
            looks_needed += len(looks["looks"])
            final = decide(read_records(path), criteria, greedy=False, alphas=looks["alphas"],
                           families=looks["families"])
            wrong += any(v.verdict == "GO" for v in final)
    return {"evals": evals, "wrong": wrong, "looks": looks_needed / evals,
            "seconds": time.time() - start, "trtspec": str(Path(trtspec.__file__).parent)}


def decide_row(name: str, r: dict) -> str:
    rate = r["wrong"] / r["evals"]
    se = math.sqrt(rate * (1 - rate) / r["evals"]) if 0 < rate < 1 else \
        math.sqrt(0.025 * 0.975 / r["evals"])
    ok = "yes" if rate <= 0.025 + 2 * math.sqrt(0.025 * 0.975 / r["evals"]) else "**no**"
    return (f"| {name} | {r['evals']} | {r['wrong']} | {100 * rate:.2f} % ± {100 * se:.2f} | "
            f"{r['looks']:.2f} | {ok} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--evals", type=int, default=20000, help="simulated evals a cell")
    parser.add_argument("--power-evals", type=int, default=4000)
    parser.add_argument("--decide-evals", type=int, default=400)
    parser.add_argument("--compare-with", type=Path, default=None,
                        help="a checkout whose trtspec runs part 2 beside this one's")
    parser.add_argument("--decide-only", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("reports/bench-calibration.md"))
    args = parser.parse_args()
    units = UNITS
    if args.quick:  # a smoke test of every part: G = 8 and 12, a few hundred evals a cell
        args.evals, args.power_evals, args.decide_evals, units = 300, 100, 2, UNITS[:2]
    if args.decide_only:  # a child run with another checkout's trtspec on sys.path
        print(json.dumps(decide_part(args.decide_evals, args.seed)))
        return
    started = time.time()
    lines = ["# Calibration of the speedup p-values", "",
             "Generated by `python benchmarks/bench_calibration.py` "
             f"({'--quick' if args.quick else 'full'}).", "",
             "How often `p_go` falls at or below the level it is compared with when the true "
             f"speedup is exactly `min_speedup` ({NULL}), as a multiple of the level (1.00× is "
             "exact; ✗: above 1.5× by more than two simulation standard errors). Per-unit log "
             f"ratios of sd {SD}; {args.evals:,} simulated evals a cell; {RESAMPLES:,} bootstrap "
             "resamples an eval. trtspec: Student's t ∧ bootstrap-t (`trtspec.analysis.stats."
             "mean_log_interval`, batched); before: the percentile bootstrap trtspec used until "
             "now. Skewed noise: a standardised gamma of skewness ±0.5; the last table shows "
             "skewness 1, beyond the range the method holds in.", ""]
    header = "| units G | noise | " + " | ".join(f"{x:g}" for x in LEVELS) + " |"
    rule = "|---:|---|" + "---:|" * len(LEVELS)
    tables = {"trtspec": [header, rule], "percentile bootstrap": [header, rule]}
    beyond = [header, rule]
    power = ["| units G | noise | method | " + " | ".join(f"{x:g}" for x in LEVELS) + " |",
             "|---:|---|---|" + "---:|" * len(LEVELS)]
    worst = 0.0
    for g in units:
        for j, noise in enumerate(NOISES):
            t0 = time.time()
            counts = cell(noise, g, args.evals, NULL, args.seed + 1000 * g + j)
            for method, table in tables.items():
                table.append(f"| {g} | {noise} | " + " | ".join(
                    ratio_text(c, args.evals, lv) for c, lv in
                    zip(counts[method], LEVELS, strict=True)) + " |")
            worst = max(worst, *(c / args.evals / lv for c, lv in
                                 zip(counts["trtspec"], LEVELS, strict=True)))
            hits = cell(noise, g, args.power_evals, ALTERNATIVE, args.seed + 7 + 1000 * g + j)
            for method in tables:
                power.append(f"| {g} | {noise} | {method} | " + " | ".join(
                    f"{c / args.power_evals:.2f}" for c in hits[method]) + " |")
            print(f"G={g} {noise}: {time.time() - t0:.0f} s", flush=True)
        counts = cell(BEYOND, g, args.evals, NULL, args.seed + 1000 * g + 99, old=False)
        beyond.append(f"| {g} | {BEYOND} | " + " | ".join(
            ratio_text(c, args.evals, lv) for c, lv in
            zip(counts["trtspec"], LEVELS, strict=True)) + " |")
    lines += ["## False GO at the boundary null: trtspec", "", *tables["trtspec"], "",
              "## The same for the percentile bootstrap (before)", "",
              *tables["percentile bootstrap"], "",
              f"## Power at a true {ALTERNATIVE}× (share of evals with p_go ≤ the level, "
              f"{args.power_evals:,} a cell)", "", *power, "",
              "## Beyond the calibrated range: trtspec at skewness −1", "",
              "No test of a mean is exact for every shape of noise with a handful of units. "
              "A long tail of units on the slow side (a few requests that speculation makes "
              "much slower) at skewness −1 is where trtspec's p-value stops holding at the "
              "smallest levels:", "", *beyond, ""]
    decide_rows = []
    runs = [("this checkout", None)]
    if args.compare_with:
        sha = subprocess.run(["git", "-C", str(args.compare_with), "rev-parse", "--short",
                              "HEAD"], capture_output=True, text=True).stdout.strip()
        runs.append((f"before (commit {sha or args.compare_with})", args.compare_with))
    for name, where in runs:
        env = dict(os.environ)
        if where is not None:
            env["PYTHONPATH"] = str(Path(where).resolve())
        res = subprocess.run([sys.executable, __file__, "--decide-only", "--decide-evals",
                              str(args.decide_evals), "--seed", str(args.seed)],
                             env=env, capture_output=True, text=True, check=True)
        r = json.loads(res.stdout.strip().splitlines()[-1])
        print(f"decide ({name}): {r}", flush=True)
        decide_rows.append(decide_row(name, r))
    lines += ["## Through `decide`: family-wise wrong GO of sequential evals", "",
              f"{args.decide_evals} seeded evals at the boundary null (true {NULL}× in every "
              "cell; per-request TPOT lognormal, sd 0.15 an arm), the demo recipe's settings "
              "(`primary_metric: tpot`, `min_speedup: 1.05`, `min_requests: 6`): 2 conditions "
              "× (all + 2 categories) = 6 cells, `until_decided` with a plan of 24 (12 a "
              "category) and a budget of 48 (2 looks), each look judged by `decide`, then "
              "`decide` over all records as `trtspec decide` runs it. An eval counts when any "
              "of its 6 cells is GO; the promise is ≤ 2.5 % (+ 2 SE).", "",
              "| trtspec | evals | with a wrong GO | rate ± SE | looks per eval | ≤ 2.5 % + 2 SE |",
              "|---|---:|---:|---:|---:|---|", *decide_rows, "",
              f"Largest trtspec rate / level in the first table: {worst:.2f}×. "
              f"Took {time.time() - started:.0f} s.", ""]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
