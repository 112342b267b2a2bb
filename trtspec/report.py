"""The approval report, from an eval folder: ``report.html`` (self-contained, plots embedded),
its markdown twin ``report.md``, and ``decision.json``, next to the records."""

from __future__ import annotations

import json
import re
from dataclasses import asdict
from pathlib import Path
from typing import Any

from trtspec.cost_model import cost_models, leviathan
from trtspec.decide import (
    GO,
    INCONCLUSIVE,
    NO_GO,
    SPEEDUP_MEANS,
    Verdict,
    decide,
    pairs,
    requests_to_resolve,
    statistic_for,
)
from trtspec.eval.confirm import side_by_side
from trtspec.eval.sequential import looks_lines
from trtspec.gates import P90_MIN, P99_MIN
from trtspec.goodput import goodput_table
from trtspec.goodput import markdown_lines as goodput_lines
from trtspec.metrics import arm_throughput, chosen_draft_lengths, drop_unpaired
from trtspec.policy import apply_where
from trtspec.recipe import Recipe
from trtspec.schedules import deployment, deployment_lines


def make_decision(out_dir: str | Path, recipe: Recipe, records: list[dict[str, Any]]
                  ) -> tuple[list[Verdict], dict[str, Any]]:
    """Verdicts, the apply-where table and the cost model; writes decision.json + report.md."""
    from trtspec.audit import read_audit
    from trtspec.audit_endpoint import audit_of_this_eval
    from trtspec.eval import in_process
    from trtspec.eval.folder import arms_of, completeness, meta_if_any
    from trtspec.eval.run import DIVERGENCES, read_jsonl
    from trtspec.eval.sequential import cut_short, read_sequential
    from trtspec.files import write_atomic

    out = Path(out_dir)
    measured, expected = completeness(out, records)
    records, unpaired = drop_unpaired(records, arms_of(out))  # interrupted, not yet resumed
    greedy = recipe.sampling.temperature == 0
    audit = read_audit(out)
    if not in_process(out):  # the sampler runs in the server: an endpoint audit of its servers
        audit = audit if audit_of_this_eval(audit, out) else None
    endpoint = "endpoint" in meta_if_any(out)  # an endpoint eval (not a bare records folder)
    # its sampled requests need an audit; greedy ones are gated by greedy identity
    audit_applies = in_process(out) or audit is not None or (endpoint and not greedy)
    sequential = read_sequential(out)
    verdicts = decide(records, recipe.decide, greedy, recipe.sampling.seed, audit,
                      needs_audit=recipe.decide.require_audit and audit_applies,
                      divergences=read_jsonl(out / DIVERGENCES),
                      alphas=sequential["alphas"] if sequential else None,
                      families=sequential.get("families") if sequential else None)
    cut = cut_short(sequential)
    for v in verdicts:  # what is not measured yet may be the slow half: no GO on the rest
        if v.verdict == GO and v.condition in cut:
            v.verdict = INCONCLUSIVE
            v.reasons.append("the eval's last round of --until-decided was cut short: resume it")
        elif v.verdict == GO and expected and measured < expected:
            v.verdict = INCONCLUSIVE
            v.reasons.append(f"the eval is incomplete ({measured} of {expected} records "
                             "measured): resume it")
    metric = recipe.decide.primary_metric  # the cost model predicts TPOT: goodput's is not
    models = cost_models(records, recipe.sampling.seed,
                         statistic_for("tpot" if metric == "goodput" else metric))
    decision = {"criteria": recipe.decide.model_dump(), "greedy": greedy,
                "throughput": arm_throughput(records),
                "draft_lengths": chosen_draft_lengths(records),
                "verdicts": [asdict(v) for v in verdicts], "apply_where": apply_where(verdicts),
                "sequential": sequential, "confirmation": side_by_side(out, verdicts),
                "workload_sources": sorted({str(r.get("source")) for r in records}),
                "cost_model": models, "audit": audit,
                "audit_applies": audit_applies, "endpoint_eval": endpoint,
                "unpaired_records": unpaired,
                "measured_records": measured, "expected_records": expected}
    decision |= deployment(out, recipe, records, verdicts, decision)  # crossover, memory
    decision["goodput"] = goodput_table(records, recipe.decide.slo, pairs) \
        if recipe.decide.slo else None
    write_atomic(out / "decision.json", json.dumps(decision, indent=2) + "\n")
    write_atomic(out / "report.md", markdown(out.name, recipe, verdicts, decision))
    summary = json.loads((out / "summary.json").read_text()) \
        if (out / "summary.json").is_file() else {}
    write_atomic(out / "report.html", html(out.name, recipe, verdicts, decision, records,
                                           summary))
    return verdicts, decision


