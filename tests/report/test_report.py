"""report: the markdown's plain-words summary, and the HTML rendering in headless Chromium."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pytest
from fake_records import paired

from trtspec.build.recipe import load_recipe
from trtspec.report.decision import make_decision

ROOT = Path(__file__).resolve().parents[2]
BROWSER = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which(
    "google-chrome")


def eval_folder(tmp_path: Path) -> Path:
    """An eval folder with three conditions: a clear GO, a straddling CI and a slow one."""
    out = tmp_path / "e"
    out.mkdir()
    shutil.copyfile(ROOT / "recipes" / "cpu-smollm2.yaml", out / "recipe.yaml")
    rows = (paired("ngram/D4/c1", 0.050, 0.025, n=30, rounds=20, proposed=80, accepted=60)
            + paired("draft_model/D2/c1", 0.050, 0.045, n=8, noise=0.2, seed=5, rounds=30,
                     proposed=60, accepted=30)
            + paired("layer_skip/D2/c1", 0.050, 0.080, n=30, rounds=30, proposed=60,
                     accepted=20))
    for i, r in enumerate(rows):
        r["category"] = ("chat", "summarise")[i % 4 // 2]
    (out / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    al = {"chat": {"al_pooled": 3.1}, "summarise": {"al_pooled": 3.6}}  # for the AL plot
    (out / "summary.json").write_text(json.dumps({k: {"spec": {"categories": al}} for k in (
        "ngram/D4/c1", "draft_model/D2/c1", "layer_skip/D2/c1")}))
    return out


def test_summary_says_where_it_is_go_and_what_would_change_it(tmp_path: Path) -> None:
    out = eval_folder(tmp_path)
    recipe = load_recipe(out / "recipe.yaml", ["sampling.temperature=0.7"])
    make_decision(out, recipe, [json.loads(x) for x in (out / "records.jsonl").open()])
    text = (out / "report.md").read_text()
    summary = text.split("## Summary")[1].split("##")[0]
    assert "**ngram: GO** for ngram/D4/c1 (1.9" in summary
    assert "**draft_model: not GO overall.**" in summary and "INCONCLUSIVE" in summary
    assert "paired requests in all would show it at p ≤" in summary
    assert "**layer_skip: not GO overall.**" in summary and "a draft step must cost ≤" in summary
    per_category = text.split("## Per category")[1].split("##")[0]
    assert "| ngram/D4/c1 | chat | **GO** |" in per_category
    assert "No verdict for" not in per_category  # every category had ≥ 6 pairs somewhere
    cost = text.split("## Cost model")[1].split("##")[0]  # a 0.46, c 1.19: no D pays
    assert "| layer_skip/D2/c1 |" in cost and cost.split("| layer_skip/D2/c1 |")[1].split(
        "\n")[0].rstrip().endswith("| 0 (do not speculate); no guide: the model misses |")


@pytest.mark.skipif(BROWSER is None, reason="needs chromium for the headless render check")
def test_html_report_renders_with_its_plots_in_headless_chromium(tmp_path: Path) -> None:
    import matplotlib.image

    out = eval_folder(tmp_path)
    make_decision(out, load_recipe(out / "recipe.yaml"),
                  [json.loads(x) for x in (out / "records.jsonl").open()])
    png = tmp_path / "report.png"
    subprocess.run([ROOT / "scripts" / "screenshot_report.sh", out, png], check=True,
                   capture_output=True, timeout=180)
    pixels = matplotlib.image.imread(png)[..., :3]  # [H, W, 3] in 0..1
    assert pixels.shape[0] >= 2000 and pixels.shape[1] == 1200
    # the plots are the only saturated colour on the page (tables and text are grey/black)
    colour = (pixels.max(-1) - pixels.min(-1)) > 0.3
    rows = np.flatnonzero(colour.sum(1) > 3)
    assert colour.sum() > 10_000, colour.sum()
    assert rows.max() - rows.min() > 800  # colour spread over several figures, top to bottom


def test_summary_names_the_categories_that_break_ranks() -> None:
    from trtspec.analysis.decide import GO, INCONCLUSIVE, NO_GO, Verdict
    from trtspec.report.render import summary_lines

    verdicts = [Verdict("ngram/D4/c1", "all", GO, 1.6, (1.3, 1.9), 60),
                Verdict("ngram/D4/c1", "rag", GO, 2.1, (1.8, 2.4), 30),
                Verdict("ngram/D4/c1", "chat", NO_GO, 0.9, (0.8, 1.0), 30),
                Verdict("eagle/D3/c8", "all", INCONCLUSIVE, 1.1, (0.95, 1.3), 60),
                Verdict("eagle/D3/c8", "code", GO, 1.4, (1.2, 1.6), 30)]
    lines = summary_lines(verdicts, {"cost_model": {}}, 1.05)
    assert lines[1] == ("- **ngram: GO** for ngram/D4/c1 (1.60×, CI 1.30–1.90×). Within "
                        "ngram/D4/c1, chat NO-GO (shown below 1.05×). `trtspec serve` picks D "
                        "by the number of running requests, not by category: a policy that "
                        "serves ngram/D4/c1 runs ngram at D = 4 on all traffic, so chat "
                        "requests are speculated too, with no gain shown for them (send them "
                        "to a plain-decoding server where that matters).")
    assert lines[0].startswith("- **eagle: not GO overall.** Best measured: eagle/D3/c8, 1.10×")
    assert lines[0].endswith(" Within eagle/D3/c8 it is GO for code.")


def test_an_unfinished_eval_holds_every_go_and_says_how_far_it_got(tmp_path: Path) -> None:
    out = eval_folder(tmp_path)
    records = [json.loads(x) for x in (out / "records.jsonl").open()]
    (out / "eval.json").write_text(json.dumps({"expected_records": len(records) + 10}))
    _, decision = make_decision(out, load_recipe(out / "recipe.yaml",
                                                 ["sampling.temperature=0.7"]), records)
    ngram = next(v for v in decision["verdicts"]
                 if v["condition"] == "ngram/D4/c1" and v["category"] == "all")
    assert ngram["verdict"] == "INCONCLUSIVE"  # a clear GO when complete (test above)
    assert f"the eval is incomplete ({len(records)} of {len(records) + 10} records " \
           "measured): resume it" in ngram["reasons"]
    assert "The eval is incomplete" in (out / "report.md").read_text()


def test_a_sequential_eval_is_judged_at_its_looks_alpha_and_family_size(tmp_path: Path) -> None:
    """decide after --until-decided: each condition at the α of its last look, in a Holm family
    at least as large as the one that look tested it in (here 12 cells, of which this report
    holds 9); a last round cut short (no verdicts yet) holds every GO."""
    out = eval_folder(tmp_path)
    records = [json.loads(x) for x in (out / "records.jsonl").open()]
    conditions = sorted({r["condition"] for r in records})
    look = {"n": 30, "alpha": 0.01, "conditions": conditions, "request_ids": [],
            "verdicts": {c: "INCONCLUSIVE" for c in conditions}, "family": 12}
    stored = {"method": "alpha spending", "alpha": 0.025, "budget": 60, "looks": [look],
              "alphas": {c: 0.01 for c in conditions},
              "families": {c: 12 for c in conditions}}
    (out / "sequential.json").write_text(json.dumps(stored))
    recipe = load_recipe(out / "recipe.yaml", ["sampling.temperature=0.7"])
    verdicts, _ = make_decision(out, recipe, records)
    tested = [v for v in verdicts if v.family]
    assert tested and {(v.family, v.alpha) for v in tested} == {(12, 0.01)}
    assert any(v.verdict == "GO" for v in verdicts)  # the clear ngram speedup survives
    stored["looks"].append({**look, "n": 60, "alpha": 0.015, "verdicts": {}})
    (out / "sequential.json").write_text(json.dumps(stored))
    verdicts, _ = make_decision(out, recipe, records)
    assert not any(v.verdict == "GO" for v in verdicts)
    assert any("cut short" in " ".join(v.reasons) for v in verdicts)


def categorised_folder(tmp_path: Path, eval_json: dict | None = None) -> tuple[Path, list[dict]]:
    """ngram/D4/c1 is GO over all its traffic, but only chat (30 requests, 2× faster) shows it:
    code (12 requests, noisy, about 1.05×) is INCONCLUSIVE and story (3) too few to judge.
    draft_model/D2/c1 has 5 pairs (< min_requests 6: no speedup), layer_skip/D2/c1 has 7 (a
    speedup, but 7 units < 8: no interval)."""
    out = tmp_path / "e"
    out.mkdir()
    shutil.copyfile(ROOT / "recipes" / "cpu-smollm2.yaml", out / "recipe.yaml")
    parts = {"chat": paired("ngram/D4/c1", 0.050, 0.025, n=30, rounds=20, proposed=80,
                            accepted=60),
             "code": paired("ngram/D4/c1", 0.050, 0.048, n=12, noise=0.15, seed=3, rounds=20,
                            proposed=80, accepted=10),
             "story": paired("ngram/D4/c1", 0.050, 0.025, n=3, seed=4, rounds=20, proposed=80,
                             accepted=60)}
    rows = []
    for category, part in parts.items():
        rows += [r | {"category": category, "request_id": f"{category}-{r['request_id']}"}
                 for r in part]
    rows += (paired("draft_model/D2/c1", 0.05, 0.03, n=5, rounds=20, proposed=40, accepted=20)
             + paired("layer_skip/D2/c1", 0.05, 0.03, n=7, rounds=20, proposed=40, accepted=20))
    (out / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if eval_json is not None:
        (out / "eval.json").write_text(json.dumps(eval_json))
    return out, rows


def header(text: str) -> dict[str, str]:
    """The report's header table, row → value."""
    table = text.split("\n\n")[1]
    return {line.split(" | ")[0].strip("| "): line.split(" | ", 1)[1].rstrip(" |")
            for line in table.splitlines()[2:]}


