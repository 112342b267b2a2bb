"""`trtspec build` on this machine: the CPU recipe converts, writes a manifest, is a no-op the
second time; edited manifests are refused; TensorRT-LLM builds refuse clearly without a GPU."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import copy_build

from trtspec.build import build
from trtspec.build.manifest import ManifestError, check_gpu, load_manifest
from trtspec.cli import main

ROOT = Path(__file__).resolve().parents[2]
CPU_RECIPE = ROOT / "recipes" / "cpu-smollm2.yaml"


@pytest.fixture(autouse=True)
def no_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests describe a machine without an NVIDIA GPU, whatever machine runs them (GPU
    behaviour has its own tests in tests/gpu/)."""
    import trtspec.build.gpu

    monkeypatch.setattr(trtspec.build.gpu, "detect", lambda: [])


def test_cpu_recipe_builds_then_is_a_no_op(tmp_path: Path, cpu_build) -> None:
    """The session's build (conftest.cpu_build: `build` of the CPU recipe into a fresh
    folder, as here), then builds of a private copy of it."""
    engines, first = cpu_build
    path = engines / "cpu-smollm2" / "cpu" / "manifest.json"
    assert first["manifest_path"] == str(path) and path.is_file() and not first["up_to_date"]
    assert any(m.startswith("round cost: t(B, W)/t(1, 1) for B = 1 … 4 rows × W = 1 … 9 "
                            "tokens, measured in ") for m in first["messages"])
    copy_build(cpu_build, tmp_path)
    path = tmp_path / "cpu-smollm2" / "cpu" / "manifest.json"
    manifest = load_manifest(path)
    assert manifest.backend == "torch" and manifest.gpu is None
    assert manifest.draft_lengths == [2, 4] and manifest.d0 == 41
    target = manifest.artifact("target")
    assert (Path(target.path) / "model.safetensors").is_file()
    assert target.vocab_size == 49152 and target.num_layers == 30
    assert target.config_digest and target.tokenizer_digest
    assert manifest.artifact("layer_skip-24").flags == {"layers": 24}
    if not (ROOT / "heads" / "smollm2-135m-eagle3" / "config.json").exists():  # `make heads`
        assert "make heads" in manifest.left_out()["eagle"]  # left out, saying how to train it
    assert manifest.versions["torch"] and manifest.versions["tensorrt_llm"] is None
    curve = manifest.cost_curve  # the adaptive draft length's costs: T = 1 … K + 1 (K = 8)
    assert sorted(curve.target) == list(range(1, 10)) and set(curve.draft) == {"layer_skip"}
    assert min(curve.target.values()) > 0 and curve.device == "cpu"
    # the round cost: B = 1 … max_batch_size (4) rows × W = 1 … K + 1 tokens, and its time
    assert sorted(curve.rounds) == [1, 2, 3, 4]
    assert all(sorted(ws) == list(range(1, 10)) for ws in curve.rounds.values())
    assert min(min(ws.values()) for ws in curve.rounds.values()) > 0
    assert curve.rounds_seconds > 0 and curve.round_cost().time(1, 1) == 1.0
    created = manifest.created

    messages: list[str] = []
    second = build(CPU_RECIPE, engines_root=tmp_path, say=messages.append)
    assert second.up_to_date and second.manifest.created == created
    assert any(m.startswith("up to date") for m in messages)
    messages.clear()
    forced = build(CPU_RECIPE, engines_root=tmp_path, force=True, say=messages.append)
    assert not forced.up_to_date and forced.manifest.created != created
    assert any(m.startswith("round cost: t(B, W)/t(1, 1) for B = 1 … 4 rows × W = 1 … 9 "
                            "tokens, measured in ") for m in messages)
    assert sum(m.startswith("  B = ") for m in messages) == 4
    # what the artefacts do not depend on never rebuilds: sampling, eval, decide, a subset of
    # the methods, and (on the torch backend, which compiles nothing) limits and draft lengths
    for edit in (["sampling.temperature=0.7", "eval.per_category=3", "decide.min_speedup=1.2"],
                 ["methods=[{method: ngram, min_n: 1, max_n: 3}]", "draft_lengths=[3]"],
                 ["limits.max_batch_size=2"]):
        assert build(CPU_RECIPE, edit, engines_root=tmp_path, say=lambda _: None).up_to_date
    # what it does depend on builds into its own folder, beside the recipe as written
    for edit in (["target.dtype=bfloat16"], ["methods.1.layers=20"]):  # a method's own settings
        messages.clear()
        changed = build(CPU_RECIPE, edit, engines_root=tmp_path, say=messages.append)
        assert not changed.up_to_date and changed.manifest_path.parent.parent == path.parent.parent
        assert changed.manifest_path.parent.name.startswith("cpu-")
        moved = changed.manifest_path.parent
        assert f"--set changes what is built: writing {moved}/ (the recipe as written builds " \
            f"into {path.parent}/)" in messages
    assert load_manifest(path).created == forced.manifest.created  # untouched


