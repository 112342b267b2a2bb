"""The eval folder: selections stored and resumed, per-category rules, --num-prompts, Ctrl-C
and resume end to end through the `trtspec` CLI, one-arm records ignored and counted."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
from conftest import copy_build

from trtspec.build.recipe import RecipeError, load_recipe
from trtspec.cli import main
from trtspec.eval.folder import Selection, load_requests, resumed_selection, spread_sample
from trtspec.eval.run import read_records, summarize
from trtspec.eval.workloads.request import WorkloadRequest

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes" / "cpu-smollm2.yaml"  # eval.per_category: 1
SMALL = ("methods=[{method: ngram}]", "draft_lengths=[2]", "eval.warmup=0")


def _workload(path: Path, per_category: int = 3, categories: str = "abc") -> Path:
    rows = [{"id": f"{c}{i}", "category": c, "prompt": f"Repeat: the {c} fox {i}. the {c} fox"}
            for c in categories for i in range(per_category)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _request(i: int, category: str) -> WorkloadRequest:
    return WorkloadRequest(id=f"r{i}", category=category, prompt="x", max_tokens=99)


def test_a_custom_jsonl_runs_whole_and_builtin_follows_the_recipe(tmp_path: Path) -> None:
    recipe = load_recipe(RECIPE)  # per_category 8, builtin's 8 categories in 2 groups
    said: list[str] = []
    jsonl = str(_workload(tmp_path / "w.jsonl"))
    got = load_requests(recipe, Selection.make([jsonl, "builtin"]), tmp_path, said.append)
    assert Counter(r.category for r in got if r.source == "builtin") == {"copy_heavy": 8,
                                                                          "open_ended": 8}
    assert sum(r.id[0] in "abc" and r.source != "builtin" for r in got) == 9  # all of it
    assert said == [f"workload {jsonl}: 9 requests (all of it): a 3, b 3, c 3",
                    "workload builtin: 16 requests (at most 8 per category): copy_heavy 8, "
                    "open_ended 8"]
    said.clear()
    got = load_requests(recipe, Selection.make([jsonl], per_category=2), tmp_path, said.append)
    assert len(got) == 6 and said == [f"workload {jsonl}: 6 requests (at most 2 per "
                                      "category): a 2, b 2, c 2"]  # groups are builtin's


def test_groups_merge_the_categories_they_list_and_leave_the_rest(tmp_path: Path) -> None:
    recipe = load_recipe(RECIPE, ["eval.categories={copy: [summarise, edit]}",
                                  "eval.per_category=null"])
    said: list[str] = []
    got = load_requests(recipe, Selection.make(["builtin"]), ROOT, said.append)
    counts = Counter(r.category for r in got)
    assert counts == {"copy": 12, "answer_from_text": 6, "code_refactor": 6, "chat": 6,
                      "story": 6, "reasoning": 6, "explain": 6}
    assert {r.id.rsplit("-", 1)[0] for r in got if r.category == "copy"} == {"summarise", "edit"}
    typo = load_recipe(RECIPE, ["eval.categories={copy: [sumarise, edit]}"])
    with pytest.raises(RecipeError, match=r"eval\.categories lists sumarise, which the "
                                          r"workloads do not have"):  # builtin's are known
        load_requests(typo, Selection.make(["builtin"]), ROOT, said.append)
    clash = load_recipe(RECIPE, ["eval.categories={chat: [story]}"])
    with pytest.raises(RecipeError, match="group 'chat' is also a category"):
        load_requests(clash, Selection.make(["builtin"]), ROOT, said.append)
    with pytest.raises(RecipeError, match="cannot be named 'all'"):
        load_recipe(RECIPE, ["eval.categories={all: [chat]}"])
    custom = tmp_path / "c.jsonl"  # a custom JSONL's categories are its own
    custom.write_text(json.dumps({"id": "q", "category": "chat", "prompt": "hi"}) + "\n")
    got = load_requests(recipe, Selection.make([str(custom)]), tmp_path, said.append)
    assert [r.category for r in got] == ["chat"]
    with pytest.raises(RecipeError, match="category 'edit' is in two groups"):
        load_recipe(RECIPE, ["eval.categories={a: [edit], b: [chat, edit]}"])
    with pytest.raises(RecipeError, match="group 'a' lists a category twice"):
        load_recipe(RECIPE, ["eval.categories={a: [edit, edit]}"])


def test_num_prompts_spreads_over_categories_and_max_tokens_fixes_every_request() -> None:
    requests = [_request(i, "a") for i in range(10)] + [_request(10 + i, "b") for i in range(2)]
    sample = spread_sample(requests, 4, seed=0)
    assert Counter(r.category for r in sample) == {"a": 2, "b": 2}
    assert [r.id for r in sample] == sorted((r.id for r in sample), key=lambda x: int(x[1:]))
    assert spread_sample(requests, 4, seed=0) == sample  # seeded
    with pytest.raises(RecipeError, match="--num-prompts 13: the workloads hold only 12"):
        spread_sample(requests, 13, seed=0)
    sel = Selection.make(max_tokens=16, ignore_eos=True, concurrency=[1, 4])
    assert sel.knob_overrides() == ["sampling.max_tokens=16", "sampling.ignore_eos=true",
                                    "eval.concurrency=[1, 4]"]
    recipe = load_recipe(RECIPE, sel.all_overrides())
    assert recipe.sampling.params().ignore_eos and recipe.eval.concurrency == [1, 4]


def test_resume_takes_the_folder_s_selection_and_names_what_differs(tmp_path: Path) -> None:
    jsonl = str(_workload(tmp_path / "w.jsonl"))
    out, _, _, stored, _ = _start(tmp_path, Selection.make([jsonl], per_category=3,
                                                           overrides=["sampling.seed=2"]))
    assert resumed_selection(out, Selection(), RECIPE) == stored
    assert resumed_selection(out, Selection.make([jsonl]), RECIPE) == stored
    with pytest.raises(RecipeError) as e:
        resumed_selection(out, Selection.make(["builtin"], per_category=1), RECIPE)
    assert str(e.value) == (f"--resume {out}: --workload builtin (that eval ran {jsonl}); "
                            "--per-category 1 (that eval ran 3) would measure another eval. "
                            "Resume takes them from the eval folder: drop them, or start a new "
                            "eval")


def _one_arm_records() -> list[dict]:
    rows = []
    for i in range(3):
        for arm in ("baseline", "spec"):
            if (i, arm) == (2, "spec"):
                continue  # interrupted between the arms of request 2
            rows.append({"condition": "ngram/D2/c1", "method": "ngram", "draft_len": 2,
                         "concurrency": 1, "arm": arm, "request_id": f"r{i}", "category": "a",
                         "output_tokens": 5, "token_times_s": [0.1, 0.2, 0.3, 0.4, 0.5],
                         "ttft_s": 0.1, "e2e_s": 0.5, "prefill_s": 0.1, "decode_s": 0.4,
                         "start_s": 1000.0 + i, "proposed_tokens": 4 * (arm == "spec"),
                         "accepted_draft_tokens": 2 * (arm == "spec"), "emitted_tokens": 4,
                         "verification_rounds": 2 if arm == "spec" else 4,
                         "discarded_tokens": 0, "rejected_rounds": 1 * (arm == "spec"),
                         "accepted_per_position": [], "proposed_per_position": [],
                         "output_token_ids": [1, 2, 3, 4, 5], "finish_reason": "length"})
    return rows


def test_summary_and_decide_ignore_a_request_measured_in_one_arm(tmp_path: Path, capsys,
                                                                  monkeypatch) -> None:
    rows = _one_arm_records()
    entry = summarize(rows)["ngram/D2/c1"]
    assert entry["unpaired_records"] == 1
    assert entry["baseline"]["requests"] == entry["spec"]["requests"] == 2
    out = tmp_path / "e"
    out.mkdir()
    (out / "recipe.yaml").write_text(RECIPE.read_text())
    (out / "eval.json").write_text(json.dumps({"overrides": list(SMALL)}))
    (out / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (out / "summary.json").write_text(json.dumps(summarize(rows)))
    elsewhere = tmp_path / "elsewhere"  # decide runs from any folder: no recipes/ here
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    with pytest.raises(SystemExit) as exit_info:
        main(["decide", str(out), "--no-mlflow"])
    assert exit_info.value.code in (0, 1)  # a verdict, not an error (2)
    assert "Ignored 1 record measured in one arm only" in capsys.readouterr().out
    assert json.loads((out / "decision.json").read_text())["unpaired_records"] == 1
    assert "Ignored 1 record measured in one arm only" in (out / "report.md").read_text()
    spec_only = [r for r in rows if r["arm"] == "spec"]  # an endpoint without a baseline
    assert summarize(spec_only, ("spec",))["ngram/D2/c1"]["spec"]["requests"] == 2
    assert summarize(spec_only)["ngram/D2/c1"]["unpaired_records"] == 2


def test_ctrl_c_says_how_to_resume_and_the_printed_command_finishes_the_same_eval(
        tmp_path: Path, smollm2, cpu_build, capsys) -> None:
    """A custom workload sampled with --per-category, interrupted with SIGINT from another
    folder; the printed command (no -w, no --per-category, no --set) completes the same eval:
    every record once, one workload, no request measured in one arm only."""
    engines, elsewhere = tmp_path / "engines", tmp_path / "elsewhere"
    elsewhere.mkdir()
    sets = [a for s in SMALL for a in ("--set", s)]
    copy_build(cpu_build, engines)  # the session's build: this one is up to date
    main(["build", str(RECIPE), "--engines", str(engines), *sets])
    assert "up to date" in capsys.readouterr().out  # a subset of the built methods
    workload = _workload(tmp_path / "my.jsonl")
    env = {**os.environ, "TRTSPEC_ENGINES": str(engines)}
    trtspec = [sys.executable, "-m", "trtspec"]
    first = subprocess.Popen(
        [*trtspec, "eval", str(RECIPE), *sets, "-w", str(workload), "--per-category", "2",
         "--max-tokens", "24", "--ignore-eos", "--eval-id", "e1", "--no-mlflow"],
        cwd=elsewhere, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        # as from a shell: Ctrl-C not ignored (an ignored SIGINT is inherited, and Python then
        # installs no KeyboardInterrupt handler; in the full suite the eval ran to the end)
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    out = elsewhere / "reports" / "e1"
    deadline = time.time() + 240
    while len(read_records(out)) < 3 and first.poll() is None and time.time() < deadline:
        time.sleep(0.2)
    first.send_signal(signal.SIGINT)
    stdout, stderr = first.communicate(timeout=120)
    assert first.returncode == 130, stderr
    assert "workload " in stdout and "6 requests (at most 2 per category)" in stdout
    assert "Traceback" not in stderr and "records kept in" in stderr
    command = stderr.split("continue with:")[1].strip().splitlines()[0]
    assert shlex.split(command) == ["trtspec", "eval", str(RECIPE), "--resume",
                                    "reports/e1", "--no-mlflow"]
    kept = len(read_records(out))
    assert 3 <= kept < 12
    before = (out / "eval.json").read_text()
    again = subprocess.run([*trtspec, *shlex.split(command)[1:]], cwd=elsewhere, env=env,
                           capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr
    records = read_records(out)
    keys = Counter((r["condition"], r["arm"], r["request_id"]) for r in records)
    assert len(keys) == 12 and set(keys.values()) == {1}  # 6 requests × 2 arms, once each
    assert {r["request_id"][0] for r in records} == set("abc")  # one workload, whole
    assert all(r["output_tokens"] == 24 for r in records)  # --ignore-eos --max-tokens 24
    assert (out / "eval.json").read_text() == before
    summary = json.loads((out / "summary.json").read_text())
    assert "unpaired_records" not in summary["ngram/D2/c1"]


def _start(tmp_path: Path, selection: Selection, resume: Path | None = None):
    from trtspec.eval.folder import start

    return start(RECIPE, selection, "e", resume, tmp_path / "reports", "",
                 lambda recipe, requests: {"expected_records": 2 * len(requests)},
                 lambda _: None)


def test_resume_accepts_a_value_that_changes_nothing(tmp_path: Path, capsys) -> None:
    jsonl = str(_workload(tmp_path / "w.jsonl"))
    out, *_ = _start(tmp_path, Selection.make([jsonl], overrides=["sampling.seed=2",
                                                                  "eval.warmup=0"]))
    same = [Selection.make(concurrency=[1]),  # the recipe's is [1]
            Selection.make(overrides=["eval.warmup=0", "sampling.seed=2"]),  # another order
            Selection.make([jsonl], overrides=["sampling.seed=2.0", "eval.warmup=0"])]
    for given in same:
        assert resumed_selection(out, given, RECIPE).workloads == (jsonl,)
    with pytest.raises(RecipeError, match=r"--concurrency 2 \(that eval ran the recipe's\)"):
        resumed_selection(out, Selection.make(concurrency=[2]), RECIPE)
    with pytest.raises(SystemExit) as exit_info:
        main(["eval", str(RECIPE), "--resume", str(out), "--eval-id", "x"])
    assert exit_info.value.code == 2 and "drop --eval-id" in capsys.readouterr().err


def test_an_eval_folder_from_an_older_trtspec_resumes_as_it_ran(tmp_path: Path,
                                                                monkeypatch) -> None:
    """Its eval.json has no selection, relative workload paths, and the recipe's per_category
    sampled custom JSONL too; its recipe digest predates sampling.ignore_eos."""
    from trtspec.eval.workloads import load_workload

    monkeypatch.chdir(tmp_path)
    _workload(tmp_path / "w.jsonl")
    overrides = ["eval.warmup=0", "eval.per_category=1", "eval.categories=null"]
    old = load_workload("w.jsonl", per_category_n=1)  # what that trtspec ran: 1 per category
    digest = load_recipe(RECIPE, overrides).digest()
    assert digest == _older_digest(overrides)
    full = load_recipe(RECIPE, overrides).model_dump(mode="json")  # recorded with ignore_eos
    del full["max_draft_len"], full["backend"]["runner"]  # … before those existed
    del full["eval"]["categories"]
    import hashlib
    assert hashlib.sha256(json.dumps(full, sort_keys=True).encode()).hexdigest() in \
        load_recipe(RECIPE, overrides).digests()
    out = tmp_path / "old"
    out.mkdir()
    (out / "eval.json").write_text(json.dumps({
        "recipe": "cpu-smollm2", "recipe_digest": digest, "overrides": overrides,
        "workloads": ["w.jsonl"], "requests": len(old),
        "request_ids": hashlib.sha256("\n".join(r.id for r in old).encode()).hexdigest()[:16]}))
    _, _, requests, selection, created = _start(tmp_path, Selection(), resume=out)
    assert [r.id for r in requests] == [r.id for r in old] and not created
    assert selection.legacy


def _older_digest(overrides: list[str]) -> str:
    """Recipe.digest() as trtspec computed it before sampling.ignore_eos,
    eval.request_rate, max_draft_len and backend.runner existed."""
    import hashlib

    data = load_recipe(RECIPE, overrides).model_dump(mode="json")
    del data["sampling"]["ignore_eos"], data["eval"]["request_rate"], data["max_draft_len"]
    del data["backend"]["runner"], data["eval"]["categories"]
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()


def test_summary_compares_arms_over_requests_answered_in_both(tmp_path: Path) -> None:
    from trtspec.eval.folder import arms_of

    rows = _one_arm_records()
    rows[0] |= {"error": "APIError: boom", "output_tokens": 0, "token_times_s": [],
                "ttft_s": None}  # r0 failed in the baseline arm
    entry = summarize(rows)["ngram/D2/c1"]
    assert entry["spec"]["requests"] == entry["baseline"]["requests"] == 1
    assert entry["baseline"]["failed_requests"] == 1
    (tmp_path / "eval.json").write_text(json.dumps({"endpoint": "u", "baseline_endpoint": None}))
    assert arms_of(tmp_path) == ("spec",)
    (tmp_path / "eval.json").write_text(json.dumps({"endpoint": "u", "baseline_endpoint": "b"}))
    assert arms_of(tmp_path) == ("baseline", "spec")


def test_ctrl_c_before_anything_was_measured_leaves_no_folder(tmp_path: Path) -> None:
    from trtspec.eval import Interrupted, kept_on_failure

    out = tmp_path / "e"
    out.mkdir()
    (out / "eval.json").write_text("{}")
    with pytest.raises(Interrupted) as e, kept_on_failure(out, created=True, total=4):
        raise KeyboardInterrupt
    assert e.value.discarded and not out.exists()


def test_repeat_measures_each_request_again_as_a_request_of_its_own(tmp_path: Path) -> None:
    """--repeat 3 on the built-in workload: every request three times, ids r, r#2, r#3 (so
    their seeds differ), the copies after the originals; stored in eval.json for a resume."""
    from trtspec.eval.folder import load_requests, stored_selection
    from trtspec.eval.run import request_seed

    recipe = load_recipe(RECIPE)
    once = load_requests(recipe, Selection.make(), RECIPE, say=lambda _: None)
    thrice = load_requests(recipe, Selection.make(repeat=3), RECIPE, say=lambda _: None)
    assert len(thrice) == 3 * len(once) and thrice[:len(once)] == once
    first = once[0]
    copies = [r for r in thrice if r.id.split("#")[0] == first.id]
    assert [r.id for r in copies] == [first.id, f"{first.id}#2", f"{first.id}#3"]
    assert [r.copy_of for r in copies] == [None, first.id, first.id]  # one prompt: one unit
    assert {r.prompt for r in copies} == {first.prompt} and len({request_seed(0, r.id)
                                                               for r in copies}) == 3
    out = tmp_path / "e"
    out.mkdir()
    (out / "eval.json").write_text(json.dumps({"selection": {"repeat": 3}}))
    assert stored_selection(out).repeat == 3


def test_a_new_eval_records_who_measured_it_and_its_command_line(tmp_path: Path) -> None:
    """eval.json keeps what the report's header shows a reviewer: trtspec's version, the git
    commit of the source that ran (this checkout's HEAD), the hardware, and the flags."""
    from importlib.metadata import version

    jsonl = str(_workload(tmp_path / "w.jsonl"))
    selection = Selection.make([jsonl], max_tokens=16, ignore_eos=True,
                               overrides=["draft_lengths=[2]"])
    out, *_ = _start(tmp_path, selection)
    seen = json.loads((out / "eval.json").read_text())["provenance"]
    assert seen["versions"]["trtspec"] == version("trtspec")
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True,
                          text=True, check=False).stdout.strip()
    assert seen["git_sha"] == (head or None) and isinstance(seen["git_dirty"], bool)
    assert seen["hardware"]["device"] == "cpu" and seen["hardware"]["count"] >= 1
    assert selection.flags() == [f"--workload {jsonl}", "--max-tokens 16", "--ignore-eos",
                                 "--set draft_lengths=[2]"]
    assert Selection().flags() == []
