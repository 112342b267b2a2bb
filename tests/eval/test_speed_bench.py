"""SPEED-Bench loader on small fixture files written here in the published schema."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trtspec.eval.workloads import load_workload, speed_bench
from trtspec.eval.workloads.request import WorkloadError


def row(qid: str, category: str, turns: list[str], multiturn: bool = False) -> dict:
    return {"question_id": qid, "category": category, "sub_category": "general", "turns": turns,
            "source": "trtspec-fixture", "src_id": qid, "difficulty": "easy",
            "multiturn": multiturn}


ROWS = [
    row("q1", "coding", ["Write a function that reverses a string."]),
    row("q2", "math", ["What is 12 squared?"]),
    row("q3", "writing", ["Write a haiku about rain.", "Now make it about snow."], True),
    row("q4", "coding", ["Explain recursion briefly."]),
]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_jsonl_and_parquet_load_the_same(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    jsonl = write_jsonl(tmp_path / "qualitative.jsonl", ROWS)
    pq.write_table(pa.Table.from_pylist(ROWS), tmp_path / "qual.parquet")
    a = speed_bench.load(jsonl)
    b = speed_bench.load(tmp_path / "qual.parquet")
    assert a == b and [r.id for r in a] == ["q1", "q2", "q3", "q4"]
    multi = a[2]
    assert multi.prompt == "Write a haiku about rain." and multi.followups == (
        "Now make it about snow.",)
    assert a[0].source == "speed-bench:qualitative" and a[0].category == "coding"


def test_placeholder_rows_are_refused_with_the_fix(tmp_path: Path) -> None:
    rows = [*ROWS, row("q5", "rag", [speed_bench.PLACEHOLDER]),
            row("q6", "qa", ["ok", f"see {speed_bench.PLACEHOLDER} upstream"], True)]
    with pytest.raises(WorkloadError) as err:
        speed_bench.load(write_jsonl(tmp_path / "q.jsonl", rows))
    text = str(err.value)
    assert "2 of 6 rows hold the upstream placeholder instead of text (q5, q6)" in text
    assert "Model-Optimizer examples/specdec_bench/prepare_data.py" in text


def test_config_files_are_found_and_schema_is_checked(tmp_path: Path) -> None:
    (tmp_path / "qualitative").mkdir()
    write_jsonl(tmp_path / "qualitative" / "part-0.jsonl", ROWS)
    requests = load_workload("speed-bench:qualitative", speed_bench_dir=tmp_path,
                             per_category_n=1)
    assert sorted(r.category for r in requests) == ["coding", "math", "writing"]
    with pytest.raises(WorkloadError, match="config 'throughput_2k' not found under"):
        load_workload("speed-bench:throughput_2k", speed_bench_dir=tmp_path)
    with pytest.raises(WorkloadError, match="unknown SPEED-Bench config 'tiny'"):
        load_workload("speed-bench:tiny", speed_bench_dir=tmp_path)
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"question_id": "x", "turns": ["t"]}])
    with pytest.raises(WorkloadError, match="row 1 lacks category: not the SPEED-Bench schema"):
        speed_bench.load(bad)


def test_prepare_data_fails_clearly_offline(tmp_path: Path, capsys) -> None:
    from trtspec.cli import main

    with pytest.raises(WorkloadError, match=r"needs the `datasets` package|could not fetch"):
        speed_bench.prepare(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        main(["prepare-data", "speed-bench", "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "Traceback" not in err and len(err.splitlines()) == 1
