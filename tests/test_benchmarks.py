"""Benchmarks must not rot: each runs in its --quick mode and writes its markdown table."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_bench_verify_quick(tmp_path: Path) -> None:
    out = tmp_path / "bench-verify.md"
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_verify.py"), "--quick",
                          "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    text = out.read_text()
    assert "× copy GB/s" in text and "| 8 | 1000 | sampled (q) |" in text


def test_bench_calibration_quick(tmp_path: Path) -> None:
    """Every part runs, including the batched p-value's check against the product's scalar
    functions and the sequential evals through decide."""
    out = tmp_path / "bench-calibration.md"
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_calibration.py"),
                          "--quick", "--out", str(out)], capture_output=True, text=True,
                         timeout=600)
    assert res.returncode == 0, res.stderr
    text = out.read_text()
    for needle in ("## False GO at the boundary null: trtspec", "| 12 | skewed left |",
                   "## Power at a true 1.3×", "| this checkout | 2 |"):
        assert needle in text, needle


@pytest.mark.parametrize("bench,needles", [
    ("bench_cpu", ("| copy-heavy | trtspec ngram D=4 |", "| repeated pattern | trtspec suffix "
                   "adaptive |", "| open-ended chat | HF static cache + torch.compile |",
                   "× the floor", "| 9 |")),
    ("bench_serve", ("| plain | plain |", "| suffix | adaptive, batch-aware |", "HF `generate`",
                     "Against the targets")),
    ("bench_adaptive", ("| trtspec plain |", "| layer_skip adaptive |", "vs trtspec plain")),
])
def test_smollm2_benchmarks_quick(bench: str, needles: tuple[str, ...], tmp_path: Path,
                                  smollm2) -> None:
    out = tmp_path / f"{bench}.md"
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / f"{bench}.py"), "--quick",
                          "--out", str(out)], capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stderr[-2000:]
    text = out.read_text()
    for needle in needles:
        assert needle in text


def test_bench_serve_live_rows_quick(tmp_path: Path, smollm2) -> None:
    """--live-rows: rounds on rows 0 and 7 of 8 score 8 rows spread and 2 packed (one swap);
    the section lands in the report beside what was there."""
    out = tmp_path / "bench-serve.md"
    out.write_text("# Serving scheduler under load (CPU)\n\n| plain | 1 |\n")
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_serve.py"),
                          "--live-rows", "--quick", "--out", str(out)], capture_output=True,
                         text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    text = out.read_text()
    assert text.startswith("# Serving scheduler under load (CPU)\n\n| plain | 1 |\n\n## Live rows")
    assert "| 0, 7 of 8 | 1 | 8 → 2 |" in text and "(1) |" in text


def test_bench_serve_admission_quick(tmp_path: Path, smollm2) -> None:
    """--admission: the gap and burst tables, whole, chunked and paced, land in the report's
    Admission section."""
    out = tmp_path / "bench-serve.md"
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_serve.py"),
                          "--admission", "--quick", "--out", str(out)], capture_output=True,
                         text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    text = out.read_text()
    assert text.startswith("## Admission") and "200-token prompt arrives" in text
    assert "| no prompt, as many |" in text  # the control: the noise floor beside each row
    for row in ("| whole (one call; before chunked prefill) |", "| 16 tokens a step |",
                "| 16 tokens a step, paced to 2× a round |"):
        assert text.count(row) == 2, row  # the gap table and the burst's


def test_bench_serve_soak_quick(tmp_path: Path) -> None:
    """The soak's code path on the toy backend (no weights): `trtspec serve` in a subprocess,
    streaming clients that drop a fifth of their requests, every check passing; the Soak
    section replaces an old one and leaves the scheduler tables above it alone."""
    out = tmp_path / "bench-serve.md"
    out.write_text("# Serving scheduler under load (CPU)\n\n| plain | 1 |\n\n## Soak\n\nstale\n")
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_serve.py"), "--soak",
                          "--quick", "--method", "suffix", "--out", str(out)],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    text = out.read_text()
    assert text.startswith("# Serving scheduler under load (CPU)\n\n| plain | 1 |\n\n## Soak\n")
    assert text.count("## Soak") == 1 and "stale" not in text
    for needle in ("| first quarter (1–10) |", "| last quarter (31–40) |", "| all 40 |",
                   "| requests lost | 0 | 0 | ok |", "| /health at the end | 200 | 200 | ok |",
                   "40 of 40", "The server said at start-up: `trtspec serve: http",
                   "then 16 at once with the longest prompts and max_tokens 32",
                   "Server RSS (MiB) after the warm-up, as each tenth of the run's requests",
                   "PASS. Command: `.venv/bin/python "
                   "benchmarks/bench_serve.py --soak --quick --method suffix"):
        assert needle in text, needle


def test_each_bench_serve_mode_replaces_only_its_part_of_the_report(tmp_path: Path,
                                                                   monkeypatch) -> None:
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    from serve_soak import write_report

    out = tmp_path / "bench-serve.md"
    write_report(out, "## Soak\n\nfirst soak", soak_section=True)  # no report yet
    assert out.read_text() == "## Soak\n\nfirst soak\n"
    write_report(out, "# Tables\n\nold", soak_section=False)
    assert out.read_text() == "# Tables\n\nold\n\n## Soak\n\nfirst soak\n"
    write_report(out, "## Soak\n\nsecond soak", soak_section=True)
    write_report(out, "# Tables\n\nnew\n", soak_section=False)
    assert out.read_text() == "# Tables\n\nnew\n\n## Soak\n\nsecond soak\n"


def test_bench_serve_mixed_lengths_are_seeded_and_span_half_to_one_and_a_half(monkeypatch
                                                                               ) -> None:
    """--mixed-lengths: every prompt's max_tokens drawn once from ½–1½ × --max-tokens, the
    same list in every run (so in every arm); without it, all alike."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    from bench_serve import output_lengths

    assert output_lengths(4, 40, False) == [40] * 4
    drawn = output_lengths(64, 40, True)
    assert drawn == output_lengths(64, 40, True) and min(drawn) >= 20 and max(drawn) <= 60
    assert len(set(drawn)) > 10 and 35 <= sum(drawn) / len(drawn) <= 45
    assert min(output_lengths(64, 1, True)) >= 1


