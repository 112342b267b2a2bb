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


@pytest.mark.parametrize("bench,needles", [
    ("bench_cpu", ("| copy-heavy | trtspec ngram D=4 |", "| repeated pattern | trtspec suffix "
                   "adaptive |", "| open-ended chat | HF static cache + torch.compile |",
                   "× the floor", "| 9 |")),
    ("bench_serve", ("| plain | 1 |", "| ngram | 8 |", "HF `generate`", "outside forwards")),
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