def test_an_edited_recipe_replaces_its_build_and_says_why(tmp_path: Path, cpu_build) -> None:
    recipe = tmp_path / "cpu-smollm2.yaml"
    recipe.write_text(CPU_RECIPE.read_text())
    engines = copy_build(cpu_build, tmp_path / "engines")  # the recipe as written: built
    first = build(recipe, engines_root=engines, say=lambda _: None)
    assert first.up_to_date
    recipe.write_text(CPU_RECIPE.read_text().replace("dtype: float32", "dtype: bfloat16"))
    messages: list[str] = []
    second = build(recipe, engines_root=engines, say=messages.append)
    assert second.manifest_path == first.manifest_path and not second.up_to_date
    assert f"replacing {first.manifest_path}: it was built for other settings (target.dtype: " \
        "built float32, recipe bfloat16)" in messages


def test_manifest_edited_to_another_compute_capability_is_refused(tmp_path: Path,
                                                                  cpu_build) -> None:
    copy_build(cpu_build, tmp_path)
    path = tmp_path / "cpu-smollm2" / "cpu" / "manifest.json"
    data = json.loads(path.read_text())
    data["gpu"] = {"name": "H200", "compute_capability": "9.0", "driver": "580.82",
                   "count": 1, "detected": True}
    path.write_text(json.dumps(data))
    manifest = load_manifest(path)
    with pytest.raises(ManifestError) as err:
        check_gpu(manifest, [], path)  # a machine without an NVIDIA GPU
    assert str(err.value) == (
        f"{path}: built for H200 (compute capability 9.0), but this machine has no NVIDIA GPU: "
        "run it on that GPU or rebuild for this machine")


def test_corrupt_manifest_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "manifest.json").write_text('{"recipe": 3}')
    with pytest.raises(ManifestError, match="not a valid trtspec manifest"):
        load_manifest(tmp_path)
    with pytest.raises(ManifestError, match="no manifest here"):
        load_manifest(tmp_path / "nowhere")


def test_engine_build_refuses_without_tensorrt_llm(tmp_path: Path, capsys) -> None:
    import importlib.util

    if importlib.util.find_spec("tensorrt_llm") is not None:
        pytest.skip("tensorrt_llm is installed here")
    with pytest.raises(SystemExit) as exit_info:
        main(["build", str(ROOT / "recipes" / "h200-llama31-8b-draft1b.yaml"),
              "--engines", str(tmp_path)])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2
    assert "cannot build for TensorRT-LLM: TensorRT-LLM is not importable" in err
    assert "trtspec[trtllm]" in err and "docs/gpu.md" in err and len(err.splitlines()) == 1
    assert "--dry-run" in err and "Traceback" not in err


def test_dry_run_prints_copy_pasteable_shell(tmp_path: Path, capsys) -> None:
    main(["build", str(ROOT / "recipes" / "a100-vicuna7b-medusa.yaml"), "--dry-run"])
    out = capsys.readouterr().out
    assert out.startswith("#!/usr/bin/env bash") and "set -euo pipefail" in out
    assert "--speculative_decoding_mode medusa" in out and "$TRTLLM_EXAMPLES/medusa/" in out


def test_an_aliased_gpu_name_finds_the_build_where_build_put_it(tmp_path: Path) -> None:
    from trtspec.build.manifest import GpuInfo, Manifest, open_built
    from trtspec.build.recipe import load_recipe

    recipe = load_recipe(ROOT / "recipes" / "h100-llama31-8b-draft1b.yaml", ["gpu.name=H100-SXM"])
    Manifest(recipe=recipe.name, recipe_digest=recipe.digest(), backend="trtllm", versions={},
             gpu=GpuInfo(name="H100", compute_capability="9.0", detected=False),
             draft_lengths=[4], artifacts=[]).save(tmp_path / recipe.name / "h100")
    with pytest.raises(ManifestError, match=r"built for H100 .* no NVIDIA GPU"):  # found it
        open_built(recipe, "recipe.yaml", tmp_path)