def markdown(eval_id: str, recipe: Recipe, verdicts: list[Verdict], decision: dict[str, Any]
             ) -> str:
    c = recipe.decide
    lines = [
        f"# Speculative decoding: go / no-go — {recipe.name} ({eval_id})", "",
        f"Criteria: primary metric **{c.primary_metric}** ({SPEEDUP_MEANS[c.primary_metric]}), "
        f"GO when the speedup is shown above "
        f"**{c.min_speedup:.2f}×** and no gate fails. " + _error_text(verdicts, decision)
        + " Gates (TTFT tail "
        f"regression ≤ {100 * c.max_ttft_p99_regression:.0f} %, E2E tail regression ≤ "
        f"{100 * c.max_e2e_p99_regression:.0f} %, each failing only when its paired-bootstrap "
        f"95 % CI lies above the limit; the tail is p99 from {P99_MIN} paired requests, p90 "
        f"from {P90_MIN}, else the median; ≥ {c.min_requests} paired requests"
        + (", greedy identity 100 % except numerical ties (target logit margin at the first "
           "difference ≤ " + (f"{c.greedy_tie_margin:g}" if c.greedy_tie_margin is not None
                              else "0.01 in float32, 0.1 in float16, 0.5 in bfloat16") + ")"
           if decision["greedy"] else "")
        + (", exactness audit passed" if c.require_audit and decision.get("audit_applies")
           else "") + f", GPU memory headroom ≥ {100 * c.min_gpu_memory_headroom:.0f} %).",
        "",
        "## Summary", "", *summary_lines(verdicts, decision, c.min_speedup), "",
        *([unpaired_note(decision["unpaired_records"]), ""]
          if decision.get("unpaired_records") else []),
        *([incomplete_note(decision), ""] if incomplete_note(decision) else []),
        "## Verdict per condition", "",
        "| condition | verdict | speedup | 95 % CI | requests (units) | p vs level | why | "
        "caveats |", "|---|---|---:|---|---:|---|---|---|"]
    for v in verdicts:
        if v.category == "all":
            lines.append(_row(v))
    if decision["greedy"]:
        lines += ["", "Greedy identity per condition (spec output = baseline output): "
                  + "; ".join(f"{v.condition}: {g['identical']} identical, {g['ties']} "
                              f"numerical ties, {g['diverged']} diverged"
                              + (f", {g['unmeasured']} not measured" if g["unmeasured"] else "")
                              for v in verdicts if v.category == "all" and (g := v.greedy))
                  + "."]
    decided = [v for v in verdicts if v.category != "all" and v.speedup == v.speedup]
    lines += ["", "## Per category", ""]
    if decided:
        lines += ["| condition | category | verdict | speedup | 95 % CI | requests (units) | "
                  "p vs level | why | caveats |", "|---|---|---|---:|---|---:|---|---|---|",
                  *(_row(v, True) for v in decided), ""]
    undecided = sorted({v.category for v in verdicts if v.category != "all"} -
                       {v.category for v in decided})
    if undecided:
        lines.append(f"No verdict for {', '.join(undecided)}: fewer than {c.min_requests} "
                     f"paired requests per category ({_more_requests_text(decision)}).")
    lines += ["", *decision.get("confirmation", []), "", *looks_lines(decision.get("sequential"))]
    lines += ["", "## Apply where", "", "Per concurrency, the GO draft length whose CI lower bound "
              "is highest (the highest point estimate among many GO cells is the one most "
              "likely inflated by noise).", ""]
    for method, entry in decision["apply_where"].items():
        best = ", ".join(f"{c}: D={d} ({s:.2f}×, CI from {low:.2f}×)"
                         for c, (d, s, low) in entry["best_d"].items())
        lines.append(f"- **{method}**: GO for {', '.join(entry['go']) or 'no condition'}"
                     + (f"; best D per concurrency: {best}" if best else ""))
    if decision["cost_model"]:
        lines += ["", "## Cost model (Leviathan et al.)", "",
                  "α = per-token acceptance probability, accepted / (accepted + rejected "
                  "rounds) (the i.i.d. maximum-likelihood estimate; not accepted / proposed); "
                  "c = cost of one drafted token in target steps, from round times (a round "
                  "with n drafts lasts 1 + n·c steps); D̄ = drafts per round as proposed; "
                  "predicted TPOT speedup = (1 + Σᵢ P(draft at i)·α^(i+1)) / (1 + D̄·c), which "
                  "is (1 − α^(D+1)) / ((1 − α)(D·c + 1)) when every round drafts D; measured = "
                  "baseline / spec TPOT median with its 95 % paired-bootstrap CI. The model "
                  "holds where the prediction falls inside that CI; recommended D maximises "
                  "Leviathan's formula at this α and c.", "",
                  "| condition | α | c | D̄ | predicted | measured | 95 % CI | within CI | "
                  "recommended D |", "|---|---:|---:|---:|---:|---:|---|---|---:|"]
        for key, m in decision["cost_model"].items():
            low, high = m.get("measured_ci", (float("nan"),) * 2)
            best = m["recommended_d"] or "0 (do not speculate)"
            lines.append(f"| {key} | {m['alpha']:.2f} | {m['c']:.2f} | "
                         f"{m.get('mean_drafts', m['draft_len']):.2f} | "
                         f"{m['predicted_speedup']:.2f}× | {m['measured_speedup']:.2f}× | "
                         f"{low:.2f}–{high:.2f}× | "
                         f"{'yes' if m.get('prediction_within_ci') else 'no'} | {best} |")
    if decision.get("draft_lengths"):
        lines += ["", "## Adaptive draft length", "",
                  "D chosen per round from the running requests' acceptance estimates and the "
                  "round's cost (D = 0: plain decoding, with periodic probes): the share of "
                  "spec rounds at each D, and the mean D per category.", "",
                  "| condition | rounds | mean D | per category | share of rounds per D |",
                  "|---|---:|---:|---|---|"]
        for key, chosen in decision["draft_lengths"].items():
            shares = ", ".join(f"D={d}: {100 * s:.0f} %" for d, s in chosen["share"].items())
            per = ", ".join(f"{c} {m:.2f}" for c, m in chosen.get("by_category", {}).items())
            lines.append(f"| {key} | {chosen['rounds']} | {chosen['mean']:.2f} | {per} | "
                         f"{shares} |")
    if not decision.get("throughput"):
        lines += ["", "## Throughput", "", "Not available: these records predate the eval "
                  "clock (their start times cannot be placed on one timeline)."]
    else:
        lines += ["", "## Throughput", "",
                  "Aggregate output tokens/s per arm = output tokens / wall time, where the wall "
                  "time is the union of the arm's request intervals on the eval's clock (the "
                  "other arm's turns and the gaps between batches are not counted).", "",
                  "| condition | arm | requests | output tokens | wall s | tokens/s |",
                  "|---|---|---:|---:|---:|---:|"]
        for key, arms in decision["throughput"].items():
            for arm, t in arms.items():
                lines.append(f"| {key} | {arm} | {t['requests']} | {t['output_tokens']} | "
                             f"{t['wall_s']:.2f} | {t['tokens_per_s']:.1f} |")
    lines += ["", *goodput_lines(decision.get("goodput"), recipe.decide.slo)]
    lines += ["", *deployment_lines(decision)]
    from trtspec.audit import markdown_lines as audit_lines  # the audit's module imports torch
    lines += ["", *audit_lines(decision)]
    lines += ["", "Speedup = baseline / speculative on the primary metric (> 1: speculation is "
              "faster), from the same requests with the same seeds.", ""]
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines))


