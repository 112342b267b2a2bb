"""The documented recipe reference (docs/recipe-reference.md) is the models' own: the generated
block matches them, every field is described and listed, and the table of names from other tools
names real keys."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, get_args

import pytest
from pydantic import BaseModel

from trtspec.build.recipe import Recipe
from trtspec.build.recipe.reference import END, START, keys, main, reference_markdown

ROOT = Path(__file__).resolve().parents[3]
PAGE = ROOT / "docs" / "recipe-reference.md"
FIX = "run `python -m trtspec.build.recipe.reference --write docs/recipe-reference.md`"


def _block(text: str) -> str:
    assert text.count(START) == 1 and text.count(END) == 1, "the page lost its reference markers"
    return text.split(START, 1)[1].split(END, 1)[0]


def _models(tp: Any, seen: dict[str, type[BaseModel]]) -> dict[str, type[BaseModel]]:
    """Every model reachable from ``tp`` (through lists, unions and Annotated), by name."""
    if isinstance(tp, type) and issubclass(tp, BaseModel) and tp.__name__ not in seen:
        seen[tp.__name__] = tp
        for field in tp.model_fields.values():
            _models(field.annotation, seen)
    for arg in get_args(tp):
        _models(arg, seen)
    return seen


def test_the_readme_block_is_the_models_reference() -> None:
    assert _block(PAGE.read_text()).strip() == reference_markdown().strip(), FIX


def test_every_field_of_every_model_is_described_and_listed() -> None:
    models = _models(Recipe, {})
    assert {"Target", "Ngram", "Eagle", "TorchBackend", "TrtllmBackend", "Decide"} <= set(models)
    markdown = reference_markdown()
    listed = re.findall(r"^\| `([^`]+)` \|", markdown, flags=re.M)
    for name, model in models.items():
        for field_name, field in model.model_fields.items():
            assert field.description and field.description.strip(), f"{name}.{field_name}"
            assert any(key.rsplit(".", 1)[-1] == field_name for key in listed), (
                f"{name}.{field_name} is not in the reference")
    assert len(listed) == len(keys())


def test_rows_carry_type_default_and_variant() -> None:
    markdown = reference_markdown()
    ngram = markdown.split("## `methods[]` with `method: ngram`", 1)[1].split("\n## ", 1)[0]
    assert "| `methods[].min_n` | int (≥ 1) | `1` | shortest n-gram" in ngram
    torch = markdown.split("## `backend` with `kind: torch`", 1)[1].split("\n## ", 1)[0]
    assert "| `backend.device` | str | `auto` |" in torch and "workflow" not in torch
    assert "| `target.model` | str | required |" in markdown
    assert "| `draft_lengths` | list of (int (≥ 1, ≤ 64) or `adaptive`) or `auto` | `auto` |" \
        in markdown
    assert "| `eval.per_category` | int (≥ 1) or null | `null` | a seeded stratified" in markdown


def test_the_names_table_names_keys_of_the_reference() -> None:
    """Each `key` (or `key: tag`) in the table's trtspec column is a key path of the reference;
    after `methods[].method: ngram`, keys of methods[] must be ngram's."""
    text = PAGE.read_text()
    header = "| you may know | in a trtspec recipe | note |"
    rows = text.split(header, 1)[1].split("\n\n", 1)[0].strip().splitlines()[1:]
    valid = {(k.dotted, k.variant) for k in keys()}
    assert len(rows) >= 12
    for row in rows:
        cell = row.split(" | ")[1]
        variant = None
        tokens = re.findall(r"`([^`]+)`", cell)
        assert tokens, row
        for token in tokens:
            key, _, tag = token.partition(": ")
            if tag:
                variant = (key.rsplit(".", 1)[-1], tag)
            assert (key, variant) in valid or (key, None) in valid, f"{token!r} in {row}"
    known = " ".join(row.split(" | ")[0] for row in rows)
    for name in ("vLLM `speculative_config.num_speculative_tokens`", "vLLM `prompt_lookup_min`",
                 "`prompt_lookup_max`", "TensorRT-LLM `max_draft_len`",
                 "TensorRT-LLM `max_matching_ngram_size`", "TensorRT-LLM `speculative_model_dir`",
                 "transformers `prompt_lookup_num_tokens`", "transformers `assistant_model`"):
        assert name in known, f"the names table lacks {name}"


def test_write_rewrites_only_the_block(tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                       ) -> None:
    readme = tmp_path / "README.md"
    readme.write_text(f"# x\n\nbefore\n\n{START}\nstale\n{END}\n\nafter\n")
    assert main(["--write", str(readme)]) == 0
    text = readme.read_text()
    assert text.startswith("# x\n\nbefore\n\n") and text.endswith(f"{END}\n\nafter\n")
    assert "stale" not in text and _block(text).strip() == reference_markdown().strip()
    readme.write_text("# no markers\n")
    assert main(["--write", str(readme)]) == 2
    err = capsys.readouterr().err
    assert "no <!-- recipe-reference:start -->" in err and len(err.strip().splitlines()) == 1
