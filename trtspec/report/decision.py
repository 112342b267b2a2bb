"""``trtspec decide`` on an eval folder: the verdicts (with the audit as a gate and
``--until-decided``'s looks), the cost model, crossover, memory and schedules, assembled into
``decision.json`` (what ``serve --policy`` and ``approve`` read), then written out as the report.
Kept apart from :mod:`~trtspec.report.render`, which only turns a decision into text."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

from trtspec.analysis.cost_model import cost_models
from trtspec.analysis.decide import (
    GO,
    INCONCLUSIVE,
    Verdict,
    ci_text,
    decide,
)
from trtspec.analysis.extract import pairs, statistic_for
from trtspec.analysis.goodput import goodput_table
from trtspec.analysis.policy import apply_where
from trtspec.analysis.records import (
    arm_throughput,
    chosen_draft_lengths,
    drop_unpaired,
)
from trtspec.analysis.schedules import deployment
from trtspec.build.recipe import Recipe
from trtspec.eval.confirm import side_by_side
from trtspec.report.header import header_rows
from trtspec.report.render import html, markdown


def make_decision(out_dir: str | Path, recipe: Recipe, records: list[dict[str, Any]]
                  ) -> tuple[list[Verdict], dict[str, Any]]:
    """Verdicts, the apply-where table and the cost model; writes decision.json + report.md."""
    from trtspec.audit.endpoint import audit_of_this_eval
    from trtspec.audit.file import read_audit
    from trtspec.build.files import write_atomic
    from trtspec.eval import in_process
    from trtspec.eval.folder import arms_of, completeness, meta_if_any
    from trtspec.eval.run import DIVERGENCES, read_jsonl
    from trtspec.eval.sequential import cut_short, read_sequential

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
    # where the verdicts judge TPOT, the cost model tests its prediction against their figure
    # and CI, so the report shows one interval per figure
    figures = {v.condition: (v.speedup, v.ci) for v in verdicts if v.category == "all"
               and v.speedup == v.speedup} if metric in ("tpot", "tpot_p50") else None
    models = cost_models(records, recipe.sampling.seed,
                         statistic_for("tpot" if metric == "goodput" else metric), figures)
    decision = {"header": header_rows(out, recipe, records, verdicts, sequential),
                "criteria": recipe.decide.model_dump(), "greedy": greedy,
                "throughput": arm_throughput(records),
                "draft_lengths": chosen_draft_lengths(records),
                "verdicts": [asdict(v) for v in verdicts], "apply_where": apply_where(verdicts),
                "sequential": sequential,
                "confirmation": side_by_side(out, verdicts,
                                             lambda v: ci_text(v, recipe.decide)),
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