def unpaired_note(n: int) -> str:
    return (f"Ignored {n} record{'s' * (n != 1)} measured in one arm only (the eval was "
            "interrupted between arms): resume it to measure the other arm.")


def incomplete_note(decision: dict[str, Any]) -> str:
    measured, expected = decision.get("measured_records"), decision.get("expected_records")
    if not expected or measured >= expected:
        return ""
    return (f"The eval is incomplete: {measured} of {expected} records measured. No condition "
            "is GO until it is resumed and finished (the requests not yet measured may be "
            "the slow ones).")


def summary_lines(verdicts: list[Verdict], decision: dict[str, Any], threshold: float
                  ) -> list[str]:
    """Per method, in words: where it is GO, else its best condition, why, and what would
    change the verdict (more requests for a straddling CI; the draft cost the cost model says
    would break even)."""
    lines = []
    overall = [v for v in verdicts if v.category == "all"]
    by_category: dict[str, list[Verdict]] = {}
    for v in verdicts:
        if v.category != "all":
            by_category.setdefault(v.condition, []).append(v)
    for method in sorted({v.condition.split("/")[0] for v in overall}):
        mine = [v for v in overall if v.condition.startswith(method + "/")]
        go = [v for v in mine if v.verdict == GO]
        if go:
            where = "; ".join(f"{v.condition} ({v.speedup:.2f}×, CI {v.ci[0]:.2f}–"
                              f"{v.ci[1]:.2f}×)"
                              + _categories(by_category, v, NO_GO, " but NO-GO for {}")
                              for v in go)
            notes = [f"{v.condition}: {c}" for v in go for c in v.caveats]
            lines.append(f"- **{method}: GO** for {where}."
                         + (f" Caveats: {'; '.join(notes)}." if notes else ""))
            continue
        best = max(mine, key=lambda v: v.speedup if v.speedup == v.speedup else -1.0)
        text = f"- **{method}: not GO overall.** Best measured: {best.condition}, "
        text += (f"{best.speedup:.2f}× (95 % CI {best.ci[0]:.2f}–{best.ci[1]:.2f}×), "
                 if best.speedup == best.speedup else "")
        text += f"{best.verdict}: {'; '.join(best.reasons) or '—'}."
        text += _what_would_change(best, decision["cost_model"].get(best.condition), threshold)
        text += "".join(_categories(by_category, v, GO, f" Within {v.condition} it is GO for {{}}.")
                        for v in mine)
        lines.append(text)
    return lines or ["- No conditions were measured."]


