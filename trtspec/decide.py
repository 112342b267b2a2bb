"""Go / no-go per condition, from paired records, with confidence intervals and a cost model.

The verdict comes from time per token, not acceptance: a setting that is accepted often but
costs more per round is a NO-GO. For each condition (method × D × concurrency), and for each
category within it:

* **speedup** = baseline TPOT p50 / spec TPOT p50 (the recipe's ``decide.primary_metric``),
  with a 95 % CI from a *paired* bootstrap: requests are resampled, and each resampled request
  brings its baseline and spec measurement together (same prompt, same seed).
* **gates**: TTFT p99 and E2E p99 may not regress beyond the recipe's limits; at temperature 0
  the spec output must equal the baseline output (greedy identity); the method's exactness
  audit (``trtspec audit``) must pass; on a GPU, peak memory must leave
  ``min_gpu_memory_headroom`` free; too few requests → no verdict.
* **verdict**: GO when no gate fails and the CI's lower bound ≥ ``min_speedup``; NO-GO when a
  gate fails or the CI's upper bound < ``min_speedup``; INCONCLUSIVE otherwise (the CI straddles
  the threshold, too few requests, or an in-process eval whose method was never audited while
  the recipe requires it).

The cost model takes α (acceptance rate) and c (draft step / target step, derived from the
records: a round costs D·c + 1 target steps) and predicts Leviathan's speedup
(1 − α^(D+1)) / ((1 − α)(D·c + 1)) per D, next to the measured one, with the D it recommends.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from trtspec.metrics import RequestTiming
from trtspec.recipe import Decide

GO, NO_GO, INCONCLUSIVE = "GO", "NO-GO", "INCONCLUSIVE"


@dataclass
class Verdict:
    condition: str
    category: str  # "all" or a category
    verdict: str
    speedup: float
    ci: tuple[float, float]
    requests: int
    reasons: list[str] = field(default_factory=list)

    @property
    def speedup_text(self) -> str:
        return "—" if self.speedup != self.speedup else f"{self.speedup:.2f}×"  # NaN: no pairs

    @property
    def ci_text(self) -> str:
        return "—" if self.ci[0] != self.ci[0] else f"{self.ci[0]:.2f}–{self.ci[1]:.2f}×"


def tpot(r: dict[str, Any]) -> float | None:
    """A record's TPOT, by the one definition in trtspec.metrics.RequestTiming."""
    return RequestTiming(r.get("start_s", 0.0), r["token_times_s"], r["e2e_s"],
                         r["output_tokens"]).tpot


def _metric(r: dict[str, Any], name: str) -> float | None:
    """Per-request seconds (lower is better) whose baseline/spec median ratio is the speedup:
    TPOT, E2E, or E2E per output token for ``throughput`` (prefill included)."""
    if name == "e2e_p50":
        return r["e2e_s"]
    if name == "throughput":
        return r["e2e_s"] / r["output_tokens"] if r["output_tokens"] else None
    return tpot(r)


