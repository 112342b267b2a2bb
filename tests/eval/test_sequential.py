"""eval --until-decided on synthetic timings: rounds of new requests until decided, α spent
over the looks."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from trtspec.analysis.decide import decide
from trtspec.build.recipe import Decide
from trtspec.eval.run import read_records
from trtspec.eval.sequential import read_sequential, until_decided, unused_rows
from trtspec.eval.workloads.request import WorkloadRequest

CRITERIA = Decide(min_speedup=1.05, min_requests=6)
POOL = [WorkloadRequest(id=f"{c}-{i}", category=c, prompt=f"{c} {i}")
        for c in ("copy", "open") for i in range(40)]
PLAN = [r for r in POOL if int(r.id.split("-")[1]) < 4]  # 4 per category


def run(tmp: Path, speedup: float, seed: int, budget: int = 48, metric: str = "tpot_p50",
        ttft_ratio: float = 1.0) -> tuple[str, int, dict]:
    """A sequential eval of one condition whose spec arm is ``speedup`` faster (TPOT noise
    15 % per request and arm) and whose TTFT is ``ttft_ratio`` × the baseline's (noise 30 %);
    returns (final verdict, paired requests, sequential.json)."""
    criteria = CRITERIA.model_copy(update={"primary_metric": metric})
    rng = np.random.default_rng(seed)
    path = tmp / "records.jsonl"
    path.write_text("")

    def measure(batch, conditions, look):
        with path.open("a") as sink:
            for i, r in enumerate(batch):
                for condition in conditions:
                    for arm, tpot, ttft in (("baseline", 0.05, 0.05),
                                            ("spec", 0.05 / speedup, 0.05 * ttft_ratio)):
                        t = tpot * rng.lognormal(0, 0.15)
                        first = ttft * rng.lognormal(0, 0.3)
                        sink.write(json.dumps({
                            "condition": condition, "arm": arm, "request_id": r.id,
                            "category": r.category, "block": f"{look}.{i}",
                            "token_times_s": [first + k * t for k in range(32)],
                            "output_tokens": 32, "ttft_s": first, "e2e_s": first + 31 * t,
                            "output_digest": "x"}) + "\n")

    def judge(alphas, families):  # as the eval judges its looks: gates wait for the end
        verdicts = decide(read_records(path), criteria, greedy=False, alphas=alphas,
                          families=families, interim=True)
        return {v.condition: (v.verdict, v.family) for v in verdicts if v.category == "all"}

    measure(PLAN, ["ngram/D4/c1"], 0)
    until_decided(tmp, PLAN, POOL, budget, ["ngram/D4/c1"], measure, judge, seed,
                  say=lambda _: None)
    looks = read_sequential(tmp)
    verdicts = decide(read_records(path), criteria, greedy=False, alphas=looks["alphas"],
                      families=looks["families"])
    overall = next(v for v in verdicts if v.category == "all")
    return overall.verdict, overall.requests, looks


def test_a_clear_speedup_stops_early_with_go(tmp_path: Path) -> None:
    verdict, n, looks = run(tmp_path, 1.3, seed=0)
    assert verdict == "GO" and n < 48
    assert looks["looks"][-1]["verdicts"] == {"ngram/D4/c1": "GO"}
    assert [look["n"] for look in looks["looks"]] == list(range(8, n + 1, 8))
    assert sum(look["alpha"] for look in looks["looks"]) < 0.025


def test_a_speedup_on_the_threshold_spends_the_budget(tmp_path: Path) -> None:
    verdict, n, looks = run(tmp_path, 1.05, seed=0)
    assert verdict == "INCONCLUSIVE" and n == 48
    assert sum(look["alpha"] for look in looks["looks"]) == pytest.approx(0.025)


@pytest.mark.parametrize("metric", ["tpot_p50", "tpot"])
def test_a_speedup_on_the_threshold_is_rarely_go_over_every_look(tmp_path: Path,
                                                                  metric: str) -> None:
    """At the boundary null (a true 1.05× against min_speedup 1.05, where a wrong GO is most
    likely), over every look: GO at most α = 2.5 % of the time, + 2 simulation SE."""
    go = 0
    for seed in range(200):
        verdict, _, _ = run(tmp_path, 1.05, seed=seed, budget=24, metric=metric)
        go += verdict == "GO"
        (tmp_path / "sequential.json").unlink()
    print(f"{metric}: GO in {go} of 200 sequential evals at a true 1.05× (α = 2.5 %)")
    assert go <= 200 * 0.025 + 2 * np.sqrt(200 * 0.025 * 0.975)


def test_a_latency_gate_on_its_limit_fails_at_most_alpha_over_four_looks(tmp_path: Path) -> None:
    """A spec arm on the speedup threshold (so the eval runs every look) whose TTFT is 10 %
    slower, exactly the gate's limit: over 4 looks (budget 32, 8 a look) the looks leave the
    gate out and decide tests it once, at the end, so it fails at most α = 2.5 % of the time
    (+ 2 simulation SE), however many looks there were."""
    failed = 0
    for seed in range(120):
        verdict, _, _ = run(tmp_path, 1.05, seed=seed, budget=32, metric="tpot",
                            ttft_ratio=1.10)
        failed += verdict == "NO-GO"
        (tmp_path / "sequential.json").unlink()
    print(f"TTFT +10 % on its limit over up to 4 looks, 120 evals: NO-GO {failed} (the gate's "
          "and, at a true 1.05×, the speedup's)")
    assert failed <= 120 * 0.025 + 2 * np.sqrt(120 * 0.025 * 0.975)


def test_new_requests_are_unused_rows_stratified_by_category() -> None:
    from collections import Counter

    used = {r.id for r in PLAN}
    batch = unused_rows(POOL, used, Counter({"copy": 4, "open": 4}), seed=0, round_index=1)
    assert Counter(r.category for r in batch) == {"copy": 4, "open": 4}
    assert not used & {r.id for r in batch}
    assert unused_rows(POOL[:4], used, Counter({"copy": 4}), 0, 1) == []  # all measured


def test_the_report_says_how_many_requests_each_verdict_needed(tmp_path: Path) -> None:
    from trtspec.eval.sequential import looks_lines

    _, n, looks = run(tmp_path, 1.3, seed=0)
    lines = looks_lines(looks)
    assert lines[0] == "## Looks (`--until-decided`)"
    assert lines[-1].startswith(f"| {len(looks['looks'])} | {n} | ")
    assert lines[-1].endswith("| ngram/D4/c1 | ngram/D4/c1: GO |")
    assert looks_lines(None) == []


def test_spending_holds_the_error_where_full_alpha_at_every_look_does_not() -> None:
    """The power check of the spending: at a true speedup exactly on the threshold (the worst
    case for a wrong GO), five looks each tested at the full 2.5 % say GO far more often than
    2.5 %; the spent α per look keeps it under."""
    from trtspec.analysis.stats import look_alphas, speedup_interval

    sizes = [8, 16, 24, 32, 40]
    spend = look_alphas(sizes, 40)
    wrong = {"spent": 0, "full α each look": 0}
    for seed in range(200):
        rng = np.random.default_rng(seed)
        base = 0.05 * rng.lognormal(0, 0.15, 40)
        spec = 0.05 / 1.05 * rng.lognormal(0, 0.15, 40)
        for name, alphas in (("spent", spend), ("full α each look", [0.025] * 5)):
            wrong[name] += any(
                speedup_interval(base[:n], spec[:n], range(n), 1.05, resamples=1000,
                                 seed=seed).p_go <= a for n, a in zip(sizes, alphas, strict=True))
    print(f"wrong GO over 5 looks at a true 1.05×, 200 replicates: {wrong}")
    assert wrong["spent"] <= 0.025 * 200 < 1.5 * 0.025 * 200 <= wrong["full α each look"]


def test_a_short_last_round_keeps_the_categories_in_proportion() -> None:
    from collections import Counter

    from trtspec.eval.sequential import share_out

    assert share_out(Counter(copy=4, open=4), 20) == Counter(copy=4, open=4)
    assert share_out(Counter(copy=4, open=4), 5) == Counter(copy=3, open=2)  # ties by name
    assert share_out(Counter(a=6, b=3, c=3), 4) == Counter(a=2, b=1, c=1)


def _undecided(tmp: Path, plan, pool, budget: int) -> list[str]:
    said: list[str] = []
    rounds: list[int] = []
    tmp.mkdir()
    until_decided(tmp, plan, pool, budget, ["ngram/D4/c1"],
                  lambda batch, conditions, look: rounds.append(len(batch)),
                  lambda alphas, families: {"ngram/D4/c1": ("INCONCLUSIVE", 3)}, 0, said.append)
    return said + [f"rounds {rounds}"]


def test_rows_that_run_out_are_said_and_never_measured_again(tmp_path: Path) -> None:
    whole = _undecided(tmp_path / "a", PLAN, PLAN, len(PLAN))  # a custom JSONL run whole
    assert whole[0].startswith("until-decided: the workloads have no unused rows left (8 "
                               "measured)") and whole[-1] == "rounds []"
    spent = _undecided(tmp_path / "b", PLAN, POOL, 13)  # a last round of 5, 3 + 2
    assert spent[-2].startswith("until-decided: budget of 13 requests per condition spent")
    assert spent[-1] == "rounds [5]"