def _categories(by_category: dict[str, list[Verdict]], v: Verdict, verdict: str, form: str
                ) -> str:
    """``form`` filled with the categories of v's condition that have this verdict, or ''."""
    names = [c.category for c in by_category.get(v.condition, []) if c.verdict == verdict]
    return form.format(", ".join(names)) if names else ""


def _what_would_change(v: Verdict, model: dict[str, Any] | None, threshold: float) -> str:
    if v.verdict == INCONCLUSIVE and v.ci[0] < threshold <= v.ci[1]:
        needed = requests_to_resolve(v.requests, v.speedup, v.ci, threshold)
        if needed:
            return f" About {needed} paired requests would resolve it (the CI narrows as 1/√n)."
        return " The speedup sits at the threshold: more requests will not make it a clear GO."
    if model and v.speedup == v.speedup and v.speedup < threshold:
        d, alpha = model["draft_len"], model["alpha"]
        if not isinstance(d, int):  # adaptive: the D its rounds drafted on average
            d = max(1, round(model.get("mean_drafts") or 1))
        c_max = (leviathan(alpha, d, 0.0) / threshold - 1) / d if d else 0.0
        if c_max <= 0:
            return (f" At acceptance α = {alpha:.2f} even a free draft cannot reach "
                    f"{threshold:.2f}× with D = {d}: acceptance must rise.")
        return (f" To reach {threshold:.2f}× at α = {alpha:.2f}, D = {d}, a draft step must cost "
                f"≤ {c_max:.2f} target steps (measured c = {model['c']:.2f}).")
    return ""


def _row(v: Verdict, with_category: bool = False) -> str:
    mark = f"**{v.verdict}**" if v.verdict == GO else v.verdict  # plain words: fonts vary
    cat = f" {v.category} |" if with_category else ""
    units = f" ({v.units} {v.unit}s)" if v.unit == "turn" and v.units else ""
    test = "—" if v.p != v.p or v.level != v.level else f"p = {v.p:.2g} vs {v.level:.2g}"
    return (f"| {v.condition} |{cat} {mark} | {v.speedup_text} | {v.ci_text} | {v.requests}"
            f"{units} | {test} | {'; '.join(v.reasons) or '—'} | {'; '.join(v.caveats) or '—'} |")


