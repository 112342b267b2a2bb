"""`trtspec eval` on SmolLM2 (small): build → eval → records and summary; clear errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from conftest import copy_build

from trtspec.cli import main
from trtspec.eval.run import read_records

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes" / "cpu-smollm2.yaml"
SMALL = ("methods=[{method: ngram}]", "draft_lengths=[4]", "sampling.max_tokens=32",
         "eval.concurrency=[1]", "eval.warmup=1", "eval.per_category=null")


def test_eval_smollm2_end_to_end(tmp_path: Path, smollm2, cpu_build, mlflow_server,
                                 capsys) -> None:
    from mlflow.tracking import MlflowClient

    workload = tmp_path / "w.jsonl"
    rows = [{"id": f"copy-{i}", "category": "copy", "prompt":
             f"Repeat exactly: the {w} fox jumps over the lazy dog. the {w} fox jumps"}
            for i, w in enumerate(["red", "brown", "grey", "white"])]
    rows += [{"id": f"chat-{i}", "category": "chat", "prompt": p}  # 8 in all: 8 units
             for i, p in enumerate(["Name a colour.", "Say hello.", "Count to three.",
                                    "Name a fruit."])]
    workload.write_text("".join(json.dumps(r) + "\n" for r in rows))
    sets = [a for s in SMALL for a in ("--set", s)]
    copy_build(cpu_build, tmp_path / "engines")  # the session's build: this one is up to date
    main(["build", str(RECIPE), "--engines", str(tmp_path / "engines"), *sets])
    assert "up to date" in capsys.readouterr().out  # a subset of the built methods
    main(["eval", str(RECIPE), "--engines", str(tmp_path / "engines"), "--reports",
          str(tmp_path / "reports"), "--eval-id", "e1", "-w", str(workload), *sets,
          "--mlflow-uri", mlflow_server])
    out = tmp_path / "reports" / "e1"
    printed = capsys.readouterr().out
    assert "ngram/D4/c1" in printed and "records: " in printed
    records = read_records(out)
    assert len(records) == 2 * 8 and {r["category"] for r in records} == {"copy", "chat"}
    assert all(r["output_tokens"] <= 32 for r in records)
    summary = json.loads((out / "summary.json").read_text())["ngram/D4/c1"]
    assert summary["spec"]["al_pooled"] > 1.0 and summary["baseline"]["al_pooled"] == 1.0
    assert {"recipe.yaml", "manifest.json", "eval.json"} <= {p.name for p in out.iterdir()}
    receipt = json.loads((out / "mlflow.json").read_text())
    client = MlflowClient(tracking_uri=mlflow_server)
    parent = client.get_run(receipt["run_id"])
    assert parent.data.params["recipe.target.model"] == "smollm2-135m-instruct"
    assert parent.data.tags["backend"] == "torch" and parent.data.tags["gpu"] == "cpu"
    child = client.get_run(receipt["conditions"]["ngram/D4/c1"])
    assert child.data.tags["method"] == "ngram" and child.data.metrics["spec/al_pooled"] > 1.0
    assert "spec/category_al/copy" in child.data.metrics
    # audit the models this eval measured, then decide: the report lands in the same run
    with pytest.raises(SystemExit) as exit_info:
        main(["audit", str(out), "-n", "300", "--effect", "0.3"])  # the built-in prompt
    assert exit_info.value.code == 0
    audit = json.loads((out / "audit.json").read_text())
    assert audit["methods"]["ngram"]["passed"] and audit["sampling"]["temperature"] == 1.0
    assert audit["methods"]["ngram"]["prompts"][0]["rejected"] > 0.05
    assert audit["methods"]["ngram"]["prompts"][0]["positions"] >= 600  # the long prompt,
    assert audit["methods"]["ngram"]["prompts"][0]["kept_prompt"]  # kept between samples
    assert not audit["methods"]["ngram"]["weak"] and audit["effect"] == 0.3
    # criteria that this run must clear whatever the machine's speed: any speedup, loose
    # latency gates, few requests; greedy identity and the audit are still required
    recipe = yaml.safe_load((out / "recipe.yaml").read_text())
    recipe["decide"] |= {"min_speedup": 0.05, "min_requests": 6,
                         "max_ttft_p99_regression": 5.0, "max_e2e_p99_regression": 5.0}
    (out / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    with pytest.raises(SystemExit) as exit_info:
        main(["decide", str(out)])
    decision = json.loads((out / "decision.json").read_text())
    overall = decision["verdicts"][0]
    assert overall["verdict"] == "GO", overall
    assert exit_info.value.code == 0
    assert overall["greedy"]["diverged"] == 0
    assert overall["greedy"]["identical"] + overall["greedy"]["ties"] == 8
    verdict = overall["verdict"]
    assert "report, verdicts and audit logged to run" in capsys.readouterr().out
    parent = client.get_run(receipt["run_id"])
    assert parent.data.tags["verdict.ngram/D4/c1"] == verdict
    assert parent.data.tags["audit.ngram"] == "pass"
    assert parent.data.metrics["audit/ngram/power"] == pytest.approx(
        audit["methods"]["ngram"]["power"])
    assert {a.path for a in client.list_artifacts(receipt["run_id"], "decision")} == {
        "decision/report.html", "decision/report.md", "decision/decision.json",
        "decision/audit.json", "decision/verdicts.json"}
    steps = client.get_metric_history(receipt["run_id"], "decide/speedup/ngram_D4")
    assert [(m.step, m.value) for m in steps] == [(1, pytest.approx(overall["speedup"]))]
    assert client.get_run(receipt["conditions"]["ngram/D4/c1"]).data.tags["verdict"] == verdict
    with pytest.raises(SystemExit) as exit_info:  # the same eval id again without --resume
        main(["eval", str(RECIPE), "--engines", str(tmp_path / "engines"), "--reports",
              str(tmp_path / "reports"), "--eval-id", "e1", "-w", str(workload), *sets])
    assert exit_info.value.code == 2 and "--resume" in capsys.readouterr().err
    main(["eval", str(RECIPE), "--resume", str(out), "--engines", str(tmp_path / "engines"),
          "-w", str(workload), *sets, "--no-mlflow"])  # nothing left to do
    assert len(read_records(out)) == 16


def test_eval_with_mlflow_down_keeps_everything_then_syncs(tmp_path: Path, smollm2, cpu_build,
                                                         mlflow_server, capsys) -> None:
    from conftest import free_port

    sets = [a for s in (*SMALL, "eval.warmup=0") for a in ("--set", s)]
    workload = tmp_path / "w.jsonl"
    workload.write_text(json.dumps({"id": "a", "category": "c", "prompt": "Say hi."}) + "\n")
    copy_build(cpu_build, tmp_path / "engines")  # the session's build: this one is up to date
    main(["build", str(RECIPE), "--engines", str(tmp_path / "engines"), *sets])
    assert "up to date" in capsys.readouterr().out  # a subset of the built methods
    main(["eval", str(RECIPE), "--engines", str(tmp_path / "engines"), "--reports",
          str(tmp_path / "reports"), "--eval-id", "down", "-w", str(workload), *sets,
          "--mlflow-uri", f"http://127.0.0.1:{free_port()}"])
    out = tmp_path / "reports" / "down"
    err = capsys.readouterr().err
    assert "MLflow: not logged" in err and f"trtspec sync {out}" in err
    assert len(read_records(out)) == 2 and not (out / "mlflow.json").exists()
    main(["sync", str(out), "--mlflow-uri", mlflow_server])
    assert json.loads((out / "mlflow.json").read_text())["run_id"]


def test_eval_needs_a_current_build(tmp_path: Path, capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["eval", str(RECIPE), "--engines", str(tmp_path / "none")])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "run `trtspec build RECIPE` first" in err


def test_an_eval_id_in_use_is_refused_before_anything_is_written(tmp_path: Path, smollm2, cpu_build,
                                                                 capsys) -> None:
    sets = [a for s in SMALL for a in ("--set", s)]
    engines, reports = tmp_path / "engines", tmp_path / "reports"
    copy_build(cpu_build, engines)  # the session's build: this one is up to date
    main(["build", str(RECIPE), "--engines", str(engines), *sets])
    assert "up to date" in capsys.readouterr().out  # a subset of the built methods
    old = reports / "e1"
    old.mkdir(parents=True)
    (old / "eval.json").write_text('{"recipe": "an older eval"}')
    (old / "recipe.yaml").write_text("name: older\n")
    with pytest.raises(SystemExit) as exit_info:
        main(["eval", str(RECIPE), "--engines", str(engines), "--reports", str(reports),
              "--eval-id", "e1", *sets, "--no-mlflow"])
    assert exit_info.value.code == 2 and f"--resume {old}" in capsys.readouterr().err
    assert (old / "eval.json").read_text() == '{"recipe": "an older eval"}'
    assert (old / "recipe.yaml").read_text() == "name: older\n"
    assert sorted(p.name for p in old.iterdir()) == ["eval.json", "recipe.yaml"]


def test_resume_refuses_another_workload_or_recipe(tmp_path: Path, smollm2, cpu_build,
                                                  capsys) -> None:
    sets = [a for s in (*SMALL, "eval.warmup=0", "sampling.max_tokens=4") for a in ("--set", s)]
    engines, reports = tmp_path / "engines", tmp_path / "reports"
    workload = tmp_path / "w.jsonl"
    workload.write_text(json.dumps({"id": "a", "category": "c", "prompt": "Say hi."}) + "\n")
    copy_build(cpu_build, engines)  # the session's build: this one is up to date
    main(["build", str(RECIPE), "--engines", str(engines), *sets])
    assert "up to date" in capsys.readouterr().out  # a subset of the built methods
    main(["eval", str(RECIPE), "--engines", str(engines), "--reports", str(reports),
          "--eval-id", "e1", "-w", str(workload), *sets, "--no-mlflow"])
    out = reports / "e1"
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    for extra, text in ((["-w", "builtin"], f"--workload builtin (that eval ran {workload})"),
                        (["-w", str(workload), "--set", "sampling.seed=3"],
                         "sampling.seed=3 (that eval ran"),
                        (["--max-tokens", "3"], "--max-tokens 3 (that eval ran the "
                                                "recipe's)")):
        with pytest.raises(SystemExit) as exit_info:
            main(["eval", str(RECIPE), "--engines", str(engines), "--resume", str(out), *sets,
                  *extra, "--no-mlflow"])
        assert exit_info.value.code == 2 and text in capsys.readouterr().err
        assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    # the documented form (docs/eval.md): the folder's workload, overrides and knobs; nothing
    # left to measure; --per-category 2 of a one-request workload changes nothing, so it is accepted
    main(["eval", str(RECIPE), "--engines", str(engines), "--resume", str(out), "--no-mlflow"])
    main(["eval", str(RECIPE), "--engines", str(engines), "--resume", str(out),
          "--per-category", "2", "--no-mlflow"])
    assert len(read_records(out)) == 2 and "workload " in capsys.readouterr().out


def test_the_recipe_s_device_and_dtype_reach_the_models(tmp_path: Path, smollm2) -> None:
    """A bfloat16 build loads bfloat16 models; a recipe asking float32 of it is told what
    differs; a subset of the built methods and another draft length use the same build."""
    import torch

    from trtspec.build.manifest import ManifestError, open_built
    from trtspec.build.open import OpenBuild
    from trtspec.build.recipe import load_recipe

    bf16 = ("target.dtype=bfloat16", "backend.device=cpu")
    main(["build", str(RECIPE), "--engines", str(tmp_path), *[a for s in bf16
                                                              for a in ("--set", s)]])
    recipe = load_recipe(RECIPE, [*bf16, "methods=[{method: layer_skip, layers: 24}]",
                                  "draft_lengths=[3]", "sampling.temperature=0.5"])
    manifest, _ = open_built(recipe, RECIPE, tmp_path)  # subset + other D + other sampling
    build = OpenBuild(recipe, manifest)
    assert build.model().model.dtype == torch.bfloat16
    executor = build.executor("layer_skip", 3)
    assert executor.target.dtype == torch.bfloat16
    assert executor.proposer.runner.dtype == torch.bfloat16
    with pytest.raises(ManifestError, match=r"was built for other settings \(target.dtype: "
                                            r"built bfloat16, recipe float32\)"):
        open_built(load_recipe(RECIPE, ["backend.device=cpu"]), RECIPE, tmp_path)
    with pytest.raises(ManifestError, match=r"\(backend.runner: built compiled, recipe "
                                            r"eager\)"):  # the default, named (not None)
        open_built(load_recipe(RECIPE, [*bf16, "backend.runner=eager"]), RECIPE, tmp_path)
    with pytest.raises(ManifestError, match="was built with other layer_skip settings"):
        open_built(load_recipe(RECIPE, [*bf16, "methods.1.layers=20"]), RECIPE, tmp_path)
    open_built(load_recipe(RECIPE, [*bf16, "methods.0.max_n=5"]), RECIPE, tmp_path)  # run time


def test_benchmark_knobs_drive_an_in_process_eval(tmp_path: Path, smollm2, cpu_build,
                                                 capsys) -> None:
    """--num-prompts, --concurrency, --max-tokens and --ignore-eos through the CLI, in process:
    the recipe's concurrency list is replaced and every request emits exactly max tokens."""
    sets = [a for s in (*SMALL, "eval.warmup=0") for a in ("--set", s)]
    engines, reports = tmp_path / "engines", tmp_path / "reports"
    workload = tmp_path / "w.jsonl"
    workload.write_text("".join(json.dumps({"id": f"{c}{i}", "category": c,
                                            "prompt": f"Say {c} {i}."}) + "\n"
                                for c in "ab" for i in range(3)))
    copy_build(cpu_build, engines)  # the session's build: this one is up to date
    main(["build", str(RECIPE), "--engines", str(engines), *sets])
    assert "up to date" in capsys.readouterr().out  # a subset of the built methods
    main(["eval", str(RECIPE), "--engines", str(engines), "--reports", str(reports),
          "--eval-id", "k", "-w", str(workload), *sets, "--num-prompts", "4",
          "--concurrency", "2", "--max-tokens", "5", "--ignore-eos", "--no-mlflow"])
    records = read_records(reports / "k")
    assert {r["condition"] for r in records} == {"ngram/D4/c2"}
    assert len({r["request_id"] for r in records}) == 4
    assert sorted({r["category"] for r in records}) == ["a", "b"]
    assert {r["arm"] for r in records} == {"baseline", "spec"}
    assert all(r["output_tokens"] == 5 for r in records)
    # open-loop arrivals in process: each arm's requests are sent at the seeded Poisson offsets
    from trtspec.eval.clients import arrival_offsets

    main(["eval", str(RECIPE), "--engines", str(engines), "--reports", str(reports),
          "--eval-id", "r", "-w", str(workload), *sets, "--num-prompts", "4",
          "--request-rate", "5", "--max-tokens", "5", "--no-mlflow"])
    records = read_records(reports / "r")
    for arm in ("baseline", "spec"):
        sent = [r for r in records if r["arm"] == arm]  # in the order they were sent
        assert len(sent) == 4
        offsets = arrival_offsets(4, 5.0, sent[0]["seed"])
        # start_s is an absolute clock reading: the differences match only to float precision
        assert [r["start_s"] - sent[0]["start_s"] for r in sent] == \
            pytest.approx([o - offsets[0] for o in offsets], abs=2e-6)
        assert offsets[-1] > 0.05  # spread out, not all at once
    # the turns alternate: blocks named in the records, the same in both arms
    assert {r["block"] for r in records} == {"0.0"}
    # --until-decided: a round of the workload's unused rows (one per category), then it says
    # the rows ran out; a resume of the finished eval says it measured nothing
    capsys.readouterr()
    main(["eval", str(RECIPE), "--engines", str(engines), "--reports", str(reports),
          "--eval-id", "u", "-w", str(workload), *sets, "--num-prompts", "4",
          "--max-tokens", "5", "--ignore-eos", "--no-mlflow", "--until-decided"])
    printed = capsys.readouterr()
    looks = json.loads((reports / "u" / "sequential.json").read_text())
    assert [look["n"] for look in looks["looks"]] == [4, 6]
    assert looks["looks"][1]["verdicts"] == {"ngram/D4/c1": "INCONCLUSIVE"}  # 6 < 8 units
    records = read_records(reports / "u")
    assert len({r["request_id"] for r in records}) == 6 and len(records) == 12
    assert {r["block"] for r in records if r["request_id"] in looks["looks"][1]["request_ids"]} \
        == {"1.0", "1.1"}
    assert "until-decided: look 2: 2 more requests for ngram/D4/c1" in printed.out
    assert "the workloads have no unused rows left (6 measured)" in printed.out
    assert "eval: 0/8 records · now ngram/D4/c1: loading and warming up" in printed.err
    main(["eval", str(RECIPE), "--engines", str(engines), "--resume", str(reports / "u"),
          "--no-mlflow"])  # it resumes as the sequential eval it is
    printed = capsys.readouterr()
    assert f"{reports / 'u'} was already complete (12 records): nothing was measured" \
        in printed.out
    assert len(read_records(reports / "u")) == 12
    # refused before anything is measured: a budget the plan fills, a fixed-size eval made
    # sequential on resume (its α may be spent already), a resumed budget changed
    for args, text in (
            (["--eval-id", "v", "-w", str(workload), *sets, "--num-prompts", "4",
              "--until-decided", "--max-requests", "4"],
             "--max-requests 4 leaves no room after the plan's 4 requests"),
            (["--resume", str(reports / "k"), "--until-decided"],
             "that eval was not started with --until-decided"),
            (["--resume", str(reports / "u"), "--max-requests", "9"],
             "drop --max-requests 9")):
        with pytest.raises(SystemExit) as exit_info:
            main(["eval", str(RECIPE), "--engines", str(engines), "--reports", str(reports),
                  *args, "--no-mlflow"])
        assert exit_info.value.code == 2 and text in capsys.readouterr().err
    assert not (reports / "v").exists() and len(read_records(reports / "u")) == 12
