"""eval --confirm: the chosen setting, on requests the first eval did not measure."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import pytest

from trtspec.build.recipe import RecipeError
from trtspec.cli import main
from trtspec.eval.confirm import CONFIRMS, confirm_plan, side_by_side
from trtspec.eval.folder import Selection

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes" / "cpu-smollm2.yaml"


def decided(tmp: Path, go: list[str]) -> Path:
    """An eval folder that measured a0, a1, b0 of a 12-row workload and whose decision is GO
    for ``go`` (ngram D2 at c1 beats D4 by the CI's lower bound)."""
    workload = tmp / "w.jsonl"
    workload.write_text("".join(json.dumps({"id": f"{c}{i}", "category": c, "prompt": "x"}) + "\n"
                                for c in "ab" for i in range(6)))
    out = tmp / "first"
    out.mkdir()
    selection = Selection.make([str(workload)], overrides=("methods=[{method: ngram}]",))
    (out / "eval.json").write_text(json.dumps({"selection": asdict(selection)}))
    rows = [{"condition": "ngram/D2/c1", "arm": arm, "request_id": rid, "category": rid[0]}
            for rid in ("a0", "a1", "b0") for arm in ("baseline", "spec")]
    (out / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    verdicts = [{"condition": c, "category": "all", "verdict": "GO" if c in go else "NO-GO",
                 "speedup": s, "ci": [low, s + 0.1], "reasons": []}
                for c, s, low in (("ngram/D2/c1", 1.3, 1.2), ("ngram/D4/c1", 1.4, 1.1))]
    (out / "decision.json").write_text(json.dumps({"verdicts": verdicts}))
    return out


def test_the_chosen_setting_on_unseen_rows(tmp_path: Path) -> None:
    first = decided(tmp_path, ["ngram/D2/c1", "ngram/D4/c1"])
    selection, recipe, keys, fresh = confirm_plan(first, RECIPE, seed=0)
    assert selection.overrides == ("methods=[{method: ngram}]",)
    assert keys == ["ngram/D2/c1"]  # the higher lower bound, not the higher estimate
    assert [m.method for m in recipe.methods] == ["ngram"]  # the first eval's overrides
    ids = [r.id for r in fresh]
    assert len(ids) == 3 and not {"a0", "a1", "b0"} & set(ids)
    assert sorted(r.category for r in fresh) == ["a", "a", "b"]  # as many per category


def test_nothing_go_nothing_to_confirm(tmp_path: Path, capsys) -> None:
    first = decided(tmp_path, [])
    with pytest.raises(RecipeError, match="nothing is GO there"):
        confirm_plan(first, RECIPE, seed=0)
    (first / "decision.json").unlink()
    with pytest.raises(SystemExit) as exit_info:
        main(["eval", str(RECIPE), "--confirm", str(first), "--no-mlflow"])
    assert exit_info.value.code == 2
    assert "no decision.json: run `trtspec decide" in capsys.readouterr().err


def test_the_report_shows_both_verdicts(tmp_path: Path) -> None:
    from trtspec.analysis.decide import Verdict

    first = decided(tmp_path, ["ngram/D2/c1"])
    second = tmp_path / "second"
    second.mkdir()
    (second / "eval.json").write_text(json.dumps({CONFIRMS: str(first)}))
    here = Verdict("ngram/D2/c1", "all", "INCONCLUSIVE", 1.08, (0.98, 1.2), 3)
    lines = side_by_side(second, [here])
    assert "| ngram/D2/c1 | first | GO | 1.30× (1.20–1.40×) | INCONCLUSIVE | 1.08× " \
           "(0.98–1.20×) |" in lines


@pytest.mark.parametrize("extra", [["--until-decided"], ["--workload", "builtin"],
                                   ["--set", "sampling.max_tokens=8"]])
def test_confirm_refuses_what_would_change_the_setting(tmp_path: Path, capsys, extra) -> None:
    first = decided(tmp_path, ["ngram/D2/c1"])
    with pytest.raises(SystemExit) as exit_info:
        main(["eval", str(RECIPE), "--confirm", str(first), "--no-mlflow", *extra])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "--confirm" in err and f"drop {extra[0]}" in err and "Traceback" not in err