def test_the_header_table_says_what_ran_by_whom_and_the_criteria(tmp_path: Path) -> None:
    """Hardware, model, precision, sampling, versions, git sha, overrides and the decide
    criteria, one row each, from what eval.json recorded; an older folder says "not
    recorded" where it has nothing."""
    from trtspec.eval.folder import Selection

    selection = Selection(overrides=("draft_lengths=[2, 4]", "target.dtype=auto"),
                          max_tokens=32)
    meta = {"recipe": "cpu-smollm2", "overrides": selection.all_overrides(),
            "workloads": ["builtin"], "selection": asdict(selection), "requests": 52,
            "provenance": {"versions": {"python": "3.11.7", "trtspec": "0.1.0",
                                        "torch": "2.5.1", "tensorrt_llm": None},
                           "git_sha": "ab" * 20, "git_dirty": True,
                           "hardware": {"device": "cuda:0", "name": "NVIDIA H200",
                                        "count": 1}}}
    out, records = categorised_folder(tmp_path, meta)
    recipe = load_recipe(out / "recipe.yaml", ["sampling.temperature=0.7",
                                               *selection.all_overrides()])
    make_decision(out, recipe, records)
    text = (out / "report.md").read_text()
    rows = header(text)
    assert rows["hardware"] == "1 × NVIDIA H200 (cuda:0)"
    assert rows["target model"] == "smollm2-135m-instruct"
    assert rows["draft (methods)"] == ("draft_model (not in the recipe); layer_skip (layers=24); "
                                       "ngram; not measured: eagle")
    assert rows["conditions measured"] == ("draft_model: D 2; layer_skip: D 2; ngram: D 4 — at "
                                           "concurrency 1")
    assert rows["precision"] == "target bfloat16 (auto)"  # auto, resolved on the GPU it ran on
    assert rows["sampling"] == ("temperature 0.7, top-p 1 (off), top-k 0 (off), max_tokens 32, "
                                "seed 0")
    assert rows["overrides"] == ("`--max-tokens 32`, `--set draft_lengths=[2, 4]`, "
                                 "`--set target.dtype=auto`")
    assert rows["trtspec version"].startswith("eval 0.1.0 · this report ")
    assert "torch 2.5.1" in rows["trtspec version"]
    assert rows["git sha"] == f"`{'ab' * 20}` with uncommitted changes"
    assert rows["primary metric"].startswith("tpot: the geometric mean")
    assert rows["min_speedup"].startswith("1.05×")
    assert rows["min_requests"].startswith("6 paired requests per cell")
    assert rows["significance level α"].startswith("2.5 % one-sided per direction, "
                                                   "family-wise over")
    prose = text.split("\n\n")[2]  # the paragraph under the table explains, the table says
    assert prose.startswith("GO when the speedup") and "1.05×" not in prose
    assert "<th>what</th><th>value</th>" in (out / "report.html").read_text()

    old = tmp_path / "old"
    old.mkdir()
    out, records = categorised_folder(old)  # no eval.json: an eval from an older trtspec
    make_decision(out, load_recipe(out / "recipe.yaml"), records)
    rows = header((out / "report.md").read_text())
    assert rows["git sha"].startswith("not recorded")
    assert rows["overrides"] == "not recorded (no eval.json)"
    assert rows["trtspec version"].startswith("eval: not recorded · this report ")
    assert rows["hardware"] == "CPU (its model was not recorded)"  # the recipe's backend.device