def test_bench_serve_pairs_blocks_by_hand(monkeypatch) -> None:
    """The load table's design and statistic against hand-computed cases: blocks of 2c
    prompts, an arm order that puts every arm at every position equally often, the
    time-weighted geometric mean of paired blocks' throughput ratios with a CI at least
    Student's t over the blocks, and the verdict against the 0.97 line (shown above, shown
    below, open, or no CI under 8 blocks)."""
    import math
    from collections import Counter

    from scipy.stats import t as student

    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    from bench_serve import AA, arm_order, arms_of, blocks_of, check_clients, paired, verdict

    assert blocks_of(16, 1) == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11], [12, 13],
                                [14, 15]]
    assert blocks_of(16, 8) == blocks_of(16, 16) == [list(range(16))]
    assert check_clients(16, 4) is None and check_clients(16, 16) is None
    assert "--clients 3" in check_clients(16, 3) and "--clients 32" in check_clients(16, 32)
    batch = "adaptive, batch-aware"
    assert arms_of(("ngram", "suffix"), (batch,), aa=True) == [
        ("plain", "plain"), ("plain", AA), ("ngram", batch), ("suffix", batch)]
    assert arms_of(("ngram",), (batch,)) == [("plain", "plain"), ("ngram", batch)]  # --lookups
    pair = [arm_order(arms_of(("suffix",), (batch,)), k) for k in range(4)]  # back to back,
    assert [t[0][0] for t in pair] == ["plain", "suffix", "plain", "suffix"]  # first in turn
    arms = ["plain", "a/a", "ngram", "suffix"]
    turns = [arm_order(arms, k) for k in range(8)]  # a Williams design: 0 1 3 2, 1 2 0 3, …
    assert turns[0] == ["plain", "a/a", "suffix", "ngram"]
    assert turns[1] == ["a/a", "ngram", "plain", "suffix"]
    assert Counter((a, i) for turn in turns for i, a in enumerate(turn)) == \
        {(a, i): 2 for a in arms for i in range(4)}  # every arm at every position alike
    assert Counter((t[i], t[i + 1]) for t in turns for i in range(3)) == \
        {(a, b): 2 for a in arms for b in arms if a != b}  # and right after every other
    five = [arm_order(list(range(5)), k) for k in range(10)]  # odd: its rows reversed too
    assert Counter((t[i], t[i + 1]) for t in five for i in range(4)) == \
        {(a, b): 2 for a in range(5) for b in range(5) if a != b}

    def arm(rates: list[float]) -> list[dict]:  # 40 tokens a block at each rate (tokens/s)
        return [{"tokens": 40, "wall": 40 / r} for r in rates]

    # ratios 1.1 and 1/1.1 in turn on blocks of equal weight (plain's wall √r, the arm's
    # 1/√r: their geometric mean 1): geometric mean 1, log ratios ±0.0953, so the standard
    # error is 0.0953·√(8/7)/√8 = 0.0360 and Student's 95 % CI exp(±2.3646·0.0360)
    ratios = [1.1 if i % 2 else 1 / 1.1 for i in range(8)]
    even = paired([{"tokens": 40, "wall": 1 / math.sqrt(r)} for r in ratios],
                  [{"tokens": 40, "wall": math.sqrt(r)} for r in ratios])
    se = math.log(1.1) * math.sqrt(8 / 7) / math.sqrt(8)
    assert even["ratio"] == pytest.approx(1.0) and even["blocks"] == 8
    assert even["low"] <= math.exp(-2.3646 * se) + 1e-9
    assert even["high"] >= math.exp(2.3646 * se) - 1e-9
    assert even["p"] >= student.sf(-math.log(0.97) / se, 7) - 1e-12
    assert verdict(even) == "open"
    # time-weighted by both arms' times alike: plain took 1 s and 3 s on two blocks, the
    # arm 0.5 s and 2.4 s (2× and 1.25× faster); weights √(0.5·1) and √(2.4·3), so
    # exp((0.707·log 2 + 2.683·log 1.25) / 3.390) = 1.39 (≈ plain's 4 s over the arm's
    # 2.9 s = 1.38 in all), not the unweighted √(2·1.25) = 1.58
    two = paired([{"tokens": 40, "wall": 0.5}, {"tokens": 40, "wall": 2.4}],
                 [{"tokens": 40, "wall": 1.0}, {"tokens": 40, "wall": 3.0}])
    w1, w2 = math.sqrt(0.5), math.sqrt(7.2)
    assert two["ratio"] == pytest.approx(
        math.exp((w1 * math.log(2) + w2 * math.log(1.25)) / (w1 + w2)))
    assert verdict(two) == "no CI" and math.isnan(two["p"])  # under 8 blocks: the point
    rates = [20.0, 30.0, 25.0, 22.0, 18.0, 27.0, 24.0, 21.0]
    # every block 1.2× (a flat sample): shown above the line; every block 0.9×: below it
    up = paired(arm([r * 1.2 for r in rates]), arm(rates))
    assert up["ratio"] == pytest.approx(1.2) and verdict(up) == "≥ line" and up["p"] == 0.0
    down = paired(arm([r * 0.9 for r in rates]), arm(rates))
    assert down["ratio"] == pytest.approx(0.9) and verdict(down) == "< line"
    with pytest.raises(ValueError):  # blocks pair by index: a missing one is an error
        paired(arm([22.0]), arm(rates[:2]))


def test_bench_detok_quick(tmp_path: Path) -> None:
    out = tmp_path / "bench-detok.md"
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_detok.py"), "--quick",
                          "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    text = out.read_text()
    assert "| incremental (TextStream) | 2 |" in text and "| whole re-decode (before) | 0 |" in text
    assert "µs / token at 4000" in text and "Command: `python benchmarks/bench_detok.py" in text
