"""The approval report as text, from a decision (:mod:`~trtspec.report.decision` assembles it):
``report.html`` (self-contained, plots embedded) and its markdown twin ``report.md``."""

from __future__ import annotations

import re
from typing import Any

from trtspec.analysis.cost_model import leviathan
from trtspec.analysis.decide import (
    GO,
    INCONCLUSIVE,
    NO_GO,
    Verdict,
    ci_phrase,
    ci_text,
    no_interval_why,
)
from trtspec.analysis.extract import SPEEDUP_MEANS
from trtspec.analysis.gates import P90_MIN, P99_MIN
from trtspec.analysis.goodput import markdown_lines as goodput_lines
from trtspec.analysis.records import (
    condition_parts,
)
from trtspec.analysis.schedules import deployment_lines
from trtspec.analysis.stats import MIN_UNITS
from trtspec.build.recipe import Decide, Recipe
from trtspec.eval.sequential import looks_lines


def markdown(eval_id: str, recipe: Recipe, verdicts: list[Verdict], decision: dict[str, Any]
             ) -> str:
    c = recipe.decide
    lines = [
        f"# Speculative decoding: go / no-go — {recipe.name} ({eval_id})", "",
        *(["| what | value |", "|---|---|",
            *(f"| {name} | {value} |" for name, value in decision["header"]), ""]
          if decision.get("header") else []),
        "GO when the speedup is shown above min_speedup and no gate fails. "
        + _error_text(verdicts, decision) + " Each latency gate fails only when its 95 % "
        "interval lies above its limit: order-statistic bounds on each arm's tail "
        "(distribution-free for independent requests; turns count as one observation each), "
        f"at the highest percentile the units can bound (p99 from {P99_MIN}, p90 from "
        f"{P90_MIN}, else the median), tested once, on every record the verdict uses."
        + (" Greedy identity: every spec output equals its baseline except numerical ties "
           "(target logit margin at the first difference within the tie margin)."
           if decision["greedy"] else ""),
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
            lines.append(_row(v, c))
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
                  *(_row(v, c, True) for v in decided), ""]
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
    lines += cost_model_lines(decision["cost_model"], verdicts, c)
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
    lines += ["", *audit_section(decision)]
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
    """Per method, in words: where it is GO (and what serving it does to the categories that
    are not), else its best condition, why, and what would change the verdict (more requests
    for a straddling CI; the draft cost the cost model says would break even)."""
    lines = []
    criteria = Decide.model_validate(decision["criteria"]) if decision.get("criteria") \
        else None
    overall = [v for v in verdicts if v.category == "all"]
    by_category: dict[str, list[Verdict]] = {}
    for v in verdicts:
        if v.category != "all":
            by_category.setdefault(v.condition, []).append(v)
    for method in sorted({v.condition.split("/")[0] for v in overall}):
        mine = [v for v in overall if v.condition.startswith(method + "/")]
        go = [v for v in mine if v.verdict == GO]
        if go:
            where = "; ".join(f"{v.condition} ({v.speedup:.2f}×, {ci_phrase(v, criteria, 'CI')})"
                              for v in go)
            notes = [f"{v.condition}: {c}" for v in go for c in v.caveats]
            lines.append(f"- **{method}: GO** for {where}."
                         + (f" Caveats: {'; '.join(notes)}." if notes else "")
                         + "".join(served_anyway(by_category.get(v.condition, []), v,
                                                 decision.get("policy"), threshold)
                                   for v in go))
            continue
        best = max(mine, key=lambda v: v.speedup if v.speedup == v.speedup else -1.0)
        text = f"- **{method}: not GO overall.** Best measured: {best.condition}, "
        text += (f"{best.speedup:.2f}× ({ci_phrase(best, criteria)}), "
                 if best.speedup == best.speedup else "")
        text += f"{best.verdict}: {'; '.join(best.reasons) or '—'}."
        text += _what_would_change(best, decision["cost_model"].get(best.condition), threshold)
        text += "".join(_categories(by_category, v, GO, f" Within {v.condition} it is GO for {{}}.")
                        for v in mine)
        lines.append(text)
    return lines or ["- No conditions were measured."]


def served_anyway(cells: list[Verdict], v: Verdict, policy: dict[str, Any] | None,
                  threshold: float) -> str:
    """What serving GO condition ``v`` does with the traffic of its categories that are not GO
    (``cells``: its per-category verdicts), or ''. `trtspec serve` picks the method and D by
    the number of running requests, never by category, so that traffic is speculated too: a
    reviewer must know the GO covers requests where no gain was shown."""
    off = [c for c in cells if c.verdict != GO]
    if not off:
        return ""
    method, d, _ = condition_parts(v.condition)
    served = bool(policy) and policy.get("method") == method and any(
        x == d for _, x in policy.get("schedule", []))
    who = f"the written policy runs {method} at D = {d}" if served else \
        f"a policy that serves {v.condition} runs {method} at D = {d}"
    verdicts = ", ".join(f"{c.category} {c.verdict} ({_not_go_why(c, threshold)})"
                         for c in off)
    names = " and ".join(c.category for c in off)
    held = any(c.verdict != NO_GO and c.ci[0] > threshold for c in off)  # a gain, held back
    return (f" Within {v.condition}, {verdicts}. `trtspec serve` picks D by the number of "
            f"running requests, not by category: {who} on all traffic, so {names} requests "
            "are speculated too, " + ("without a GO of their own" if held else
                                      "with no gain shown for them")
            + " (send them to a plain-decoding server where that matters).")