TINY_RECIPE = """\
name: tiny
target: {{model: {model}, dtype: float32}}
methods: [{{method: ngram}}, {{method: layer_skip, layers: 1}}]
draft_lengths: [2]
backend: {{kind: torch, device: cpu}}
"""


class Replaced(RuntimeError):
    """Stops a build at the line saying it replaces the one there (the test needs only why)."""


class Opened(RuntimeError):
    """Stops eval / audit right after they found their build (the test only needs where)."""


def test_set_builds_coexist_and_eval_finds_each(tmp_path: Path, monkeypatch, capsys) -> None:
    """Through the CLI: a --set that changes the build writes its own folder; eval and audit
    with the same --set open it, without --set the recipe as written's; nothing is replaced."""
    from conftest import tiny_llama

    import trtspec.build.manifest

    model = tmp_path / "tiny-llama"
    tiny_llama().save_pretrained(model)
    recipe = tmp_path / "tiny.yaml"
    recipe.write_text(TINY_RECIPE.format(model=model))
    engines = tmp_path / "engines"
    bf16 = ["--set", "target.dtype=bfloat16"]
    base = ["--engines", str(engines)]

    main(["build", str(recipe), *base])
    plain = engines / "tiny" / "cpu"
    main(["build", str(recipe), *base, *bf16])
    out = capsys.readouterr().out
    [moved] = [p for p in (engines / "tiny").iterdir() if p != plain]
    assert moved.name.startswith("cpu-") and len(moved.name) == len("cpu-") + 8
    assert f"--set changes what is built: writing {moved}/ (the recipe as written builds into " \
           f"{plain}/)" in out
    assert load_manifest(plain).build_inputs["target"]["dtype"] == "float32"
    assert load_manifest(moved).build_inputs["target"]["dtype"] == "bfloat16"
    main(["build", str(recipe), *base])  # both stay current: neither replaced the other
    main(["build", str(recipe), *base, *bf16])
    assert capsys.readouterr().out.count("up to date:") == 2

    real, opened = trtspec.build.manifest.open_built, []

    def spy(*args, **kwargs):
        opened.append(real(*args, **kwargs)[1])
        raise Opened("found it")

    monkeypatch.setattr(trtspec.build.manifest, "open_built", spy)
    subset = ["--set", "methods=[{method: ngram}]", "--set", "sampling.temperature=0.5"]
    for args, folder in [([], plain), (bf16, moved), (subset, plain), ([*bf16, *subset], moved)]:
        for command in (["eval", str(recipe), *base, "--no-mlflow"], ["audit", str(recipe), *base]):
            with pytest.raises(SystemExit) as exit_info:
                main([*command, *args])
            assert exit_info.value.code == 2 and "found it" in capsys.readouterr().err
            assert opened.pop() == folder / "manifest.json", (command, args)

    monkeypatch.setattr(trtspec.build.manifest, "open_built", real)
    with pytest.raises(SystemExit) as exit_info:  # overrides nobody built
        main(["eval", str(recipe), *base, "--set", "target.dtype=float16", "--no-mlflow"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "Traceback" not in err
    assert f"no build in {engines / 'tiny'}/cpu-" in err and "target.dtype: built float32, " \
        "recipe float16" in err


@pytest.mark.compile
def test_a_compiled_build_records_its_runner_and_eval_reuses_its_cache(tmp_path: Path,
                                                                        capsys,
                                                                        monkeypatch) -> None:
    """The default runner: build compiles into the build folder's inductor cache and says how
    long it took; eval's runner is that kind, reading that cache, with transformers' logits. A
    build whose cost curve was measured otherwise than the runner now runs (weights prepacked,
    a wide call's attention packed), or that did not record it, is warned about; one that
    measured attention otherwise, or did not record it, is replaced by `build`."""
    import os

    import torch
    from conftest import tiny_llama
    from transformers import AutoTokenizer

    from trtspec.build.open import OpenBuild
    from trtspec.build.recipe import load_recipe
    from trtspec.runtime.kinds import runner_kind
    from trtspec.runtime.models import resolve

    model = tmp_path / "tiny-llama"
    tiny = tiny_llama()
    tiny.save_pretrained(model)  # eval and serve open the build with its tokenizer
    AutoTokenizer.from_pretrained(resolve("smollm2-135m-instruct")).save_pretrained(model)
    recipe = tmp_path / "tiny.yaml"
    recipe.write_text(TINY_RECIPE.format(model=model))
    main(["build", str(recipe), "--engines", str(tmp_path / "engines")])
    assert "compiled in" in capsys.readouterr().out
    built = load_manifest(tmp_path / "engines" / "tiny" / "cpu")
    assert built.runner is not None and built.runner.kind == "compiled"
    assert built.runner.compile_seconds > 0 and built.runner.note is None
    cache = Path(built.runner.cache_dir)
    assert cache == (tmp_path / "engines" / "tiny" / "cpu" / "inductor").resolve()
    assert any(cache.rglob("*")), "nothing cached"
    assert built.cost_curve is not None and "layer_skip" in built.cost_curve.draft

    assert built.runner.prepacked  # float32 on this CPU: the curve above is a prepacked one
    said: list[str] = []
    runner = OpenBuild(load_recipe(recipe), built, said.append).target_runner()
    assert runner_kind(runner) == "compiled" and runner.prepacked
    assert not any("prepacked" in line for line in said)
    old = built.model_copy(update={"runner": built.runner.model_copy(update={"prepacked": None})})
    OpenBuild(load_recipe(recipe), old, said.append).target_runner()  # a build from before
    assert any("cost curve with the weights not prepacked" in line and "build --force" in line
               for line in said)
    # a wide call's attention packed (4 query heads over 2 on this CPU): recorded, and a build
    # that did not record it, or recorded otherwise, is told to measure again
    assert built.runner.packed_attention and runner.packed_attention
    opened = OpenBuild(load_recipe(recipe), built, said.append)
    unpacked = SimpleNamespace(prepacked=True, packed_attention=False)  # a runner that is not
    for now, then, wording in ((runner, True, None), (runner, None, "did not record whether"),
                               (runner, False, "heads not packed in calls"),
                               (unpacked, True, "heads packed in calls of 2+ tokens a row and "
                                                "they are not now"),
                               (unpacked, None, None), (unpacked, False, None)):
        said.clear()
        opened._runner = now
        opened._check_cost_curve(built.runner.model_copy(update={"packed_attention": then}))
        assert said == [] if wording is None else (
            len(said) == 1 and wording in said[0] and "build --force" in said[0]), said
    # and building again replaces such a build instead of calling it up to date
    path = tmp_path / "engines" / "tiny" / "cpu" / "manifest.json"
    recorded = json.loads(path.read_text())

    def stop(line: str) -> None:  # the replacement's reason is all this needs, not its build
        if line.startswith("replacing"):
            raise Replaced(line)

    import trtspec.runtime.decoder_layer

    assert build(recipe, engines_root=tmp_path / "engines", say=stop).up_to_date
    cases = ((True, None, "did not record whether its cost curve was measured with grouped "
                          "query heads packed in calls of 2+ tokens a row, as they are now (an "
                          "older trtspec)"),
             (True, False, "measured its cost curve with grouped query heads not packed in "
                           "calls of 2+ tokens a row, and they are now"),
             (False, True, "measured its cost curve with grouped query heads packed in calls "
                           "of 2+ tokens a row, and they are not now"),
             (False, None, None), (False, False, None))  # not packing now: nothing to redo
    with monkeypatch.context() as patch:
        try:
            for packs, then, reason in cases:
                patch.setattr(trtspec.runtime.decoder_layer, "PACK_GQA", packs)
                path.write_text(json.dumps({**recorded, "runner": {**recorded["runner"],
                                                                   "packed_attention": then}}))
                if reason is None:
                    assert build(recipe, engines_root=tmp_path / "engines", say=stop).up_to_date
                    continue
                with pytest.raises(Replaced) as replaced:
                    build(recipe, engines_root=tmp_path / "engines", say=stop)
                assert str(replaced.value) == f"replacing {path}: it {reason}"
        finally:
            path.write_text(json.dumps(recorded))
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(cache)
    with torch.inference_mode():
        want = tiny(torch.tensor([[1, 2, 3]])).logits[0, -1]
    assert (runner.prefill([[1, 2, 3]])[0] - want).abs().max() < 1e-4
