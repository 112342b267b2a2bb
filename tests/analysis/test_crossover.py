"""crossover: PAV by hand, c* by hand, coverage of the c* CI on a known crossover, edge cases."""

from __future__ import annotations

import math

import numpy as np
import pytest

from trtspec.analysis.crossover import (
    Z95,
    bucket_of,
    bucket_speedups,
    crossing,
    crossover,
    fit_curve,
    markdown_lines,
    pava,
)
from trtspec.analysis.decide import GO, INCONCLUSIVE, NO_GO, Verdict
from trtspec.build.recipe import Decide

LEVELS = [1, 2, 4, 8, 16]
E2E = Decide(primary_metric="e2e_p50", min_requests=10)


def test_pava_by_hand() -> None:
    # 0.5 then 0.7 rises: pooled to their mean 0.6; the rest already falls
    assert pava([1.0, 0.5, 0.7, 0.2], [1, 1, 1, 1]) == pytest.approx([1.0, 0.6, 0.6, 0.2])
    # weights 1 and 3: (0.5·1 + 0.7·3) / 4 = 0.65
    assert pava([1.0, 0.5, 0.7, 0.2], [1, 1, 3, 1]) == pytest.approx([1.0, 0.65, 0.65, 0.2])
    # a rising run pools into one block: (0.3 + 0.5 + 0.7) / 3 = 0.5
    assert pava([0.3, 0.5, 0.7], [1, 1, 1]) == pytest.approx([0.5, 0.5, 0.5])
    # a cascade: 0.9 pools with 0.2 → 0.55, then 0.4 < 0.55 stays; 0.6 > 0.4 pools → 0.5
    assert pava([1.0, 0.2, 0.9, 0.4, 0.6], [1] * 5) == pytest.approx([1.0, 0.55, 0.55, 0.5, 0.5])


def test_c_star_by_hand() -> None:
    # fitted 1.6, 1.2, 0.9, 0.6 at c = 1, 2, 4, 8; falls below 1.0 between c = 2 and 4:
    # t = (log 1.2 − 0) / (log 1.2 − log 0.9) = 0.18232 / 0.28768 = 0.63376,
    # log c* = log 2 + t · (log 4 − log 2) → c* = 2^1.63376 = 3.1035
    where, c = crossing([1, 2, 4, 8], np.log([1.6, 1.2, 0.9, 0.6]), 1.0)
    assert where == "between"
    assert c == pytest.approx(3.1035, abs=1e-3)
    assert crossing([1, 2], np.log([1.5, 1.1]), 1.0) == ("above", None)
    assert crossing([1, 2], np.log([0.9, 0.8]), 1.0) == ("below", None)
    # at exactly min_speedup it is not below yet: the crossing is past that level
    assert crossing([1, 2, 4], np.log([1.2, 1.0, 0.5]), 1.0)[1] == pytest.approx(
        2 * 2 ** 0.0, abs=1e-9)


def _points(speedups: list[float], sd: float = 0.05, levels: list[int] = LEVELS
            ) -> list[tuple[int, float, tuple[float, float]]]:
    return [(c, s, (s * math.exp(-Z95 * sd), s * math.exp(Z95 * sd)))
            for c, s in zip(levels[:len(speedups)], speedups, strict=True)]


def test_fit_curve_by_hand_with_a_rise() -> None:
    # equal CI widths: equal weights, so the rise 0.9 → 1.1 pools to the geometric mean
    curve = fit_curve("ngram", 4, "all", _points([1.6, 0.9, 1.1, 0.6], levels=[1, 2, 4, 8]),
                      1.0, resamples=200)
    assert curve is not None
    pooled = math.sqrt(0.9 * 1.1)  # 0.99499: below 1.0, so c* lies between c = 1 and 2
    assert curve.fitted == pytest.approx([1.6, pooled, pooled, 0.6])
    t = math.log(1.6) / (math.log(1.6) - math.log(pooled))
    assert curve.c_star == pytest.approx(2 ** t)
    assert curve.where == "between"


def test_known_crossover_is_covered() -> None:
    """True speedup 1.8 at c = 1 falling linearly in log c to 0.7 at c = 16; each level's log
    speedup is measured with normal noise of sd 0.08 and reported with the CI that sd implies
    (log speedup ± 1.96 · 0.08). c* must lie inside the reported CI in ≥ 90 % of 50 seeded
    replicates."""
    sd = 0.08
    slope = (math.log(0.7) - math.log(1.8)) / 4  # per doubling of c
    truth = [math.log(1.8) + slope * math.log2(c) for c in LEVELS]
    true_c = 2 ** (-math.log(1.8) / slope)  # where log speedup = 0: c* ≈ 5.62
    assert 4 < true_c < 8
    rng = np.random.default_rng(2026)
    covered = 0
    for rep in range(50):
        observed = np.exp(np.array(truth) + rng.normal(0, sd, len(LEVELS)))
        curve = fit_curve("ngram", 4, "all", _points(list(observed), sd), 1.0, seed=rep,
                          resamples=400)
        assert curve is not None
        low, high = curve.c_star_ci
        covered += (low is None or low <= true_c) and (high is None or true_c <= high)
    assert covered >= 45


