"""Workloads: custom JSONL (line-numbered errors), the built-in set, stratified sampling."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trtspec.eval.workloads import COPY_HEAVY, builtin, categories, load_workload, per_category
from trtspec.eval.workloads.request import WorkloadError, load_jsonl


def write(path: Path, rows: list) -> Path:
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return path


def test_custom_jsonl_prompt_and_messages(tmp_path: Path) -> None:
    path = write(tmp_path / "w.jsonl", [
        {"id": "a", "category": "summarise", "prompt": "Sum up: x", "max_tokens": 32},
        {"id": "b", "category": "chat", "messages": [{"role": "user", "content": "hi"}]},
    ])
    a, b = load_jsonl(path)
    assert a.chat() == "Sum up: x" and a.max_tokens == 32
    assert b.chat() == [{"role": "user", "content": "hi"}] and b.category == "chat"


@pytest.mark.parametrize(("rows", "message"), [
    ([{"id": "a", "prompt": "x"}, "{not json"], "w.jsonl:2: not JSON"),
    ([{"id": "a", "prompt": "x"}, {"id": "b"}], "w.jsonl:2: request: give exactly one of"),
    ([{"id": "a", "prompt": "x", "messages": []}], "w.jsonl:1: request: give exactly one of"),
    ([{"id": "a", "prompt": "x", "temperature": 1}], "w.jsonl:1: temperature: Extra inputs"),
    ([{"id": "a", "prompt": "x", "max_tokens": 0}], "w.jsonl:1: max_tokens: Input should be"),
    ([{"id": "a", "prompt": "x"}, {"id": "a", "prompt": "y"}], "w.jsonl:2: id 'a' appears twice"),
    ([{"prompt": "x"}], "w.jsonl:1: id: Field required"),
])
def test_schema_errors_name_the_line(tmp_path: Path, rows: list, message: str) -> None:
    with pytest.raises(WorkloadError, match=message):
        load_jsonl(write(tmp_path / "w.jsonl", rows))


def test_builtin_workload_shape(smollm2) -> None:
    from trtspec.runtime.models import encode

    requests = builtin()
    assert len(requests) >= 48 and len(categories(requests)) >= 6
    assert set(COPY_HEAVY) <= set(categories(requests))
    assert {"chat", "story", "reasoning"} <= set(categories(requests))
    lengths = [len(encode(smollm2.tokenizer, r.chat())) for r in requests]
    long = sum(n >= 1500 for n in lengths)
    assert long >= 6 and min(lengths) < 100, (long, min(lengths))
    assert len({r.id for r in requests}) == len(requests)


def test_per_category_is_stratified_and_seeded() -> None:
    requests = builtin()
    sample = per_category(requests, 2, seed=1)
    counts = {c: sum(r.category == c for r in sample) for c in categories(requests)}
    assert set(counts.values()) == {2}
    assert sample == per_category(requests, 2, seed=1) != per_category(requests, 2, seed=2)
    assert load_workload("builtin", per_category_n=1)[0].category == requests[0].category