def _not_go_why(c: Verdict, threshold: float) -> str:
    """A category's verdict other than GO, in a few words."""
    if c.verdict == NO_GO:
        return f"shown below {threshold:.2f}×" if c.ci[1] < threshold else "a gate failed"
    if c.speedup != c.speedup:
        return "too few requests to judge"
    if c.ci[0] > threshold:
        return "speedup shown, but a check holds it"
    return f"not shown above {threshold:.2f}×"


def _categories(by_category: dict[str, list[Verdict]], v: Verdict, verdict: str, form: str
                ) -> str:
    """``form`` filled with the categories of v's condition that have this verdict, or ''."""
    names = [c.category for c in by_category.get(v.condition, []) if c.verdict == verdict]
    return form.format(", ".join(names)) if names else ""


def _what_would_change(v: Verdict, model: dict[str, Any] | None, threshold: float) -> str:
    if v.verdict == INCONCLUSIVE and v.ci[0] < threshold <= v.ci[1]:
        if v.requests_needed:
            return (f" About {v.requests_needed} paired requests in all would show it at p ≤ "
                    f"{v.level:.2g}, the level it is judged at, if the spread stays as measured.")
        return " The speedup sits at the threshold: more requests will not make it a clear GO."
    if model and v.speedup == v.speedup and v.speedup < threshold:
        d, a = model["draft_len"], model["alpha"]  # a: per-token acceptance
        if not isinstance(d, int):  # adaptive: the D its rounds drafted on average
            d = max(1, round(model.get("mean_drafts") or 1))
        rough = " (a rough guide: the cost model does not explain this condition's " \
            "measurement)" if model.get("prediction_within_ci") is False else ""
        c_max = (leviathan(a, d, 0.0) / threshold - 1) / d if d else 0.0
        if c_max <= 0:
            return (f" At per-token acceptance a = {a:.2f} even a free draft cannot reach "
                    f"{threshold:.2f}× with D = {d}: acceptance must rise{rough}.")
        return (f" To reach {threshold:.2f}× at per-token acceptance a = {a:.2f}, D = {d}, a "
                f"draft step must cost ≤ {c_max:.2f} target steps (measured c = "
                f"{model['c']:.2f}){rough}.")
    return ""


def _row(v: Verdict, criteria: Decide, with_category: bool = False) -> str:
    mark = f"**{v.verdict}**" if v.verdict == GO else v.verdict  # plain words: fonts vary
    cat = f" {v.category} |" if with_category else ""
    units = f" ({v.units} {v.unit}s)" if v.unit == "turn" and v.units else ""
    test = "—" if v.p != v.p or v.level != v.level else f"p = {v.p:.2g} vs {v.level:.2g}"
    return (f"| {v.condition} |{cat} {mark} | {v.speedup_text} | {ci_text(v, criteria)} | "
            f"{v.requests}"
            f"{units} | {test} | {'; '.join(v.reasons) or '—'} | {'; '.join(v.caveats) or '—'} |")


