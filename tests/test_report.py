"""report: the markdown's plain-words summary, and the HTML rendering in headless Chromium."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from test_decide import paired

from trtspec.recipe import load_recipe
from trtspec.report import make_decision

ROOT = Path(__file__).resolve().parents[1]
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
    assert "paired requests would resolve it" in summary
    assert "**layer_skip: not GO overall.**" in summary and "a draft step must cost ≤" in summary
    per_category = text.split("## Per category")[1].split("##")[0]
    assert "| ngram/D4/c1 | chat | **GO** |" in per_category
    assert "No verdict for" not in per_category  # every category had ≥ 6 pairs somewhere
    cost = text.split("## Cost model")[1].split("##")[0]  # α 0.46, c 1.19: no D pays
    assert "| layer_skip/D2/c1 |" in cost and cost.split("| layer_skip/D2/c1 |")[1].split(
        "\n")[0].rstrip().endswith("| 0 (do not speculate) |")


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
    from trtspec.decide import GO, INCONCLUSIVE, NO_GO, Verdict
    from trtspec.report import summary_lines

    verdicts = [Verdict("ngram/D4/c1", "all", GO, 1.6, (1.3, 1.9), 60),
                Verdict("ngram/D4/c1", "rag", GO, 2.1, (1.8, 2.4), 30),
                Verdict("ngram/D4/c1", "chat", NO_GO, 0.9, (0.8, 1.0), 30),
                Verdict("eagle/D3/c8", "all", INCONCLUSIVE, 1.1, (0.95, 1.3), 60),
                Verdict("eagle/D3/c8", "code", GO, 1.4, (1.2, 1.6), 30)]
    lines = summary_lines(verdicts, {"cost_model": {}}, 1.05)
    assert lines[1] == ("- **ngram: GO** for ngram/D4/c1 (1.60×, CI 1.30–1.90×) but NO-GO for "
                        "chat.")
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