def test_a_cell_without_an_interval_says_why_instead_of_nan(tmp_path: Path) -> None:
    from trtspec.analysis.decide import INCONCLUSIVE, Verdict, ci_text
    from trtspec.build.recipe import Decide

    out, records = categorised_folder(tmp_path)
    recipe = load_recipe(out / "recipe.yaml", ["sampling.temperature=0.7"])
    make_decision(out, recipe, records)
    text = (out / "report.md").read_text()
    assert not re.search(r"\bnan\b", text + (out / "report.html").read_text())
    verdicts = text.split("## Verdict per condition")[1].split("##")[0]
    assert "| draft_model/D2/c1 | INCONCLUSIVE | — | none: 5 paired requests < min_requests 6 |" \
        in verdicts
    assert "| none: 7 independent requests < 8 |" in verdicts.split("| layer_skip/D2/c1 |")[1]
    summary = text.split("## Summary")[1].split("##")[0]
    assert "(no 95 % CI: 7 independent requests < 8)" in summary
    goodput = Decide(primary_metric="goodput", min_requests=6, slo={"tpot_ms": 50})
    nan = float("nan")
    no_ratio = Verdict("ngram/D4/c4", "all", INCONCLUSIVE, nan, (nan, nan), 40, units=10)
    assert ci_text(no_ratio, goodput) == ("none: the baseline met the SLO in no request, so "
                                          "there is no ratio to bound")
    assert ci_text({"ci": [nan, nan], "requests": 0, "speedup": nan, "units": 0,
                    "unit": "request"}) == "none: no paired requests"


