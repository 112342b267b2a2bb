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