def _error_text(verdicts: list[Verdict], decision: dict[str, Any]) -> str:
    """How the speedup tests' error is controlled, in words."""
    families = sorted({(v.alpha, v.family) for v in verdicts if v.family}, reverse=True)
    text = ("Each cell's speedup (condition × category) has a one-sided p-value from a paired "
            "bootstrap that resamples the independent unit: the request at c = 1, the turn "
            "(requests that ran together) at c > 1 or with a request rate. ")
    if not families:
        return text
    if looks := decision.get("sequential"):
        text += (f"The eval looked at its data {len(looks['looks'])} time(s), adding requests "
                 "to the undecided conditions (`--until-decided`); α is spent over the looks ("
                 f"{looks['method']}), so a condition is judged at the α of its last look. ")
    spent = "; ".join(f"{100 * a:.2g} % over {m} cells" for a, m in families)
    return text + (f"Holm's step-down keeps the chance of any wrong GO, and of any wrong "
                   f"speedup NO-GO, ≤ the family-wise error per direction ({spent}); 'p vs "
                   "level' is the one-sided p on the side of the estimate and what it was "
                   "compared with. The gates are tested per cell at 2.5 %, outside that family.")


def _more_requests_text(decision: dict[str, Any]) -> str:
    """What raises the requests per category for this eval's workloads."""
    if all(s == "builtin" or s.startswith("speed-bench") for s in
           decision.get("workload_sources") or ["custom"]):
        return "raise eval.per_category or --per-category, or run `trtspec eval --until-decided`"
    return ("a custom JSONL runs whole: add requests of these categories to it, or run "
            "`trtspec eval --until-decided` with a JSONL that has unused rows")


def all_go(verdicts: list[Verdict]) -> bool:
    return all(v.verdict == GO for v in verdicts if v.category == "all")


# ---- HTML (self-contained: plots embedded as PNG data URIs) -----------------------------------

def html(eval_id: str, recipe: Recipe, verdicts: list[Verdict], decision: dict[str, Any],
         records: list[dict[str, Any]], summary: dict[str, Any]) -> str:
    import html as escape

    text = markdown(eval_id, recipe, verdicts, decision)
    body = []
    table: list[str] = []
    for line in text.splitlines():
        if line.startswith("|"):
            if not set(line) <= set("|-: "):
                cells = [_bold(escape.escape(c.strip())) for c in line.strip("|").split("|")]
                tag = "th" if not table else "td"
                table.append("<tr>" + "".join(f"<{tag}>{c}</{tag}>" for c in cells) + "</tr>")
            continue
        if table:
            body.append("<table>" + "".join(table) + "</table>")
            table = []
        if line.startswith("# "):
            body.append(f"<h1>{escape.escape(line[2:])}</h1>")
        elif line.startswith("## "):
            body.append(f"<h2>{escape.escape(line[3:])}</h2>")
        elif line.startswith("- "):
            body.append(f"<p>• {_bold(escape.escape(line[2:]))}</p>")
        elif line.strip():
            body.append(f"<p>{_bold(escape.escape(line))}</p>")
    if table:
        body.append("<table>" + "".join(table) + "</table>")
    body.append("<h2>Plots</h2>")
    from trtspec.plots import plots

    for title, png in plots(verdicts, decision, records, summary):
        wide = ' class="wide"' if "CDF" in title else ""
        body.append(f'<figure{wide}><img alt="{title}" src="data:image/png;base64,{png}">'
                    f"<figcaption>{title}</figcaption></figure>")
    style = ("body{font-family:system-ui,sans-serif;max-width:1100px;margin:2em auto;"
             "color:#222}table{border-collapse:collapse;margin:1em 0;font-size:14px}"
             "td,th{border:1px solid #ccc;padding:4px 8px}th{background:#f3f3f3}"
             "figure{display:inline-block;margin:8px}img{max-width:520px}"
             ".wide img{max-width:1040px}")
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>{eval_id}</title>"
            f"<style>{style}</style></head><body>{''.join(body)}</body></html>\n")


def _bold(text: str) -> str:
    return re.sub(r"\*\*(.+?)\*\*", r"<b>\1</b>", text)
