"""SPEED-Bench (NVIDIA, HF dataset ``nvidia/SPEED-Bench``) from local files.

Configs: ``qualitative`` (11 categories × 80) and ``throughput_{1k,2k,8k,16k,32k}`` (1,536 each,
tiers low_entropy / mixed / high_entropy). Rows whose upstream licence forbids redistribution
carry a placeholder instead of text; they must be rebuilt from the original sources with NVIDIA
Model-Optimizer's ``examples/specdec_bench/prepare_data.py``, so the loader refuses them rather
than measure a placeholder.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from trtspec.eval.workloads.request import WorkloadError, WorkloadRequest

PLACEHOLDER = "FULL BENCHMARK DATA SHOULD BE FETCHED FROM THE SOURCE USING SPECDEC_BENCH"
CONFIGS = ("qualitative", "throughput_1k", "throughput_2k", "throughput_8k", "throughput_16k",
           "throughput_32k")
FIELDS = ("question_id", "category", "turns")  # required; sub_category, source, src_id,
# difficulty and multiturn are optional


def find_file(directory: str | Path, config: str) -> Path:
    """The file for a config: <dir>/<config>.{parquet,jsonl} or the HF layout <dir>/<config>/*."""
    if config not in CONFIGS:
        raise WorkloadError(f"unknown SPEED-Bench config '{config}': use one of "
                            f"{', '.join(CONFIGS)}")
    root = Path(directory)
    candidates = [root / f"{config}.parquet", root / f"{config}.jsonl",
                  *sorted((root / config).glob("*.parquet")),
                  *sorted((root / config).glob("*.jsonl")),
                  *sorted((root / "data").glob(f"{config}-*.parquet"))]
    for path in candidates:
        if path.is_file():
            return path
    raise WorkloadError(
        f"SPEED-Bench config '{config}' not found under {root}: on a machine with hub access run "
        f"`trtspec prepare-data speed-bench --out {root}`, or copy the dataset's {config} files "
        "there")


def read_rows(path: Path) -> list[dict[str, Any]]:
    if path.suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise WorkloadError(f"{path}: reading parquet needs pyarrow (pip install pyarrow), "
                                "or convert the file to JSONL") from None
        return pq.read_table(path).to_pylist()
    rows = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise WorkloadError(f"{path}:{number}: not JSON ({e.msg})") from None
    return rows


def load(path: str | Path, config: str = "qualitative") -> list[WorkloadRequest]:
    """Rows → requests (first turn as the prompt, later turns as follow-ups); refuses
    placeholder rows with the fix."""
    path = Path(path)
    rows = read_rows(path)
    requests, placeholders = [], []
    for number, row in enumerate(rows, 1):
        missing = [f for f in FIELDS if f not in row]
        if missing:
            raise WorkloadError(f"{path}: row {number} lacks {', '.join(missing)}: not the "
                                "SPEED-Bench schema")
        turns = [str(t) for t in (row["turns"] or [])]
        if not turns:
            raise WorkloadError(f"{path}: row {number} ({row['question_id']}) has no turns")
        if any(PLACEHOLDER in t for t in turns):
            placeholders.append(str(row["question_id"]))
            continue
        category = str(row["category"])
        requests.append(WorkloadRequest(
            id=str(row["question_id"]), category=category, prompt=turns[0],
            followups=tuple(turns[1:]), source=f"speed-bench:{config}"))
    if placeholders:
        shown = ", ".join(placeholders[:3]) + (" …" if len(placeholders) > 3 else "")
        raise WorkloadError(
            f"{path}: {len(placeholders)} of {len(rows)} rows hold the upstream placeholder "
            f"instead of text ({shown}): rebuild them with NVIDIA Model-Optimizer "
            "examples/specdec_bench/prepare_data.py (it fetches the original sources) and "
            "point trtspec at the rebuilt files")
    return requests


def prepare(out: str | Path, configs: tuple[str, ...] = ("qualitative",)) -> list[Path]:
    """Download configs with ``datasets`` (machines with hub access) into <out>/<config>.jsonl."""
    try:
        from datasets import load_dataset
    except ImportError:
        raise WorkloadError("prepare-data needs the `datasets` package (pip install datasets) "
                            "and hub access; offline, copy the nvidia/SPEED-Bench files into "
                            f"{out} instead") from None
    written = []
    Path(out).mkdir(parents=True, exist_ok=True)
    for config in configs:
        try:
            data = load_dataset("nvidia/SPEED-Bench", config, split="test")
        except Exception as e:  # offline, gated, renamed: the library raises many types
            raise WorkloadError(f"could not fetch nvidia/SPEED-Bench/{config}: "
                                f"{str(e).splitlines()[0]}") from None
        path = Path(out) / f"{config}.jsonl"
        with path.open("w") as f:
            for row in data:
                f.write(json.dumps(row) + "\n")
        written.append(path)
    return written
