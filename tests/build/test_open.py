"""Opening a build in-process on TensorRT-LLM's LLM API (mode exact), against the test-only
stand-in of TensorRT-LLM 1.2.1 (tests/standin/, toy models: nothing measured is TensorRT-LLM's),
and the one-line refusals where it cannot run here."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import trtspec.build.open as opened
import trtspec.runtime.trtllm as trtllm
from trtspec.cli import main
from trtspec.runtime.toy import MarkovLM

VOCAB = 32


class Letters:
    """A tokenizer of one id per character (mod VOCAB): enough to encode prompts for a toy."""

    name_or_path, chat_template, eos_token_id = "letters", None, None

    def __call__(self, text: str) -> dict:
        return {"input_ids": [ord(c) % VOCAB for c in text] or [0]}

    def decode(self, ids, **_) -> str:
        return "".join(chr(97 + i % 26) for i in ids)

    def get_vocab(self) -> dict:
        return {chr(97 + i % 26) + str(i): i for i in range(VOCAB)}


def mode(recipe: Path, value: str) -> Path:
    """The built recipe with backend.mode set (chosen at run time: the build stays valid)."""
    recipe.write_text(recipe.read_text().replace("  workflow: pytorch\n",
                                                 f"  workflow: pytorch\n  mode: {value}\n"))
    return recipe


@pytest.mark.parametrize("command", ["eval", "audit", "serve"])
def test_without_tensorrt_llm_the_in_process_entry_points_exit_2_naming_it(
        trtllm_build, command: str, capsys) -> None:
    if trtllm.tensorrt_llm is not None:
        pytest.skip("TensorRT-LLM is installed here")
    recipe, engines = trtllm_build()
    with pytest.raises(SystemExit) as e:
        main([command, str(mode(recipe, "exact")), "--engines", str(engines)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and len(err.strip().splitlines()) == 1, err
    assert "trtspec[trtllm]" in err and "docs/gpu.md" in err


@pytest.mark.parametrize("value", ["native", "drafter"])
def test_modes_that_run_in_tensorrt_llms_own_server_say_where_they_run(
        trtllm_build, value: str, capsys) -> None:
    recipe, engines = trtllm_build()
    with pytest.raises(SystemExit) as e:
        main(["eval", str(mode(recipe, value)), "--engines", str(engines)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and len(err.strip().splitlines()) == 1, err
    assert "backend.mode exact" in err or "backend.mode: exact" in err


def test_exact_mode_audits_end_to_end_on_the_standin(trtllm_build, trtllm_standin, tmp_path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """`trtspec audit` on a TensorRT-LLM recipe in mode exact, on its built-in long prompt
    (which the scheduler keeps in its slot between samples): trtspec's sampler verifies the
    stand-in's raw context logits, and the audit passes on the toy target."""
    from tensorrt_llm.llmapi import MODELS

    recipe, engines = trtllm_build()
    MODELS["toy/standin-target"] = MarkovLM(vocab_size=VOCAB, order=2, seed=5)
    monkeypatch.setattr(opened.TrtllmBuild, "tokenizer", Letters())
    monkeypatch.setattr(opened, "vocab_size", lambda llm, model: VOCAB)
    out = tmp_path / "audit"
    with pytest.raises(SystemExit) as e:
        main(["audit", str(mode(recipe, "exact")), "--engines", str(engines), "--samples", "400",
              "--out", str(out)])
    report = json.loads((out / "audit.json").read_text())
    assert e.value.code in (0, 1)  # 1: a weak PASS at 400 samples, never a FAIL here
    ngram = report["methods"]["ngram"]
    assert ngram["passed"] and ngram["prompts"][0]["samples"] == 400
    assert ngram["prompts"][0]["kept_prompt"]  # the path where a slot keeps its prompt
    assert ngram["prompts"][0]["speculated"] > 0  # drafts were verified, through context logits


def test_exact_mode_evals_and_decides_end_to_end_on_the_standin(
        trtllm_build, trtllm_standin, tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`trtspec eval` then `decide` on a TensorRT-LLM recipe in mode exact: both arms run the
    stand-in LLM through trtspec's executor (plain decoding and ngram at D 2 and 4)."""
    from tensorrt_llm.llmapi import MODELS

    recipe, engines = trtllm_build()
    MODELS["toy/standin-target"] = MarkovLM(vocab_size=VOCAB, order=2, seed=5)
    monkeypatch.setattr(opened.TrtllmBuild, "tokenizer", Letters())
    monkeypatch.setattr(opened, "vocab_size", lambda llm, model: VOCAB)
    main(["eval", str(mode(recipe, "exact")), "--engines", str(engines), "--reports",
          str(tmp_path / "reports"), "--eval-id", "exact", "--num-prompts", "4", "--no-mlflow"])
    out = tmp_path / "reports" / "exact"
    records = [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]
    assert {r["condition"] for r in records} == {"ngram/D2/c1", "ngram/D4/c1"}
    assert any(r["proposed_tokens"] for r in records if r["arm"] == "spec")
    with pytest.raises(SystemExit) as e:  # 0 or 1: a verdict, never an error
        main(["decide", str(out)])
    assert e.value.code in (0, 1) and (out / "report.md").is_file()
