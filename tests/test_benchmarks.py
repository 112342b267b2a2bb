"""Benchmarks must not rot: each runs in its --quick mode and writes its markdown table."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_bench_verify_quick(tmp_path: Path) -> None:
    out = tmp_path / "bench-verify.md"
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_verify.py"), "--quick",
                          "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    text = out.read_text()
    assert "× copy GB/s" in text and "| 8 | 1000 | sampled (q) |" in text


def test_bench_cpu_quick(tmp_path: Path, smollm2) -> None:
    out = tmp_path / "bench-cpu.md"
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_cpu.py"), "--quick",
                          "--out", str(out)], capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stderr[-2000:]
    text = out.read_text()
    for needle in ("| copy-heavy | trtspec ngram |", "| open-ended chat | HF assistant_model |",
                   "× the floor", "| 17 |"):
        assert needle in text


def test_bench_serve_quick(tmp_path: Path, smollm2) -> None:
    out = tmp_path / "bench-serve.md"
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_serve.py"), "--quick",
                          "--out", str(out)], capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stderr[-2000:]
    text = out.read_text()
    for needle in ("| plain | 1 |", "| ngram | 8 |", "HF `generate`", "outside forwards"):
        assert needle in text