def test_a_crossover_inside_a_bend_is_covered() -> None:
    """The speedup holds at 1.8 up to c = 6, then falls linearly in log c to 0.6 at c = 12
    (and stays there): the true c* = 6 · 2^(log 1.8 / log 3) ≈ 8.5 ... lies in the cell (8, 16)
    where nothing was measured; a CI from the interpolation alone would shrink onto the
    interpolated point. The CI spans at least the cell: covered in ≥ 90 % of 50 replicates."""
    sd = 0.08

    def log_speedup(c: float) -> float:
        if c <= 6:
            return math.log(1.8)
        return max(math.log(0.6), math.log(1.8) - math.log(3) * math.log2(c / 6))

    true_c = 6 * 2 ** (math.log(1.8) / math.log(3))
    assert 8 < true_c < 16 and abs(log_speedup(true_c)) < 1e-9
    rng = np.random.default_rng(7)
    covered = 0
    for rep in range(50):
        observed = np.exp([log_speedup(c) + rng.normal(0, sd) for c in LEVELS])
        curve = fit_curve("ngram", 4, "all", _points(list(observed), sd), 1.0, seed=rep,
                          resamples=200)
        low, high = curve.c_star_ci
        covered += (low is None or low <= true_c) and (high is None or true_c <= high)
    assert covered >= 45


def test_a_curve_below_from_the_start_says_so() -> None:
    below = fit_curve("ngram", 4, "all", _points([0.5, 0.4]), 1.0, resamples=100)
    assert below.where == "below" and below.ci_text == "< 1"


def test_edge_cases() -> None:
    above = fit_curve("ngram", 4, "all", _points([1.8, 1.6, 1.4]), 1.0, resamples=100)
    assert above is not None and above.where == "above" and above.c_star is None
    assert above.c_star_text.startswith("above 4 ")
    below = fit_curve("ngram", 4, "all", _points([0.9, 0.8, 0.7]), 1.0, resamples=100)
    assert below is not None and below.where == "below"
    assert below.c_star_text.startswith("below 1")
    nan = float("nan")
    skipped = fit_curve("ngram", 4, "all", [*_points([1.5, 0.8]), (4, nan, (nan, nan))], 1.0,
                        resamples=100)
    assert skipped is not None and skipped.levels == [1, 2] and skipped.skipped == [4]
    assert fit_curve("ngram", 4, "all", [*_points([1.5]), (2, nan, (nan, nan))], 1.0) is None


def _verdict(condition: str, speedup: float, verdict: str, sd: float = 0.05) -> Verdict:
    ci = (speedup * math.exp(-Z95 * sd), speedup * math.exp(Z95 * sd))
    return Verdict(condition, "all", verdict, speedup, ci, 40)


def test_one_level_has_no_crossover() -> None:
    verdicts = [_verdict("ngram/D4/c1", 1.5, GO), _verdict("ngram/D2/c1", 1.3, GO)]
    assert crossover(verdicts, [], Decide(min_speedup=1.0)) is None
    assert markdown_lines(None) == []


def test_schedule_takes_best_go_d_and_stops_above_c_star() -> None:
    verdicts = [_verdict("ngram/D4/c1", 1.8, GO), _verdict("ngram/D2/c1", 1.5, GO),
                _verdict("ngram/D4/c2", 1.3, GO), _verdict("ngram/D2/c2", 1.35, GO),
                _verdict("ngram/D4/c4", 0.9, NO_GO), _verdict("ngram/D2/c4", 1.02,
                                                               INCONCLUSIVE),
                _verdict("ngram/D4/c8", 0.7, NO_GO), _verdict("ngram/D2/c8", 0.8, NO_GO)]
    cross = crossover(verdicts, [], Decide(min_speedup=1.0))
    assert cross is not None and cross["levels"] == [1, 2, 4, 8]
    plan = cross["schedules"]["ngram"]
    assert plan["schedule"] == [(1, 4), (2, 2), (4, 0), (8, 0)]
    # the c* of D = 2, the D the schedule runs last (D = 2 at c = 4 is 1.02× > 1.0 in the fit)
    assert plan["where"] == "between" and 4 < plan["c_star"] < 8
    text = "\n".join(markdown_lines(cross))
    assert "## Concurrency crossover" in text and "- **ngram**: 1: 4, 2: 2, 4: 0, 8: 0" in text
    import json

    json.dumps(cross)  # JSON-ready


def test_buckets_by_context_length() -> None:
    assert bucket_of(100) == "context 0–255" and bucket_of(300) == "context 256–1023"
    assert bucket_of(None) is None and bucket_of(20000).startswith("context ≥")
    rng = np.random.default_rng(0)
    records = []
    for c in ("ngram/D4/c1", "ngram/D4/c2"):
        for i in range(40):
            tokens = 100 if i % 2 else 2000
            base = 0.05 * (1 + 0.05 * rng.random())
            for arm, tpot in (("baseline", base), ("spec", base / (1.5 if tokens < 256 else 1.1))):
                records.append({"condition": c, "category": "chat", "arm": arm,
                                "request_id": f"r{i}", "context_tokens": tokens,
                                "output_tokens": 11, "ttft_s": 0.0, "e2e_s": 10 * tpot})
    out = bucket_speedups(records, E2E)
    assert {b for b, _, _ in out["ngram/D4/c1"]} == {"context 0–255", "context 1024–4095"}
    speed = {b: s for b, _, s in out["ngram/D4/c2"]}
    assert speed["context 0–255"] == pytest.approx(1.5, rel=0.01)
    assert speed["context 1024–4095"] == pytest.approx(1.1, rel=0.01)
    assert bucket_speedups([r | {"context_tokens": 5} for r in records], E2E) == {}
    # a bucket needs 8 independent units, as a verdict does: 40 requests in 2 turns have none
    turns = [r | {"block": f"t{int(r['request_id'][1:]) % 2}"} for r in records]
    assert bucket_speedups(turns, E2E) == {}
