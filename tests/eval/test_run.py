"""Eval runner on toy models: records, pairing, resume after SIGKILL, summaries."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
from eval_driver import toy_inputs

from trtspec.eval.run import ARMS, read_records, run_eval, summarize

DRIVER = Path(__file__).parent / "eval_driver.py"


def test_toy_eval_records_every_condition_arm_and_request(tmp_path: Path) -> None:
    inputs = toy_inputs()
    path = run_eval(tmp_path, inputs)
    records = read_records(path)
    assert len(records) == len(inputs.conditions) * len(ARMS) * len(inputs.requests)
    first = records[0]
    for key in ("condition", "arm", "request_id", "category", "context_tokens", "output_tokens",
                "ttft_s", "token_times_s", "e2e_s", "prefill_s", "decode_s", "proposed_tokens",
                "accepted_draft_tokens", "emitted_tokens", "verification_rounds",
                "discarded_tokens", "accepted_per_position", "seed"):
        assert key in first
    by = {(r["condition"], r["arm"], r["request_id"]): r for r in records}
    for (cond, arm, rid), r in by.items():
        other = by[(cond, "spec" if arm == "baseline" else "baseline", rid)]
        assert r["seed"] == other["seed"] and r["context_tokens"] == other["context_tokens"]
        assert len(r["token_times_s"]) == r["output_tokens"]
        if arm == "baseline":
            assert r["proposed_tokens"] == 0 and r["emitted_tokens"] == r["output_tokens"] - 1
    summary = summarize(records)
    entry = summary["draft_model/D4/c2"]
    assert entry["baseline"]["al_pooled"] == 1.0 and entry["spec"]["al_pooled"] > 1.0
    assert entry["spec"]["requests"] == len(inputs.requests)
    assert "speedup_tpot_p50" in entry and "tpot_ms_p50" in entry["spec"]
    assert entry["spec"]["peak_rss_mb"] > 0 and "prefill_ms_p50" in entry["spec"]
    assert "decode_ms_p99" in entry["baseline"]
    by_category = entry["spec"]["categories"]
    assert set(by_category) == {"copy", "chat"}
    assert by_category["copy"]["requests"] + by_category["chat"]["requests"] == 6
    with pytest.raises(FileExistsError, match="--resume"):
        run_eval(tmp_path, inputs)


def test_sigkill_then_resume_measures_every_request_exactly_once(tmp_path: Path) -> None:
    out = tmp_path / "eval"
    proc = subprocess.Popen([sys.executable, str(DRIVER), str(out), "--step-delay", "0.02"],
                            cwd=DRIVER.parent)
    records = out / "records.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline:
        if records.is_file() and records.read_text().count("\n") >= 10:
            break
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    partial = records.read_text().count("\n")
    assert 10 <= partial < 48, partial
    with records.open("a") as f:
        f.write('{"condition": "draft_model/D2/c1", "arm": "ba')  # a line torn by the kill
    resumed = subprocess.run([sys.executable, str(DRIVER), str(out), "--resume"],
                             cwd=DRIVER.parent, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    rows = [json.loads(line) for line in records.read_text().splitlines()]
    keys = Counter((r["condition"], r["arm"], r["request_id"]) for r in rows)
    assert len(keys) == 4 * 2 * 6 and set(keys.values()) == {1}


def test_throughput_divides_by_the_arm_s_own_wall_time(tmp_path: Path) -> None:
    """Every request has its own send time on one eval clock, so an arm's throughput is its
    tokens over the time its requests ran: c = 1 → Σ E2E (one at a time); c = 2 → the union of
    the closed-loop clients' overlapping [sent, done] intervals."""
    records = read_records(run_eval(tmp_path, toy_inputs(delay=0.002)))
    summary = summarize(records)
    for key in ("draft_model/D2/c1", "draft_model/D4/c2"):
        for arm in ARMS:
            rows = [r for r in records if r["condition"] == key and r["arm"] == arm]
            spans = sorted((r["start_s"], r["start_s"] + r["e2e_s"]) for r in rows)
            wall, end = 0.0, float("-inf")
            for a, b in spans:  # the union, by hand
                wall += max(0.0, b - max(a, end))
                end = max(end, b)
            if key.endswith("c1"):
                assert wall == pytest.approx(sum(r["e2e_s"] for r in rows), abs=1e-5)
            else:  # two clients: some requests overlap
                assert wall < sum(r["e2e_s"] for r in rows)
            tokens = sum(r["output_tokens"] for r in rows)
            assert summary[key][arm]["output_tokens_per_s"] == pytest.approx(tokens / wall,
                                                                             rel=1e-5)


