"""Plans: golden shell for every shipped recipe; every emitted TensorRT-LLM flag is a 1.2.x flag;
every plan ends with commands that exist (trtspec's own, trtllm-serve's 1.2.x flags)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml
from trtllm_fields import check_config

from trtspec.build import build
from trtspec.build.gpu import d0, sweep_around

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
# TensorRT-LLM 1.2.x: the trtllm-serve flags a plan's "next" section may use
SERVE_FLAGS = {"--tokenizer", "--backend", "--tp_size", "--pp_size", "--extra_llm_api_options",
               "--port", "--host"}


def plan_for(path: Path, *overrides: str):
    return build(path, overrides, dry_run=True, engines_root="engines", say=lambda _: None).plan


@pytest.mark.parametrize("path", RECIPES, ids=[p.stem for p in RECIPES])
def test_plan_matches_golden(path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)  # the plan repeats the recipe path as passed: keep it relative
    text = plan_for(path.relative_to(ROOT)).shell()
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
    import trtspec.build.gpu

    monkeypatch.setattr(trtspec.build.gpu, "detect", lambda: [])


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
    spec = yaml.safe_load(writes["eagle-d4.yaml"])
    check_config(spec["speculative_config"], "1.2.1")  # 1.2.1's names
    assert spec["speculative_config"]["decoding_type"] == "Eagle3"
    assert spec["speculative_config"]["max_draft_len"] == 4
    # one-model EAGLE-3 (the default) runs with the overlap scheduler; the two-model draft
    # target does not, and then neither does the baseline (the same scheduler on both arms)
    assert "disable_overlap_scheduler" not in spec
    assert "speculative_config" not in writes["baseline.yaml"]
    draft = plan_for(ROOT / "recipes" / "h200-llama31-8b-draft1b.yaml",
                     "backend.workflow=pytorch")
    writes = {Path(s.path).name: yaml.safe_load(s.content) for s in draft.steps
              if s.kind == "write"}
    assert writes["baseline.yaml"]["disable_overlap_scheduler"] is True
    for name, options in writes.items():
        assert options["disable_overlap_scheduler"] is True, name  # on every arm
        if name != "baseline.yaml":
            check_config(options["speculative_config"], "1.2.1")
            assert options["speculative_config"]["decoding_type"] == (
                "Draft_Target" if name.startswith("draft_model") else "NGram")


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


@pytest.mark.parametrize("path", RECIPES, ids=[p.stem for p in RECIPES])
def test_every_plan_ends_with_commands_that_exist(path: Path, tmp_path: Path) -> None:
    """The "next" commands parse with trtspec's real CLI (command, options, arguments), name
    only 1.2.x trtllm-serve flags and only what the plan itself produces; no `trtspec serve`."""
    from trtspec.build.plan import EVAL_DIR
    from trtspec.cli import cli

    plan = plan_for(path)
    text = plan.shell()
    assert "trtspec serve" not in text and plan.next
    tail = text[text.index("# next:"):].splitlines()
    assert all(line.startswith("#") for line in tail)  # comments: the script never runs them
    commands = [n.argv for n in plan.next if n.argv]
    assert commands and commands[-1][:2] in {("trtspec", "decide"), ("trtspec", "build")}
    produced = {s.produces for s in plan.steps}
    (tmp_path / "eval").mkdir()
    for argv in commands:
        assert argv[0] in {"trtspec", "trtllm-serve"}, argv
        if argv[0] == "trtspec":
            assert argv[1] in cli.commands and argv[1] != "serve", argv
            args = [str(tmp_path / "eval") if a == EVAL_DIR else a for a in argv[2:]]
            cli.commands[argv[1]].make_context(argv[1], args)  # raises on an unknown option
            if argv[1] in ("eval", "build"):
                assert argv[2] == str(path)  # the recipe as passed
        else:
            flags = {a for a in argv if a.startswith("--")}
            assert flags <= SERVE_FLAGS, sorted(flags - SERVE_FLAGS)
            served = argv[1]
            if plan.workflow == "engine":  # an engine directory: the TensorRT backend
                assert served in produced and argv[argv.index("--backend") + 1] == "tensorrt"
                assert argv[argv.index("--tokenizer") + 1] == plan_target(path)
            else:
                assert argv[argv.index("--extra_llm_api_options") + 1] in produced
    if plan.backend == "torch":
        assert [c[:2] for c in commands] == [("trtspec", "eval"), ("trtspec", "audit"),
                                            ("trtspec", "decide")]
    elif any(c[:2] == ("trtspec", "eval") for c in commands):
        ports = {c[c.index("--port") + 1] for c in commands if c[0] == "trtllm-serve"}
        ev = next(c for c in commands if c[:2] == ("trtspec", "eval"))
        assert {ev[ev.index("--endpoint") + 1], ev[ev.index("--baseline-endpoint") + 1]} == \
            {f"http://127.0.0.1:{p}/v1" for p in ports}


def plan_target(path: Path) -> str:
    from trtspec.build.recipe import load_recipe

    return load_recipe(path).target.model


def test_external_drafts_on_engines_point_at_the_pytorch_workflow() -> None:
    """target-spec needs a client that passes drafts; trtllm-serve passes none, so the plan
    says so and suggests the pytorch workflow, whose plan then serves and evaluates."""
    plan = plan_for(ROOT / "recipes" / "l40s-llama31-8b-ngram.yaml")
    comments = " ".join(line.removeprefix("# ") for line in plan.shell().splitlines())
    assert "trtllm-serve passes none, so served alone it does not speculate" in comments
    assert plan.next[-1].argv[-2:] == ("--set", "backend.workflow=pytorch")
    assert not any("target-spec" in a for n in plan.next for a in n.argv)  # never served
    pytorch = plan_for(ROOT / "recipes" / "l40s-llama31-8b-ngram.yaml", "backend.workflow=pytorch")
    evals = [n.argv for n in pytorch.next if n.argv[:2] == ("trtspec", "eval")]
    assert evals and evals[0][3:5] == ("--set", "backend.workflow=pytorch")


def test_dry_run_through_the_cli_ends_with_eval_audit_decide(tmp_path: Path, capsys,
                                                             monkeypatch) -> None:
    from trtspec.cli import main

    monkeypatch.chdir(ROOT)
    main(["build", "recipes/cpu-smollm2.yaml", "--dry-run", "--engines", str(tmp_path),
          "--set", "eval.per_category=2"])
    out = capsys.readouterr().out
    assert "trtspec serve" not in out
    assert out.endswith("#   trtspec decide reports/<eval-id>\n")
    assert f"#   trtspec eval recipes/cpu-smollm2.yaml --set eval.per_category=2 --engines " \
        f"{tmp_path}\n" in out
    assert "#   trtspec audit reports/<eval-id>\n" in out


def test_every_llmapi_file_parses_in_the_1_2_1_standin(trtllm_standin) -> None:
    """Every options file a pytorch-workflow plan writes, whole, as TensorRT-LLM 1.2.1's LLM
    arguments read it (extra="forbid": a misspelt option fails here)."""
    from tensorrt_llm.llmapi import TorchLlmArgs

    for recipe in sorted((ROOT / "recipes").glob("*.yaml")):
        text = recipe.read_text()
        if "kind: trtllm" not in text:
            continue
        try:
            plan = plan_for(recipe, "backend.workflow=pytorch")
        except ValueError as e:  # a recipe whose methods need engines (Medusa, EAGLE-1/2)
            assert "workflow: engine" in str(e)
            continue
        for step in plan.steps:
            if step.kind == "write":
                TorchLlmArgs(model="m", **yaml.safe_load(step.content))
