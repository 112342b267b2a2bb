"""scripts/gpu_check.sh, the prepared device check, must run here too: without a GPU every GPU
part is skipped with its reason, the run exits 0 and ends in a table; the parts themselves run
on the CPU at tiny sizes (--device cpu --quick), so their code is not first run on a lent GPU."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
HEADER = "| part | result | seconds | note |"


def rows(text: str) -> dict[str, list[str]]:
    """part → [result, seconds, note] of the table in a report or on stdout."""
    table = text.split(HEADER, 1)[1].split("\n\n", 1)[0].splitlines()[2:]
    return {cells[0]: cells[1:] for cells in
            ([c.strip() for c in line.strip("|").split("|")] for line in table)}


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU the check runs its GPU parts")
def test_sh_without_a_gpu_skips_and_says_why(tmp_path: Path) -> None:
    report = tmp_path / "gpu-check.md"
    res = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--no-install",
                          "--report", str(report)], capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, PYTHON=sys.executable))
    assert res.returncode == 0, res.stdout + res.stderr
    assert HEADER in res.stdout
    table = rows(report.read_text())
    assert rows(res.stdout) == table
    assert table["environment"][0] == "PASS" and "no CUDA device" in table["environment"][2]
    for part in ("gpu-tests", "smollm2-acceptance", "llama8b-shape", "verify-bench",
                 "tensorrt-llm"):
        result, _, note = table[part]
        assert result == "SKIPPED" and note.startswith("no CUDA device"), (part, note)
    assert "tensorrt_llm" in table["tensorrt-llm"][2]
    assert report.with_suffix(".log").is_file()


def test_parts_run_on_the_cpu(tmp_path: Path) -> None:
    """t(T) and the verify benchmark at tiny sizes; TensorRT-LLM is skipped with why."""
    report = tmp_path / "gpu-check.md"
    res = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_check.py"), "--no-install",
                          "--device", "cpu", "--quick", "--only",
                          "llama8b-shape,verify-bench,tensorrt-llm", "--report", str(report)],
                         capture_output=True, text=True, timeout=180)
    assert res.returncode == 0, res.stdout + res.stderr
    text = report.read_text()
    table = rows(text)
    assert set(table) == {"environment", "llama8b-shape", "verify-bench", "tensorrt-llm"}
    assert table["llama8b-shape"][0] == "PASS" and "t(T)/t(1): T=2" in table["llama8b-shape"][2]
    assert "| 8 |" in text.split("## llama8b-shape", 1)[1]  # T = 1 … 8 at --quick
    assert table["verify-bench"][0] == "PASS" and "GB/s" in table["verify-bench"][2]
    trt = table["tensorrt-llm"]
    if trt[0] == "SKIPPED":
        assert "tensorrt_llm" in trt[2] and "trtspec[trtllm]" in trt[2]


def test_an_unknown_part_is_one_line() -> None:
    res = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_check.py"), "--no-install",
                          "--only", "nope"], capture_output=True, text=True, timeout=60)
    assert res.returncode == 2
    assert "unknown part nope: choose from gpu-tests," in res.stderr.splitlines()[-1]
