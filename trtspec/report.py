"""The approval report (markdown; the HTML twin with plots is a later step), from an eval folder.

Written next to the records: ``reports/<eval-id>/report.md`` and ``decision.json``.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

from trtspec.decide import GO, Verdict, apply_where, cost_model, decide
from trtspec.recipe import Recipe


def make_decision(out_dir: str | Path, recipe: Recipe, records: list[dict[str, Any]]
                  ) -> tuple[list[Verdict], dict[str, Any]]:
    """Verdicts, the apply-where table and the cost model; writes decision.json + report.md."""
    out = Path(out_dir)
    greedy = recipe.sampling.temperature == 0
    verdicts = decide(records, recipe.decide, greedy, seed=recipe.sampling.seed)
    models = {}
    for key in sorted({r["condition"] for r in records}):
        if not key.split("/")[1].endswith("D0") and any(
                r["condition"] == key and r["arm"] == "spec" and r["verification_rounds"]
                for r in records):
            models[key] = cost_model(records, key)
    decision = {"criteria": recipe.decide.model_dump(), "greedy": greedy,
                "verdicts": [asdict(v) for v in verdicts], "apply_where": apply_where(verdicts),
                "cost_model": models}
    (out / "decision.json").write_text(json.dumps(decision, indent=2) + "\n")
    (out / "report.md").write_text(markdown(out.name, recipe, verdicts, decision))
    return verdicts, decision


def markdown(eval_id: str, recipe: Recipe, verdicts: list[Verdict], decision: dict[str, Any]
             ) -> str:
    c = recipe.decide
    lines = [
        f"# Speculative decoding: go / no-go — {recipe.name} ({eval_id})", "",
        f"Criteria: primary metric **{c.primary_metric}**, GO when the 95 % paired-bootstrap "
        f"CI of the speedup clears **{c.min_speedup:.2f}×** and no gate fails (TTFT p99 "
        f"regression ≤ {100 * c.max_ttft_p99_regression:.0f} %, E2E p99 regression ≤ "
        f"{100 * c.max_e2e_p99_regression:.0f} %, ≥ {c.min_requests} paired requests"
        + (", greedy identity 100 %" if decision["greedy"] else "") + ").", "",
        "## Verdict per condition", "",
        "| condition | verdict | speedup | 95 % CI | requests | why |",
        "|---|---|---:|---|---:|---|"]
    for v in verdicts:
        if v.category == "all":
            lines.append(_row(v))
    lines += ["", "## Per category", "", "| condition | category | verdict | speedup | 95 % CI "
              "| requests | why |", "|---|---|---|---:|---|---:|---|"]
    for v in verdicts:
        if v.category != "all":
            lines.append(_row(v, with_category=True))
    lines += ["", "## Apply where", ""]
    for method, entry in decision["apply_where"].items():
        best = ", ".join(f"{c}: D={d} ({s:.2f}×)" for c, (d, s) in entry["best_d"].items())
        lines.append(f"- **{method}**: GO for {', '.join(entry['go']) or 'no condition'}"
                     + (f"; best D per concurrency: {best}" if best else ""))
    if decision["cost_model"]:
        lines += ["", "## Cost model (Leviathan et al.)", "",
                  "α = acceptance rate; c = draft step / target step derived from round times; "
                  "predicted = (1 − α^(D+1)) / ((1 − α)(D·c + 1)).", "",
                  "| condition | α | c | predicted | measured | recommended D |",
                  "|---|---:|---:|---:|---:|---:|"]
        for key, m in decision["cost_model"].items():
            lines.append(f"| {key} | {m['alpha']:.2f} | {m['c']:.2f} | "
                         f"{m['predicted_speedup']:.2f}× | {m['measured_speedup']:.2f}× | "
                         f"{m['recommended_d']} |")
    lines += ["", "Speedup = baseline / speculative on the primary metric (> 1: speculation is "
              "faster), from the same requests with the same seeds.", ""]
    return "\n".join(lines)


def _row(v: Verdict, with_category: bool = False) -> str:
    mark = {"GO": "✅ GO", "NO-GO": "❌ NO-GO"}.get(v.verdict, "⚠️ INCONCLUSIVE")
    cat = f" {v.category} |" if with_category else ""
    ci = "—" if v.ci[0] != v.ci[0] else f"{v.ci[0]:.2f}–{v.ci[1]:.2f}×"
    speed = "—" if v.speedup != v.speedup else f"{v.speedup:.2f}×"
    return (f"| {v.condition} |{cat} {mark} | {speed} | {ci} | {v.requests} | "
            f"{'; '.join(v.reasons) or '—'} |")


def all_go(verdicts: list[Verdict]) -> bool:
    return all(v.verdict == GO for v in verdicts if v.category == "all")