def pairs(records: Sequence[dict[str, Any]], condition: str, category: str | None = None
          ) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(baseline, spec) records of the same request in one condition."""
    arms: dict[str, dict[str, dict[str, Any]]] = {"baseline": {}, "spec": {}}
    for r in records:
        if r["condition"] == condition and (category is None or r["category"] == category):
            arms[r["arm"]][r["request_id"]] = r
    return [(arms["baseline"][k], arms["spec"][k]) for k in sorted(arms["spec"])
            if k in arms["baseline"]]


def paired_speedup(base: np.ndarray, spec: np.ndarray, resamples: int = 2000, seed: int = 0
                   ) -> tuple[float, tuple[float, float]]:
    """median(base) / median(spec) and its 95 % paired-bootstrap CI."""
    point = float(np.median(base) / np.median(spec))
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(base), size=(resamples, len(base)))
    boot = np.median(base[idx], axis=1) / np.median(spec[idx], axis=1)
    low, high = np.percentile(boot, [2.5, 97.5])
    return point, (float(low), float(high))


def judge(records: Sequence[dict[str, Any]], condition: str, criteria: Decide,
          greedy: bool, category: str | None = None, seed: int = 0,
          audit: dict[str, Any] | None = None, needs_audit: bool = False) -> Verdict:
    """``audit`` is audit.json (None: not run); ``needs_audit``: no GO without it."""
    matched = pairs(records, condition, category)
    metric = criteria.primary_metric
    values = [(_metric(b, metric), _metric(s, metric)) for b, s in matched]
    values = [(b, s) for b, s in values if b is not None and s is not None and s > 0]
    label = category or "all"
    if len(values) < criteria.min_requests:
        return Verdict(condition, label, INCONCLUSIVE, float("nan"), (float("nan"),) * 2,
                       len(values), [f"{len(values)} paired requests < min_requests "
                                     f"{criteria.min_requests}"])
    base, spec = (np.array(x) for x in zip(*values, strict=True))
    speedup, ci = paired_speedup(base, spec, seed=seed)
    reasons = _gates(matched, criteria, greedy)
    method = condition.split("/")[0]
    audited = (audit or {}).get("methods", {}).get(method)
    if audited and not audited["passed"]:
        reasons.append(f"exactness audit failed (p = {audited['p_value']:.2g} < "
                       f"{audited['threshold']:.2g}): the output distribution is not the "
                       "target's")
    if ci[1] < criteria.min_speedup:
        reasons.append(f"speedup CI {ci[0]:.2f}–{ci[1]:.2f}× is below "
                       f"{criteria.min_speedup:.2f}×")
    if reasons:
        verdict = NO_GO
    elif ci[0] >= criteria.min_speedup and needs_audit and not audited:
        verdict, reasons = INCONCLUSIVE, [f"{method} has no exactness audit: run `trtspec "
                                          "audit <eval dir>` (or set decide.require_audit: "
                                          "false)"]
    elif ci[0] >= criteria.min_speedup:
        verdict = GO
    else:
        verdict, reasons = INCONCLUSIVE, [f"speedup CI {ci[0]:.2f}–{ci[1]:.2f}× straddles "
                                          f"{criteria.min_speedup:.2f}×: measure more requests"]
    return Verdict(condition, label, verdict, speedup, ci, len(values), reasons)


def _gates(matched: list[tuple[dict[str, Any], dict[str, Any]]], criteria: Decide,
           greedy: bool) -> list[str]:
    reasons = []
    for name, limit in (("ttft_s", criteria.max_ttft_p99_regression),
                        ("e2e_s", criteria.max_e2e_p99_regression)):
        base = [b[name] for b, _ in matched if b.get(name) is not None]
        spec = [s[name] for _, s in matched if s.get(name) is not None]
        if base and spec:
            change = np.percentile(spec, 99) / np.percentile(base, 99) - 1
            if change > limit:
                reasons.append(f"{name.removesuffix('_s').upper()} p99 regressed "
                               f"{100 * change:.0f} % (limit {100 * limit:.0f} %)")
    peaks = [(s["cuda_max_allocated_mb"], s["cuda_total_mb"]) for _, s in matched
             if s.get("cuda_max_allocated_mb") is not None and s.get("cuda_total_mb")]
    if peaks:
        used, total = max(peaks)
        if 1 - used / total < criteria.min_gpu_memory_headroom:
            reasons.append(f"GPU memory headroom {100 * (1 - used / total):.0f} % < "
                           f"{100 * criteria.min_gpu_memory_headroom:.0f} % (peak "
                           f"{used / 1024:.1f} of {total / 1024:.1f} GiB)")
    if greedy:
        same = [b.get("output_digest") == s.get("output_digest") for b, s in matched]
        rate = float(np.mean(same)) if same else 1.0
        if rate < 1.0:
            reasons.append(f"greedy identity {100 * rate:.1f} % < 100 %: spec output differs "
                           "from the baseline")
    return reasons


def decide(records: Sequence[dict[str, Any]], criteria: Decide, greedy: bool, seed: int = 0,
           audit: dict[str, Any] | None = None, needs_audit: bool = False) -> list[Verdict]:
    """A verdict per condition (category 'all') and per category within it."""
    out = []
    for condition in sorted({r["condition"] for r in records}):
        for category in [None, *sorted({r["category"] for r in records
                                        if r["condition"] == condition})]:
            out.append(judge(records, condition, criteria, greedy, category, seed, audit,
                             needs_audit))
    return out


def apply_where(verdicts: Sequence[Verdict]) -> dict[str, dict[str, Any]]:
    """Per method: the conditions that are GO, and per concurrency the best GO draft length."""
    table: dict[str, dict[str, Any]] = {}
    for v in verdicts:
        if v.category != "all":
            continue
        method, d, c = v.condition.split("/")
        entry = table.setdefault(method, {"go": [], "best_d": {}})
        if v.verdict == GO:
            entry["go"].append(v.condition)
            best = entry["best_d"].get(c)
            if best is None or v.speedup > best[1]:
                entry["best_d"][c] = (int(d[1:]), v.speedup)
    return table


# ---- cost model ------------------------------------------------------------------------------

def leviathan(alpha: float, d: int, c: float) -> float:
    """Expected speedup with i.i.d. acceptance α, D drafts, draft/target step cost ratio c."""
    emitted = d + 1 if alpha >= 1.0 else (1 - alpha ** (d + 1)) / (1 - alpha)
    return emitted / (d * c + 1)


def recommend_d(alpha: float, c: float, max_d: int = 16) -> int:
    return max(range(1, max_d + 1), key=lambda d: leviathan(alpha, d, c))


def cost_model(records: Sequence[dict[str, Any]], condition: str) -> dict[str, float]:
    """α, c and predicted vs measured speedup for one condition, from its records.

    c comes from time per round: a spec round lasts D·c + 1 baseline steps (Leviathan's model,
    verification ≈ one target step), so c = (round / step − 1) / D.
    """
    matched = pairs(records, condition)
    d = int(condition.split("/")[1][1:])
    step = np.median([t for b, _ in matched if (t := tpot(b)) is not None])
    spec = [s for _, s in matched if s["verification_rounds"]]
    proposed = sum(s["proposed_tokens"] for s in spec)
    alpha = sum(s["accepted_draft_tokens"] for s in spec) / proposed if proposed else 0.0
    round_time = np.median([(s["e2e_s"] - s["token_times_s"][0]) / s["verification_rounds"]
                            for s in spec])
    c = max(0.0, (round_time / step - 1) / d) if d else 0.0
    base = np.array([t for b, _ in matched if (t := tpot(b)) is not None])
    spec_tpot = np.array([t for _, s in matched if (t := tpot(s)) is not None])
    return {"alpha": alpha, "c": c, "draft_len": d, "predicted_speedup": leviathan(alpha, d, c),
            "measured_speedup": float(np.median(base) / np.median(spec_tpot)),
            "recommended_d": recommend_d(alpha, c)}
