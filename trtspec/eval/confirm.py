"""``trtspec eval --confirm reports/<eval-id>``: measure again only what that eval chose, on
requests it has not seen.

An eval that judges many cells and applies the best GO is optimistic about that one: it was
chosen *because* it measured well. The setting chosen (``policy.serve_policy``: the method
with the most GO conditions, and per concurrency the GO draft length with the highest CI lower
bound) is measured again in a new eval folder on rows of the same workloads the first eval did
not measure, with the same recipe, overrides and knobs. Its report shows both verdicts side by
side; a confirmation that is not GO is the winner's curse showing.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from trtspec.build.recipe import Recipe, RecipeError, load_recipe
from trtspec.eval.folder import Selection, stored_selection, workload_pool
from trtspec.eval.sequential import unused_rows

CONFIRMS = "confirms"  # eval.json key: the folder a confirmation eval re-measures


def chosen_conditions(original: Path) -> list[str]:
    """The condition keys the original eval's decision applies (its serve policy)."""
    from trtspec.analysis.policy import serve_policy

    path = original / "decision.json"
    if not path.is_file():
        raise RecipeError(f"--confirm {original}: no decision.json: run `trtspec decide "
                          f"{original}` first (confirmation re-measures what it chose)")
    policy = serve_policy(json.loads(path.read_text()))
    if policy.method == "none":
        raise RecipeError(f"--confirm {original}: nothing is GO there, so nothing was chosen "
                          "to confirm")
    return [f"{policy.method}/D{d}/c{c}" for c, d in policy.schedule if d != 0]


def confirm_plan(original: Path, recipe_path: str | Path, seed: int
                 ) -> tuple[Selection, Recipe, list[str], list[Any]]:
    """(the original's selection, the recipe as it ran, the chosen condition keys, new
    requests: as many per category as the original measured, from its workloads' unused
    rows)."""
    from trtspec.eval.folder import meta_if_any
    from trtspec.eval.run import read_records

    if not (original / "eval.json").is_file():
        raise RecipeError(f"--confirm {original}: not an eval folder (no eval.json): pass "
                          "reports/<eval-id>")
    selection = stored_selection(original)
    recipe = load_recipe(recipe_path, selection.all_overrides())
    ran = meta_if_any(original).get("recipe_digest")
    if ran and ran not in recipe.digests():
        raise RecipeError(f"--confirm {original}: {recipe_path} is not the recipe that eval ran "
                          "(its digest differs): confirm with the same recipe")
    keys = chosen_conditions(original)
    records = read_records(original)
    seen = {r["request_id"] for r in records}
    # as many requests per category as the chosen setting got there (with --until-decided,
    # more than the plan); a confirmation of a confirmation must not reuse the first's rows
    shares = Counter(r["category"] for r in records
                     if r["condition"] == keys[0] and r["arm"] == "spec")
    before = meta_if_any(original).get(CONFIRMS)
    while before:  # a confirmation of a confirmation: none of the chain's rows are new
        seen |= {r["request_id"] for r in read_records(Path(before))}
        before = meta_if_any(Path(before)).get(CONFIRMS)
    fresh = unused_rows(workload_pool(recipe, selection, recipe_path), seen, shares, seed, 0)
    if not fresh:
        raise RecipeError(f"--confirm {original}: its workloads have no rows it did not measure "
                          "(add rows, or confirm with another workload)")
    return selection, recipe, keys, fresh


def side_by_side(confirm_dir: Path, verdicts: list[Any],
                 interval: Callable[[Any], str] | None = None) -> list[str]:
    """Report lines: each confirmed condition's verdict in the original eval and here.
    ``interval``: a cell's 95 % CI in words, given a Verdict or its decision.json form (the
    report's says why a cell has none); by default the CI, or "no interval"."""
    interval = interval or _interval
    from trtspec.eval.folder import meta_if_any

    original = meta_if_any(confirm_dir).get(CONFIRMS)
    if not original:
        return []
    path = Path(original) / "decision.json"
    before = {v["condition"]: v for v in json.loads(path.read_text())["verdicts"]
              if v["category"] == "all"} if path.is_file() else {}
    lines = ["## Confirmation", "",
             f"This eval re-measured what `{Path(original).name}` chose, on requests that eval "
             "had not seen. A chosen setting that is not GO here was picked partly by noise.",
             "", "| condition | chosen by | verdict there | speedup there (95 % CI) | "
             "verdict here | speedup here (95 % CI) |", "|---|---|---|---|---|---|"]
    for v in verdicts:
        if v.category != "all":
            continue
        b = before.get(v.condition, {})
        there = (f"{b['speedup']:.2f}× ({interval(b)})"
                 if b and b.get("speedup") == b.get("speedup") else "—")
        lines.append(f"| {v.condition} | {Path(original).name} | {b.get('verdict', '—')} | "
                     f"{there} | {v.verdict} | {v.speedup_text} ({interval(v)}) |")
    return lines


def _interval(v: Any) -> str:
    low, high = v["ci"] if isinstance(v, dict) else v.ci
    return f"{low:.2f}–{high:.2f}×" if low == low and high == high else "no interval"
