"""Bad input anywhere in the CLI: one line, exit 2; a trtspec bug: one line, exit 3; never a
traceback, never exit 1 (that is a verdict)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trtspec.cli import main

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes" / "cpu-smollm2.yaml"


def fails(args: list[str], capsys: pytest.CaptureFixture[str], code: int = 2) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    err = capsys.readouterr().err
    assert exit_info.value.code == code, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    return err


@pytest.mark.parametrize(("overrides", "text"), [
    (["sampling.temperature.x=1"], "--set sampling.temperature.x: sampling.temperature is a "
                                   "single value (0.0), not a mapping"),
    (["draft_lengths=["], "--set draft_lengths: the value '[' is not valid YAML"),
    (["target.dtype=fp8"], "target.dtype: fp8 needs TensorRT-LLM (backend.kind: trtllm)"),
    (["target.model=/nope/model"], "target.model: /nope/model: no such model directory or file"),
    (["target.model=./nope"], "target.model: nope: no such model directory or file"),
    (["methods=[{method: draft_model, model: /nope/draft}]"],
     "methods.0.model: /nope/draft: no such model directory or file"),
    (["backend.device=tpu"], "backend.device: 'tpu' is not a torch device"),
])
def test_bad_recipe_values_are_one_line(overrides: list[str], text: str, tmp_path: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    sets = [a for o in overrides for a in ("--set", o)]
    assert text in fails(["build", str(RECIPE), "--engines", str(tmp_path), *sets], capsys)
    assert not (tmp_path / "cpu-smollm2").exists()


def test_a_cuda_device_on_a_machine_without_one(tmp_path: Path, monkeypatch,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    err = fails(["build", str(RECIPE), "--engines", str(tmp_path), "--set",
                 "backend.device=cuda:7"], capsys)
    assert "backend.device: cuda:7, but this machine has no CUDA GPU" in err


def test_folders_that_are_not_evals(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    for command in ("decide", "audit"):
        assert "is not an eval folder (no recipe.yaml)" in fails([command, str(empty)], capsys)
    assert "eval.json" in fails(["sync", str(empty)], capsys)
    half = tmp_path / "half"  # started, killed before the first record
    half.mkdir()
    (half / "recipe.yaml").write_text(RECIPE.read_text())
    (half / "eval.json").write_text(json.dumps({"overrides": []}))
    assert "no records.jsonl (`trtspec eval` writes it" in fails(
        ["decide", str(half), "--no-mlflow"], capsys)
    (half / "records.jsonl").write_text("")
    assert "has no records yet: resume the eval" in fails(["decide", str(half), "--no-mlflow"],
                                                          capsys)


def test_an_unexpected_error_is_a_bug_report_not_a_verdict(monkeypatch,
                                                           capsys: pytest.CaptureFixture[str]
                                                           ) -> None:
    import trtspec.build

    def broken(*args, **kwargs):
        raise KeyError("draft")

    monkeypatch.setattr(trtspec.build, "build", broken)
    err = fails(["build", str(RECIPE)], capsys, code=3)
    assert "internal error: KeyError: 'draft' (a trtspec bug; TRTSPEC_DEBUG=1" in err


@pytest.mark.parametrize(("overrides", "text"), [
    (["backend.kind=trtllm"], "backend: kind trtllm takes no device (a key of kind torch): "
                              "remove backend.device from the recipe"),
    (["methods.0.method=layer_skip"], "methods.0: method layer_skip takes no min_n, max_n (keys "
                                      "of method ngram): remove methods.0.min_n, methods.0.max_n "
                                      "from the recipe; layer_skip needs layers"),
    (["backend.tp_size=2"], "backend.tp_size: unknown key (did you mean target.tp_size?)"),
    (["targt.model=x"], "targt.model: unknown key (did you mean target.model?)"),
    (["sampling.temprature=0.5"], "sampling.temprature: unknown key (did you mean "
                                  "sampling.temperature?)"),
    (["limits.max_batch=4"], "limits.max_batch: unknown key (did you mean limits.max_batch_size?)"),
    (["limits.qqq=4"], "limits.qqq: unknown key (limits takes max_batch_size, max_input_len, "
                       "max_seq_len, max_num_tokens)"),
])
def test_keys_that_do_not_fit_say_how_to_fix_them(overrides: list[str], text: str,
                                                  tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """The recipe is checked before anything else (a trtllm backend on a machine without a GPU
    would otherwise ask for --gpu first)."""
    sets = [a for o in overrides for a in ("--set", o)]
    err = fails(["build", str(RECIPE), "--dry-run", "--engines", str(tmp_path), *sets], capsys)
    assert f"error: {RECIPE}: {text}" in err
