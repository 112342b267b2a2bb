"""Medusa and EAGLE-3 heads on the path users run: `trtspec build` loads them against the target
(or leaves the method out and says how to train it), `trtspec eval` opens them through the
build, and a bad checkpoint is one line and exit 2 before anything runs."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from trtspec.build.manifest import load_manifest
from trtspec.build.open import open_build
from trtspec.cli import main
from trtspec.eval.run import read_records
from trtspec.spec.propose.heads.eagle import Eagle3Draft, EagleProposer, save_eagle3
from trtspec.spec.propose.heads.medusa import MedusaHeads, MedusaProposer, save_medusa

ROOT = Path(__file__).resolve().parents[2]
RECIPE = str(ROOT / "recipes" / "cpu-smollm2.yaml")
SMALL = ("draft_lengths=[2]", "sampling.max_tokens=12", "eval.concurrency=[1]",
         "eval.warmup=1", "eval.per_category=null", "limits.max_batch_size=2")


def sets(*extra: str) -> list[str]:
    return [a for s in (*SMALL, *extra) for a in ("--set", s)]


@pytest.fixture(scope="module")
def heads(tmp_path_factory, smollm2) -> tuple[Path, Path]:
    """Random-weight heads for SmolLM2 in the public layouts (EAGLE-3 over a 2048-id draft
    vocabulary; two Medusa heads sharing the target's LM head)."""
    root = tmp_path_factory.mktemp("heads")
    torch.manual_seed(0)
    model = smollm2.model
    save_eagle3(Eagle3Draft.from_target(model, draft_vocab=torch.arange(2048)), root / "eagle")
    hidden, vocab = model.config.hidden_size, model.config.vocab_size
    medusa = MedusaHeads(hidden, vocab, 2, 1, lm_head=model.get_output_embeddings(),
                         shared=[True, True])
    save_medusa(medusa, root / "medusa", "smollm2-135m-instruct", keep_shared=True)
    return root / "eagle", root / "medusa"


def test_heads_build_and_eval_through_the_build(tmp_path: Path, heads, capsys) -> None:
    eagle, medusa = heads
    methods = (f"methods=[{{method: eagle, model: {eagle}}}, "
               f"{{method: medusa, heads: {medusa}, num_heads: 2}}]")
    engines = str(tmp_path / "engines")
    main(["build", RECIPE, "--engines", engines, *sets(methods)])
    manifest = load_manifest(next((tmp_path / "engines").glob("*/*/manifest.json")))
    assert manifest.left_out() == {}
    assert manifest.artifact("eagle").role == "heads" and manifest.artifact("eagle").config_digest
    assert manifest.artifact("medusa").path == str(medusa.resolve())
    build, _ = open_build(RECIPE, ["draft_lengths=[2]", "limits.max_batch_size=2", methods],
                          engines_root=engines)
    assert isinstance(build.proposer("eagle"), EagleProposer)
    assert isinstance(build.proposer("medusa"), MedusaProposer)

    workload = tmp_path / "w.jsonl"
    prompts = ["Repeat exactly: the red fox jumps over the lazy dog.", "Name a colour.",
               "Say hello twice.", "Count to five."]
    workload.write_text("".join(json.dumps({"id": f"r{i}", "category": "c" + str(i % 2),
                                            "prompt": p}) + "\n" for i, p in enumerate(prompts)))
    main(["eval", RECIPE, "--engines", engines, "--reports", str(tmp_path / "reports"),
          "--eval-id", "h", "-w", str(workload), "--no-mlflow", *sets(methods)])
    records = read_records(tmp_path / "reports" / "h")
    assert {r["condition"] for r in records} == {"eagle/D2/c1", "medusa/D2/c1"}
    by = {(r["condition"], r["request_id"], r["arm"]): r for r in records}
    for (condition, request, arm), r in by.items():  # greedy: the heads change no token
        if arm == "spec":
            assert r["output_token_ids"] == by[(condition, request, "baseline")]["output_token_ids"]
            assert r["proposed_tokens"] > 0
    assert "eagle/D2/c1" in capsys.readouterr().out


def test_a_bad_checkpoint_fails_the_build_in_one_line(tmp_path: Path, heads, capsys) -> None:
    eagle, _ = heads
    broken = tmp_path / "broken"
    shutil.copytree(eagle, broken)
    tensors = load_file(str(broken / "model.safetensors"))
    del tensors["fc.weight"]
    save_file(tensors, str(broken / "model.safetensors"))
    with pytest.raises(SystemExit) as exit_info:
        main(["build", RECIPE, "--engines", str(tmp_path / "engines"),
              *sets(f"methods=[{{method: eagle, model: {broken}}}]")])
    assert exit_info.value.code == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert len(errors) == 1 and errors[0].startswith("error: ") and \
        "tensor fc.weight is missing" in errors[0], errors  # one line, no traceback


def test_missing_heads_are_left_out_with_how_to_train_them(tmp_path: Path, capsys) -> None:
    """The CPU recipe as written names an EAGLE head that `make heads` trains: until then the
    build leaves it out, eval runs the other methods, and asking for it says how to get it."""
    gone = tmp_path / "not-trained"
    methods = f"methods=[{{method: ngram}}, {{method: eagle, model: {gone}}}]"
    engines = str(tmp_path / "engines")
    main(["build", RECIPE, "--engines", engines, *sets(methods)])
    assert "note: eagle left out of this build: no heads at" in capsys.readouterr().out
    build, _ = open_build(RECIPE, ["draft_lengths=[2]", "limits.max_batch_size=2", methods],
                          engines_root=engines)
    assert build.method_names == ["ngram"]
    with pytest.raises(ValueError, match=r"method eagle is not in this build: no heads at .*"
                                         r"trtspec distill"):
        build.proposer("eagle")
    # once trained, the next build picks them up
    gone.mkdir()
    (gone / "config.json").write_text("{}")
    messages: list[str] = []
    from trtspec.build import build as run_build

    with pytest.raises(ValueError):  # an empty config: the heads are read, and refused
        run_build(RECIPE, [*SMALL, methods], engines_root=engines, say=messages.append)
    assert any("left out eagle, whose heads are there now" in m for m in messages)