def cost_model_lines(models: dict[str, dict[str, Any]], verdicts: list[Verdict],
                     criteria: Decide) -> list[str]:
    """The cost model's section: per condition a, c, D̄, the prediction beside the measured
    speedup, and what the comparison means for planning D. The measured figure is the
    verdict's where the verdicts judge TPOT, and then its CI is left to the verdict table: one
    interval per figure."""
    if not models:
        return []
    overall = {v.condition: v for v in verdicts if v.category == "all"}
    own = [m for m in models.values() if m.get("measured_from", "tpot") != "verdict"]
    means = SPEEDUP_MEANS["tpot" if criteria.primary_metric in ("tpot", "goodput")
                          else "tpot_p50"]
    verdict_s = ("measured = the verdict table's speedup of the same condition (its 95 % CI "
                 "is in that table)")
    if not own:
        measured = verdict_s
    elif criteria.primary_metric not in ("tpot", "tpot_p50"):
        measured = (f"measured = {means}, with its 95 % paired CI (the verdicts judge "
                    f"{criteria.primary_metric}: this TPOT figure and its CI appear only here)")
    else:  # the verdict had no speedup for some: the cost model measured its own
        measured = f"{verdict_s}, or where the verdict has none, {means} with its 95 % CI here"
    lines = ["", "## Cost model (Leviathan et al.)", "",
             "a = per-token acceptance probability (Leviathan et al.'s α, called a here so it "
             "is not confused with the tests' significance level α), accepted / (accepted + "
             "rejected rounds) (the i.i.d. maximum-likelihood estimate; not accepted / "
             "proposed); c = cost of one drafted token in target steps, from round times (a "
             "round with n drafts lasts 1 + n·c steps); D̄ = drafts per round as proposed; "
             "predicted TPOT speedup = (1 + Σᵢ P(draft at i)·a^(i+1)) / (1 + D̄·c), which is "
             "(1 − a^(D+1)) / ((1 − a)(D·c + 1)) when every round drafts D; " + measured + ".",
             "",
             "**Explains the measurement?** Yes when the prediction falls inside the measured "
             "speedup's 95 % CI: a and c account for the speedup, so they can plan other D, "
             "and the recommended D (the one that maximises the prediction) is worth "
             "measuring. No when it falls outside: something the model leaves out (acceptance "
             "that varies by position or request, overhead beyond 1 + D·c) moves the speedup, "
             "so do not extrapolate from it: its recommended D is no guide; measure D instead.",
             "", "| condition | a | c | D̄ | predicted | measured | explains the measurement? "
             "| recommended D |", "|---|---:|---:|---:|---:|---:|---|---|"]
    for key, m in models.items():
        best = str(m["recommended_d"] or "0 (do not speculate)")
        low, high = m.get("measured_ci") or (float("nan"),) * 2
        value = f"{m['measured_speedup']:.2f}×"
        if m.get("measured_from", "tpot") != "verdict":  # a figure of its own: its CI, once
            if low == low and high == high:
                value += f" (95 % CI {low:.2f}–{high:.2f}×)"
            why = f"{m.get('measured_units', 0)} independent units < {MIN_UNITS}"
        else:
            why = no_interval_why(overall[key], criteria) if key in overall else "no verdict"
        within = m.get("prediction_within_ci")
        if within:
            verdict = "yes: plan other D with its a and c"
        elif within is None:
            verdict = f"untested: no 95 % CI ({why})"
            best += "; untested"
        else:
            verdict = "no: do not extrapolate from it"
            best += "; no guide: the model misses"
        lines.append(f"| {key} | {m['alpha']:.2f} | {m['c']:.2f} | "
                     f"{m.get('mean_drafts', m['draft_len']):.2f} | "
                     f"{m['predicted_speedup']:.2f}× | {value} | {verdict} | {best} |")
    return lines


def _error_text(verdicts: list[Verdict], decision: dict[str, Any]) -> str:
    """How the speedup tests' error is controlled, in words."""
    families = sorted({(v.alpha, v.family) for v in verdicts if v.family}, reverse=True)
    units = sorted({v.unit for v in verdicts if v.units})
    text = ("Each cell's speedup (condition × category) has a one-sided p-value over its "
            "independent units (here: " + (", ".join(f"{u}s" for u in units) or "none") + "; "
            "the request at c = 1, the turn of requests that ran together at c > 1 or with a "
            "request rate, and a prompt's `--repeat` copies together as one): for the geometric "
            "mean of per-request ratios, the larger of Student's t (G − 1 degrees of freedom) "
            "and the bootstrap-t's, calibrated at the small levels below "
            "(`benchmarks/bench_calibration.py`); for a ratio of medians or goodput, Student's "
            "t on a cluster-bootstrap standard error. ")
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
                   "compared with. The latency gates are tested per cell at 2.5 % per side, "
                   "outside that family, once: an eval's looks leave them out.")


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
    from trtspec.report.plots import plots

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


def audit_section(decision: dict[str, Any]) -> list[str]:
    """The report's "Exactness audit" section, from decision.json: why there is none, or the
    audit's own tables (in process or at an endpoint)."""
    audit = decision.get("audit")
    lines = ["## Exactness audit", ""]
    how = ("`trtspec audit --eval <eval dir>` compares the speculating server's first output "
           "tokens with the plain server's, and `trtspec decide` then uses it as a gate.")
    if not decision.get("audit_applies"):
        return lines + ["Not applicable: greedy requests at an endpoint are gated by greedy "
                        "identity (the sampler runs in the server). " + how]
    if audit is None:
        return lines + ["Not run: " + (how if decision.get("endpoint_eval") else
                        "`trtspec audit <eval dir>` samples the first output tokens on these "
                        "models, through the serving scheduler, and tests them against the "
                        "target's exact probabilities.")]
    if audit.get("kind") == "endpoint":
        from trtspec.audit.endpoint import markdown_lines
    else:
        from trtspec.audit.inprocess import markdown_lines  # it imports torch
    return lines + markdown_lines(audit)
