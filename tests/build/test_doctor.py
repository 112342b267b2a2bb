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


def installed(monkeypatch, release: str | None) -> None:
    """doctor sees ``release`` as the installed tensorrt-llm (None: not installed), importable."""
    import trtspec.build.doctor as doctor
    import trtspec.runtime.trtllm as runtime

    real = doctor.versions()
    monkeypatch.setattr(doctor, "versions", lambda: {**real, "tensorrt_llm": release})
    monkeypatch.setattr(runtime, "release", lambda: release)


def test_machine_names_release_workflows_and_modes(monkeypatch) -> None:
    rows = dict(machine())
    assert rows["TensorRT-LLM workflows"] == "none here (1.2.1 would offer: pytorch, engine)"
    assert rows["TensorRT-LLM modes"].startswith("none here (on 1.2.1: exact")
    installed(monkeypatch, "1.2.1")
    rows = dict(machine())
    assert rows["tensorrt_llm"] == "1.2.1 (supported)"
    assert rows["TensorRT-LLM workflows"].startswith("pytorch (LLM API, trtllm-serve); engine")
    modes = rows["TensorRT-LLM modes"]
    assert "exact (trtspec verifies; exact at T > 0: yes)" in modes
    assert "drafter (trtspec drafts; not run by eval, audit or serve yet" in modes
    assert "NGram yes, Draft_Target audit, Eagle3 audit, MTP audit" in modes
    installed(monkeypatch, "1.3.0rc2")
    rows = dict(machine())
    assert rows["tensorrt_llm"] == "1.3.0rc2 (outside the supported 1.2.x)"
    assert "no engine workflow" in rows["TensorRT-LLM workflows"]
    assert "DraftTarget audit" in rows["TensorRT-LLM modes"]


def test_installed_but_not_importable_is_said(monkeypatch) -> None:
    installed(monkeypatch, "1.2.1")
    import trtspec.runtime.trtllm as runtime

    monkeypatch.setattr(runtime, "release", lambda: None)
    assert dict(machine())["tensorrt_llm"] == ("1.2.1 (supported), but `import tensorrt_llm` "
                                               "fails here")


def test_recipe_features_per_release_workflow_and_mode(tmp_path: Path, monkeypatch) -> None:
    from trtspec.build.doctor import recipe_features

    recipes = ROOT / "recipes"
    assert recipe_features(recipes / "cpu-smollm2.yaml") == []
    [eagle] = recipe_features(recipes / "h200-llama31-8b-eagle3.yaml")
    assert eagle == ("eagle: yes, native Eagle3 (exact at T > 0: audit, allow_advanced_sampling "
                     "set) [TensorRT-LLM 1.2.1 (not installed here)]")
    [medusa] = recipe_features(recipes / "a100-vicuna7b-medusa.yaml")
    assert medusa.startswith("medusa: yes, Medusa engine (exact at T > 0: no")
    draft, ngram = recipe_features(recipes / "h200-llama31-8b-draft1b.yaml")
    assert draft.startswith("draft_model: planned only on engines (TensorRT-LLM runs "
                            "Draft_Target on the pytorch workflow)")
    assert ngram.startswith("ngram: planned only on engines")
    text = (recipes / "h200-llama31-8b-eagle3.yaml").read_text()
    drafter = tmp_path / "drafter.yaml"
    drafter.write_text(text.replace("  - method: eagle\n    model: yuhuili/EAGLE3-LLaMA3.1-"
                                    "Instruct-8B\n    version: 3\n",
                                    "  - method: suffix\n  - method: ngram\n")
                       .replace("workflow: pytorch", "workflow: pytorch\n  mode: drafter"))
    assert [f.split(" [")[0] for f in recipe_features(drafter)] == [
        "suffix: not run by eval, audit or serve yet (its Drafter is built; exact at T > 0 as "
        "the source reads: yes): use backend.mode: exact",
        "ngram: not run by eval, audit or serve yet (its Drafter is built; exact at T > 0 as "
        "the source reads: yes): use backend.mode: exact"]
    installed(monkeypatch, "1.3.0")
    assert recipe_features(recipes / "a100-vicuna7b-medusa.yaml") == [
        "TensorRT-LLM 1.3.0 has no engine workflow: build with TensorRT-LLM 1.2.x, or set "
        "backend.workflow: pytorch"]
    assert "TensorRT-LLM 1.2.x for the engine workflow (installed: 1.3.0, which has none)" in \
        recipe_needs(recipes / "a100-vicuna7b-medusa.yaml")
    [eagle] = recipe_features(recipes / "h200-llama31-8b-eagle3.yaml")
    assert eagle.startswith("eagle: yes, native Eagle3 (exact at T > 0: audit, "
                            "use_rejection_sampling set) [TensorRT-LLM 1.3.0]")
