"""`trtspec doctor`: machine facts and per-recipe needs."""

from __future__ import annotations

from pathlib import Path

from trtspec.build.doctor import machine, recipe_needs
from trtspec.cli import main

ROOT = Path(__file__).resolve().parents[2]


def test_machine_rows_name_the_stack() -> None:
    rows = dict(machine())
    assert rows["tensorrt_llm"].startswith("not installed") and rows["GPUs"] == "none"
    assert "CUDA no" in rows["torch"]


def test_recipe_needs(tmp_path: Path, capsys) -> None:
    assert recipe_needs(ROOT / "recipes" / "cpu-smollm2.yaml") == []
    gpu = recipe_needs(ROOT / "recipes" / "h200-llama31-8b-draft1b.yaml")
    assert gpu[0].startswith("tensorrt_llm") and gpu[1] == "an NVIDIA GPU (H200)"
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\n")
    assert recipe_needs(bad)[0].startswith("invalid: ")
    main(["doctor", str(ROOT / "recipes" / "cpu-smollm2.yaml")])
    assert "cpu-smollm2.yaml: ready" in capsys.readouterr().out


def test_doctor_says_where_it_looked_for_recipes(tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(tmp_path)
    main(["doctor"])
    out = capsys.readouterr().out
    assert f"no recipes in {tmp_path / 'recipes'}" in out.replace("\n", "")
    assert "trtspec doctor path/to/recipe.yaml" in out.replace("\n", "")
