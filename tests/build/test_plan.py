"""Plans: golden shell for every shipped recipe; every emitted TensorRT-LLM flag is a 1.2.x flag."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from trtspec.build import build
from trtspec.gpu import d0, sweep_around

ROOT = Path(__file__).resolve().parents[2]
RECIPES = sorted((ROOT / "recipes").glob("*.yaml"))
GOLDEN = Path(__file__).parent / "golden"

# TensorRT-LLM 1.2.x: flags of trtllm-build and of the convert_checkpoint scripts
BUILD_FLAGS = {"--checkpoint_dir", "--output_dir", "--max_batch_size", "--max_input_len",
               "--max_seq_len", "--max_num_tokens", "--max_beam_width", "--workers",
               "--gemm_plugin", "--gpt_attention_plugin", "--use_paged_context_fmha",
               "--speculative_decoding_mode", "--max_draft_len", "--gather_generation_logits",
               "--gather_context_logits", "--gather_all_token_logits", "--logits_dtype"}
CONVERT_FLAGS = {"--model_dir", "--output_dir", "--dtype", "--tp_size", "--pp_size", "--workers",
                 "--medusa_model_dir", "--num_medusa_heads", "--eagle_model_dir",
                 "--max_draft_len", "--num_eagle_layers", "--max_non_leaves_per_layer"}
MODES = {"draft_tokens_external", "lookahead_decoding", "medusa", "explicit_draft_tokens", "eagle"}


def plan_for(path: Path, *overrides: str):
    return build(path, overrides, dry_run=True, engines_root="engines", say=lambda _: None).plan


@pytest.mark.parametrize("path", RECIPES, ids=[p.stem for p in RECIPES])
def test_plan_matches_golden(path: Path) -> None:
    text = plan_for(path).shell()
    golden = GOLDEN / f"{path.stem}.sh"
    if os.environ.get("UPDATE_GOLDEN"):
        golden.parent.mkdir(exist_ok=True)
        golden.write_text(text)
    assert golden.is_file(), f"no golden plan: run UPDATE_GOLDEN=1 pytest {__file__}"
    assert text == golden.read_text()


@pytest.mark.parametrize("path", RECIPES, ids=[p.stem for p in RECIPES])
def test_every_emitted_trtllm_flag_is_a_1_2_flag(path: Path) -> None:
    trtllm = "kind: trtllm" in path.read_text()
    overrides = ("target.tp_size=2", "gpu.count=2") if trtllm else ()  # exercise --workers too
    for step in plan_for(path, *overrides).steps:
        argv = list(step.argv)
        if not argv or step.kind != "run":
            continue
        if argv[0] == "trtllm-build":
            allowed = BUILD_FLAGS
        elif argv[0] == "python" and argv[1].endswith("convert_checkpoint.py"):
            allowed = CONVERT_FLAGS
        else:
            continue
        flags = {a for a in argv if a.startswith("--")}
        assert flags <= allowed, \
            f"{step.name}: {sorted(flags - allowed)} not a TensorRT-LLM 1.2.x flag"
        if "--speculative_decoding_mode" in argv:
            assert argv[argv.index("--speculative_decoding_mode") + 1] in MODES


@pytest.fixture(autouse=True)
def no_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests describe a machine without an NVIDIA GPU, whatever machine runs them (GPU
    behaviour has its own tests in tests/gpu/)."""
    import trtspec.gpu

    monkeypatch.setattr(trtspec.gpu, "detect", lambda: [])


def test_draft_target_engines_have_the_right_flags() -> None:
    plan = plan_for(ROOT / "recipes" / "h200-llama31-8b-draft1b.yaml")
    steps = {s.name: s.argv for s in plan.steps}
    spec = steps["build target-spec"]
    for flag in ("draft_tokens_external", "--use_paged_context_fmha", "--gather_generation_logits"):
        assert flag in spec
    assert spec[spec.index("--max_draft_len") + 1] == "31"  # max of the auto sweep
    assert "--gather_generation_logits" in steps["build draft"]
    assert "--speculative_decoding_mode" not in steps["build target"]  # the baseline engine
    assert plan.draft_lengths == [2, 4, 7, 15, 31]


def test_tensor_parallel_adds_workers_and_mpirun_note() -> None:
    plan = plan_for(ROOT / "recipes" / "h200-llama31-8b-draft1b.yaml", "target.tp_size=4",
                    "gpu.count=4")
    convert = next(s.argv for s in plan.steps if s.name == "convert target")
    assert convert[convert.index("--tp_size") + 1] == "4" and "--workers" in convert
    assert any("mpirun -n 4" in n for n in plan.notes)


def test_pytorch_workflow_writes_speculative_config_yaml() -> None:
    plan = plan_for(ROOT / "recipes" / "h200-llama31-8b-eagle3.yaml")
    writes = {Path(s.path).name: s.content for s in plan.steps if s.kind == "write"}
    assert set(writes) == {"baseline.yaml", "eagle-d2.yaml", "eagle-d3.yaml", "eagle-d4.yaml",
                           "eagle-d6.yaml"}
    assert "decoding_type: Eagle" in writes["eagle-d4.yaml"]
    assert "max_draft_len: 4" in writes["eagle-d4.yaml"]
    assert "disable_overlap_scheduler: true" in writes["eagle-d4.yaml"]
    assert "speculative_config" not in writes["baseline.yaml"]


def test_gpu_flag_plans_for_another_gpu() -> None:
    plan = plan_for(ROOT / "recipes" / "l40s-llama31-8b-ngram.yaml")
    other = build(ROOT / "recipes" / "l40s-llama31-8b-ngram.yaml", gpu="B200", dry_run=True,
                  say=lambda _: None).plan
    assert plan.gpu.name == "L40S" and other.gpu.name == "B200"
    assert str(other.out_dir).endswith("l40s-llama31-8b-ngram/b200")


def test_d0_for_llama_3_1_8b_is_31_with_its_derivation(capsys) -> None:
    value, text = d0(32, 8)
    assert value == 31
    assert text == ("G = num_attention_heads / num_key_value_heads = 32 / 8 = 4; "
                    "D₀ = 128/G − 1 = 32 − 1 = 31")
    assert d0(32, 32)[0] == 63 and "clamped to 63" in d0(32, 32)[1]  # MHA: 127 → 63
    assert sweep_around(31) == [2, 4, 7, 15, 31]
    build(ROOT / "recipes" / "h100-llama31-8b-draft1b.yaml", dry_run=True)
    assert "D₀ = 31  (G = num_attention_heads / num_key_value_heads = 32 / 8 = 4;" in \
        capsys.readouterr().out