def test_greedy_divergences_are_located_and_measured(tmp_path: Path) -> None:
    """A spec arm whose target differs: each differing output gets its first divergence and
    the margin function's value there; a resumed eval does not add them twice."""
    from trtspec.eval.run import DIVERGENCES, first_divergence, read_jsonl
    from trtspec.runtime.toy import MarkovLM, ToyRunner
    from trtspec.spec.executor import SpecExecutor

    inputs = toy_inputs()
    other = MarkovLM(vocab_size=16, order=2, seed=9, eos_token_id=15)
    make = inputs.make_executor
    inputs.make_executor = lambda c, arm: make(c, arm) if arm == "baseline" else \
        SpecExecutor(ToyRunner(other))
    inputs.sampling = inputs.sampling.model_copy(update={"temperature": 0.0})
    calls = []
    inputs.margin = lambda prefix, a, b: calls.append((len(prefix), a, b)) or (0.125, "float32")
    records = read_records(run_eval(tmp_path, inputs))
    found = read_jsonl(tmp_path / DIVERGENCES)
    assert found and len(found) == len(calls)
    by = {(r["condition"], r["arm"], r["request_id"]): r for r in records}
    for d in found:
        base = by[(d["condition"], "baseline", d["request_id"])]["output_token_ids"]
        spec = by[(d["condition"], "spec", d["request_id"])]["output_token_ids"]
        assert d["position"] == first_divergence(base, spec)
        assert base[: d["position"]] == spec[: d["position"]]
        if d["margin"] is not None:
            assert (d["baseline_token"], d["spec_token"]) == (base[d["position"]],
                                                              spec[d["position"]])
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2], [1, 2, 3]) == 2
    run_eval(tmp_path, inputs, resume=True)
    assert len(read_jsonl(tmp_path / DIVERGENCES)) == len(found)


def test_arms_alternate_strictly_and_peak_rss_is_a_peak() -> None:
    import mmap

    from trtspec.eval.clients import peak_rss_mb, reset_peak_rss
    from trtspec.eval.run import alternate

    assert [alternate(ARMS, i) for i in range(4)] == [ARMS, ARMS[::-1], ARMS, ARMS[::-1]]
    reset_peak_rss()
    before = peak_rss_mb()
    block = mmap.mmap(-1, 200 * 2**20)  # fresh pages (not heap the process already holds)
    for offset in range(0, len(block), 4096):  # touched: 200 MiB resident, then unmapped
        block[offset] = 1
    block.close()
    assert peak_rss_mb() >= before + 150  # the peak remembers what the current RSS forgot


def test_a_batch_cut_short_is_measured_again_whole_in_both_arms(tmp_path: Path) -> None:
    """Resume runs a partly recorded turn again whole, in both arms (a c = 2 request is
    measured beside the others, and its baseline beside its spec run, not hours before it):
    the turn's old records are replaced, every other record is kept as it was."""
    inputs = toy_inputs(n_requests=4)
    run_eval(tmp_path, inputs)
    path = tmp_path / "records.jsonl"
    records = read_records(path)
    cut = [r for r in records if not (r["condition"] == "draft_model/D2/c2"
                                      and r["arm"] == "spec" and r["request_id"] == "r1")]
    path.write_text("".join(json.dumps(r) + "\n" for r in cut))
    import trtspec.serve.scheduler

    sent: list[int] = []
    submit = trtspec.serve.scheduler.Scheduler.submit

    def spy(self, prompt, params, on_delta=None):
        sent.append(params.seed)
        return submit(self, prompt, params, on_delta)

    trtspec.serve.scheduler.Scheduler.submit = spy
    inputs.warmup = 0
    try:
        again = read_records(run_eval(tmp_path, inputs, resume=True))
    finally:
        trtspec.serve.scheduler.Scheduler.submit = submit
    assert len(sent) == 2 * 4  # the whole turn (4 requests at c = 2) again, in both arms
    keys = Counter((r["condition"], r["arm"], r["request_id"]) for r in again)
    assert len(again) == len(records) and set(keys.values()) == {1}
    turn = [r for r in again if r["condition"] == "draft_model/D2/c2"]
    assert {r["wall_clock"] for r in turn} & {r["wall_clock"] for r in records} == set()
    kept = [r for r in again if r["condition"] != "draft_model/D2/c2"]
    assert kept == [r for r in records if r["condition"] != "draft_model/D2/c2"]