def test_a_go_with_categories_not_go_says_what_serving_it_does_to_them(tmp_path: Path) -> None:
    """serve picks D by running requests, not by category: the report says that the GO
    condition's INCONCLUSIVE categories run speculation too, with no gain shown."""
    out, records = categorised_folder(tmp_path)
    verdicts, decision = make_decision(out, load_recipe(out / "recipe.yaml",
                                                        ["sampling.temperature=0.7"]), records)
    cells = {v.category: v.verdict for v in verdicts if v.condition == "ngram/D4/c1"}
    assert cells == {"all": "GO", "chat": "GO", "code": "INCONCLUSIVE", "story": "INCONCLUSIVE"}
    assert decision["policy"]["method"] == "ngram"
    summary = (out / "report.md").read_text().split("## Summary")[1].split("##")[0]
    assert ("Within ngram/D4/c1, code INCONCLUSIVE (not shown above 1.05×), story "
            "INCONCLUSIVE (too few requests to judge). `trtspec serve` picks D by the number "
            "of running requests, not by category: the written policy runs ngram at D = 4 on "
            "all traffic, so code and story requests are speculated too, with no gain shown "
            "for them (send them to a plain-decoding server where that matters).") in summary


def test_the_cost_model_shows_one_interval_per_figure(tmp_path: Path) -> None:
    """Where the verdicts judge TPOT, the cost model's measured speedup is the verdict's
    figure, its CI only in the verdict table; "explains the measurement?" says what that means
    for planning D. Where they judge another metric, the TPOT figure is the cost model's own
    and shows its CI, once."""
    out = eval_folder(tmp_path)
    records = [json.loads(x) for x in (out / "records.jsonl").open()]
    verdicts, decision = make_decision(out, load_recipe(out / "recipe.yaml",
                                                        ["sampling.temperature=0.7"]), records)
    text = (out / "report.md").read_text()
    cost = text.split("## Cost model")[1].split("\n## ")[0]
    table = [line for line in cost.splitlines() if line.startswith("| ") and "/" in line]
    assert len(table) == 3 and not any(re.search(r"\d–\d", line) for line in table)
    assert "its 95 % CI is in that table" in cost
    overall = {v.condition: v for v in verdicts if v.category == "all"}
    for line in table:
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert cells[5] == overall[cells[0]].speedup_text  # the verdict's figure
        model = decision["cost_model"][cells[0]]
        assert model["measured_from"] == "verdict"
        assert model["measured_ci"] == list(overall[cells[0]].ci)
        assert cells[6] == {True: "yes: plan other D with its a and c",
                            False: "no: do not extrapolate from it"}[
            model["prediction_within_ci"]]
        assert cells[7].endswith("; no guide: the model misses") == \
            (model["prediction_within_ci"] is False)
    assert "do not extrapolate from it: its recommended D is no guide" in cost
    assert " α" not in cost.replace("Leviathan et al.'s α", "").replace(
        "significance level α", "")  # acceptance is a; α is the tests' significance level

    other = tmp_path / "e2e"
    other.mkdir()
    out = eval_folder(other)
    make_decision(out, load_recipe(out / "recipe.yaml", ["sampling.temperature=0.7",
                                                         "decide.primary_metric=e2e_p50"]),
                  records)
    cost = (out / "report.md").read_text().split("## Cost model")[1].split("\n## ")[0]
    table = [line for line in cost.splitlines() if line.startswith("| ") and "/" in line]
    assert all(len(re.findall(r"\(95 % CI \d\.\d\d–\d\.\d\d×\)", line)) == 1 for line in table)
    assert "this TPOT figure and its CI appear only here" in cost