def test_an_eval_with_an_adaptive_condition_end_to_end(tmp_path: Path) -> None:
    """A toy eval with a fixed and an adaptive condition: records carry the D of each round,
    the summary its distribution; decide, the report and serve --policy handle the adaptive
    condition."""
    import dataclasses
    import shutil

    from trtspec.analysis.records import condition_parts
    from trtspec.build.recipe import load_recipe
    from trtspec.cli.policy import policy_from_eval
    from trtspec.eval.run import Condition
    from trtspec.report.decision import make_decision
    from trtspec.serve.slots import DraftPolicy
    from trtspec.spec.adaptive import ADAPTIVE
    from trtspec.spec.cost_curve import chooser
    from trtspec.spec.executor import SpecExecutor

    inputs = toy_inputs(n_requests=6)
    make = inputs.make_executor

    def make_adaptive(condition: Condition, arm: str) -> SpecExecutor:
        if condition.draft_len != ADAPTIVE:
            return make(condition, arm)
        executor = make(dataclasses.replace(condition, draft_len=4), arm)
        if arm == "spec":
            executor.adaptive = chooser("draft_model", 4)  # toy: the fallback curve
        return executor

    conditions = [Condition("draft_model", d, 1) for d in (2, ADAPTIVE)]
    assert conditions[1].key == "draft_model/Dadaptive/c1"
    assert condition_parts(conditions[1].key) == ("draft_model", ADAPTIVE, 1)
    out = tmp_path / "e"
    run_eval(out, dataclasses.replace(inputs, conditions=conditions,
                                      make_executor=make_adaptive))
    records = read_records(out)
    spec = [r for r in records if r["condition"] == conditions[1].key and r["arm"] == "spec"]
    assert all(len(r["draft_lens"]) == r["verification_rounds"] for r in spec)
    assert all(set(r["draft_lens"]) <= {0} for r in records if r["arm"] == "baseline")
    summary = summarize(records)[conditions[1].key]["spec"]
    share = summary["draft_len_share"]
    assert sum(share.values()) == pytest.approx(1.0) and len(share) > 1
    assert 0 < summary["draft_len_mean"] <= 4
    assert summarize(records)["draft_model/D2/c1"]["spec"]["draft_len_share"]["2"] > 0.5
    # decide and the report: an adaptive condition is GO, reported with the D it chose
    timed = []  # toy timings are noise: spec at 10 ms per token, baseline 20, 4× the pairs
    for i in range(4):
        for r in records:
            step = (0.010 if r["arm"] == "spec" else 0.020) * (1 + 0.01 * i)
            times = [0.05 + k * step for k in range(32)]
            timed.append(dict(r, request_id=f"{r['request_id']}-{i}", block=f"{i}.{r['block']}",
                              prompt_id=f"{r['request_id']}-{i}",  # 4× the prompts, not copies
                              token_times_s=times, ttft_s=times[0], e2e_s=times[-1],
                              output_tokens=32))
    records = timed
    shutil.copyfile(Path(__file__).parents[2] / "recipes" / "cpu-smollm2.yaml",
                    out / "recipe.yaml")
    recipe = load_recipe(out / "recipe.yaml", ["sampling.temperature=1.0",
                                               "decide.require_audit=false"])
    verdicts, decision = make_decision(out, recipe, records)
    adaptive = next(v for v in verdicts if v.condition == conditions[1].key
                    and v.category == "all")
    assert adaptive.verdict == "GO", adaptive
    assert decision["apply_where"]["draft_model"]["best_d"]["c1"][0] in (2, ADAPTIVE)
    assert decision["cost_model"][conditions[1].key]["draft_len"] == ADAPTIVE
    assert decision["draft_lengths"][conditions[1].key]["mean"] == pytest.approx(
        summary["draft_len_mean"])
    by_category = decision["draft_lengths"][conditions[1].key]["by_category"]
    spec = [r for r in records if r["condition"] == conditions[1].key and r["arm"] == "spec"]
    assert set(by_category) == {r["category"] for r in spec}
    for category, mean in by_category.items():  # by hand: Σ D / rounds over its records
        lens = [d for r in spec if r["category"] == category for d in r["draft_lens"]]
        assert mean == pytest.approx(sum(lens) / len(lens))
    report = (out / "report.md").read_text()
    section = report.split("## Adaptive draft length")[1].split("##")[0]
    assert f"| {conditions[1].key} |" in section and "D=0:" in section
    assert "draft_model/D2/c1" not in section
    # serve --policy: a GO adaptive condition serves with an adaptive D
    for v in decision["verdicts"]:
        if v["condition"] == "draft_model/D2/c1":
            v["verdict"] = "NO-GO"
    (out / "decision.json").write_text(json.dumps(decision))
    shutil.rmtree(out / "schedules")  # the edited decision.json, not the policy file decide wrote
    assert policy_from_eval(out, None, []) == ("draft_model", DraftPolicy.parse("1:adaptive"))


def test_a_turn_with_a_failed_request_is_whole_and_only_a_missing_record_cuts_it() -> None:
    """An endpoint error is a record (failed): the turn was measured whole and is not cut, so
    a request that always fails never makes a resume drop its turn's good records. A turn
    with no record for some request or arm was interrupted: every request of it is cut."""
    from trtspec.eval.run import cut_turns

    inputs = toy_inputs(n_requests=4)
    keys = {(c.key, arm, r.id) for c in inputs.conditions for arm in ("baseline", "spec")
            for r in inputs.requests}
    assert cut_turns(inputs, keys) == set()  # failed or not, every request has a record
    c2 = next(c.key for c in inputs.conditions if c.key.endswith("/c2"))
    partial = keys - {(c2, "spec", "r1")}
    assert cut_turns(inputs, partial) == {(c2, r.id) for r in inputs.requests}  # 1 turn of 4
