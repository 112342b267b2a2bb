"""Go / no-go per condition, from paired records, with confidence intervals and a cost model.

The verdict comes from time per token, not acceptance: a setting that is accepted often but
costs more per round is a NO-GO. For each condition (method × D × concurrency), and for each
category within it:

* **speedup** = baseline / spec median of the recipe's ``decide.primary_metric`` (TPOT, E2E or
  E2E per output token), with a 95 % CI from a *paired* bootstrap: requests are resampled, and
  each resampled request brings its baseline and spec measurement together (same prompt, seed).
* **gates** (each a statistic, never a single number):
  - TTFT and E2E regression = spec / baseline percentile − 1, with a paired-bootstrap 95 % CI.
    The percentile follows the sample: p99 from ``P99_MIN`` paired requests, p90 from
    ``P90_MIN``, the median below that (a p99 of 8 requests is their maximum). The gate fails
    only when the CI's lower bound exceeds the limit (a demonstrated regression). A CI that
    straddles the limit holds the verdict at INCONCLUSIVE when the estimate itself is over the
    limit, and leaves it standing with a caveat when the estimate is within it.
  - greedy identity (temperature 0): a spec output that differs from its baseline fails the
    gate unless, at the first difference, the target's logits of the two tokens are within the
    tie margin (a numerical near-tie; counted and reported apart); a difference whose margin
    was never measured holds the verdict at INCONCLUSIVE.
  - the method's exactness audit (``trtspec audit``) must pass; a weak audit (few rejections
    seen) cannot support a GO.
  - on a GPU, peak memory must leave ``min_gpu_memory_headroom`` free.
  - a request that failed at an endpoint and was never measured again holds the verdict at
    INCONCLUSIVE (the failures may be the slowest requests).
* **verdict**: NO-GO when a gate fails or the CI's upper bound < ``min_speedup``; INCONCLUSIVE
  when something holds it (see above, a CI straddling ``min_speedup``, too few requests, no
  audit where one is required); GO otherwise. When the arms do not differ, noise moves a
  verdict between GO and INCONCLUSIVE, not to NO-GO (each test errs at most 2.5 % one-sided).

The cost model (:mod:`trtspec.cost_model`) estimates α, the per-token acceptance probability of
Leviathan et al. (accepted / (accepted + rejected rounds), the i.i.d. maximum-likelihood
estimate; not the acceptance *rate* accepted / proposed), and c, the cost of one drafted token
in target steps from round times, and predicts the speedup from the drafts as proposed (=
(1 − α^(D+1)) / ((1 − α)(D·c + 1)) when every round drafts D) next to the measured one and its
CI.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from trtspec.metrics import RequestTiming, condition_parts, failed, unanswered
from trtspec.recipe import Decide

GO, NO_GO, INCONCLUSIVE = "GO", "NO-GO", "INCONCLUSIVE"
P99_MIN, P90_MIN = 100, 20  # paired requests a gate needs before it may use p99 / p90


@dataclass
class Verdict:
    condition: str
    category: str  # "all" or a category
    verdict: str
    speedup: float
    ci: tuple[float, float]
    requests: int
    reasons: list[str] = field(default_factory=list)  # why not GO
    caveats: list[str] = field(default_factory=list)  # what a reviewer should know anyway
    greedy: dict[str, int] | None = None  # identical / ties / diverged, at temperature 0

    @property
    def speedup_text(self) -> str:
        return "—" if self.speedup != self.speedup else f"{self.speedup:.2f}×"  # NaN: no pairs

    @property
    def ci_text(self) -> str:
        return "—" if self.ci[0] != self.ci[0] else f"{self.ci[0]:.2f}–{self.ci[1]:.2f}×"


def tpot(r: dict[str, Any]) -> float | None:
    """A record's TPOT, by the one definition in trtspec.metrics.RequestTiming."""
    return RequestTiming.from_record(r).tpot


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
    """(baseline, spec) records of the same request in one condition; a request that failed in
    either arm (an endpoint error) has no pair."""
    arms: dict[str, dict[str, dict[str, Any]]] = {"baseline": {}, "spec": {}}
    for r in records:
        if r["condition"] == condition and (category is None or r["category"] == category) \
                and not failed(r):
            arms[r["arm"]][r["request_id"]] = r
    return [(arms["baseline"][k], arms["spec"][k]) for k in sorted(arms["spec"])
            if k in arms["baseline"]]


def _paired_bootstrap(base: np.ndarray, spec: np.ndarray, statistic: Any, resamples: int,
                      seed: int) -> tuple[float, tuple[float, float]]:
    """statistic(base, spec) and its 95 % paired-bootstrap CI: requests are resampled with
    their baseline and spec measurement together. ``statistic`` takes [n] or [resamples, n]
    arrays and reduces the last axis."""
    point = float(statistic(base, spec))
    idx = np.random.default_rng(seed).integers(0, len(base), size=(resamples, len(base)))
    low, high = np.percentile(statistic(base[idx], spec[idx]), [2.5, 97.5])
    return point, (float(low), float(high))


def paired_speedup(base: np.ndarray, spec: np.ndarray, resamples: int = 2000, seed: int = 0
                   ) -> tuple[float, tuple[float, float]]:
    """median(base) / median(spec) and its 95 % paired-bootstrap CI."""
    return _paired_bootstrap(
        base, spec, lambda b, s: np.median(b, axis=-1) / np.median(s, axis=-1), resamples, seed)


def gate_percentile(n: int) -> int:
    """The percentile a latency gate can estimate from n paired requests."""
    return 99 if n >= P99_MIN else 90 if n >= P90_MIN else 50


def paired_regression(base: np.ndarray, spec: np.ndarray, q: float, resamples: int = 2000,
                      seed: int = 0) -> tuple[float, tuple[float, float]]:
    """percentile_q(spec) / percentile_q(base) − 1 and its 95 % paired-bootstrap CI."""
    return _paired_bootstrap(
        base, spec, lambda b, s: np.percentile(s, q, axis=-1) / np.percentile(b, q, axis=-1) - 1,
        resamples, seed)


def requests_to_resolve(n: int, point: float, ci: tuple[float, float], limit: float
                        ) -> int | None:
    """Paired requests that would narrow a CI straddling ``limit`` until it excludes it,
    assuming the CI's side that crosses the limit shrinks as 1/√n; None when the estimate
    sits on the limit."""
    near = point - ci[0] if point > limit else ci[1] - point  # the side that crosses
    margin = abs(point - limit)
    if margin <= 0.01 * max(abs(limit), 1e-9):
        return None
    return max(n + 1, int(min(1e6, n * (near / margin) ** 2)) + 1)


def judge(records: Sequence[dict[str, Any]], condition: str, criteria: Decide,
          greedy: bool, category: str | None = None, seed: int = 0,
          audit: dict[str, Any] | None = None, needs_audit: bool = False,
          divergences: dict[tuple[str, str], dict[str, Any]] | None = None) -> Verdict:
    """``audit`` is audit.json (None: not run); ``needs_audit``: no GO without it;
    ``divergences``: (condition, request id) → the eval's divergences.jsonl entry.

    Three kinds of finding: ``fails`` (a demonstrated problem: NO-GO), ``holds`` (not shown
    either way: INCONCLUSIVE at best) and ``caveats`` (the verdict stands; say it)."""
    matched = pairs(records, condition, category)
    metric = criteria.primary_metric
    values = [(_metric(b, metric), _metric(s, metric)) for b, s in matched]
    values = [(b, s) for b, s in values if b is not None and s is not None and s > 0]
    label = category or "all"
    lost = len(unanswered([r for r in records if r["condition"] == condition
                           and (category is None or r["category"] == category)]))
    holds = [f"{lost} request(s) failed at the endpoint and have no measurement (a failure "
             "can hide the slowest requests): resume the eval to measure them"] if lost else []
    if len(values) < criteria.min_requests:
        return Verdict(condition, label, INCONCLUSIVE, float("nan"), (float("nan"),) * 2,
                       len(values), [f"{len(values)} paired requests < min_requests "
                                     f"{criteria.min_requests}", *holds])
    base, spec = (np.array(x) for x in zip(*values, strict=True))
    speedup, ci = paired_speedup(base, spec, seed=seed)
    fails, gate_holds, caveats = _latency_gates(matched, criteria, seed)
    holds += gate_holds
    fails += _memory_gate(matched, criteria)
    counts = None
    if greedy:
        counts, why, pending, note = _greedy_gate(matched, criteria, divergences or {})
        fails += why
        holds += pending
        caveats += note
    method = condition.split("/")[0]
    audited = (audit or {}).get("methods", {}).get(method)
    if audited and not audited["passed"]:
        fails.append(f"exactness audit failed (p = {audited['p_value']:.2g} < "
                     f"{audited['threshold']:.2g}): the output distribution is not the "
                     "target's")
    if ci[1] < criteria.min_speedup:
        fails.append(f"speedup CI {ci[0]:.2f}–{ci[1]:.2f}× is below "
                     f"{criteria.min_speedup:.2f}×")
    if needs_audit and not audited:
        holds.append(f"{method} has no exactness audit: run `trtspec audit <eval dir>` (or set "
                     "decide.require_audit: false)")
    if audited and audited.get("weak"):
        holds.append(f"the exactness audit of {method} is weak (too few rejections seen to test "
                     "the residual): re-run `trtspec audit` with more --samples or a --prompt "
                     "where drafts are rejected")
    if ci[0] < criteria.min_speedup <= ci[1]:
        holds.append(f"speedup CI {ci[0]:.2f}–{ci[1]:.2f}× straddles "
                     f"{criteria.min_speedup:.2f}×: measure more requests")
    verdict = NO_GO if fails else INCONCLUSIVE if holds else GO
    return Verdict(condition, label, verdict, speedup, ci, len(values), fails or holds, caveats,
                   counts)


def _latency_gates(matched: list[tuple[dict[str, Any], dict[str, Any]]], criteria: Decide,
                   seed: int) -> tuple[list[str], list[str], list[str]]:
    """TTFT and E2E regression gates: (fails, holds, caveats). A CI above the limit fails; a
    CI that straddles it holds the verdict at INCONCLUSIVE when the estimate itself is over the
    limit, and is a caveat when the estimate is within it."""
    fails, holds, caveats = [], [], []
    for name, limit in (("ttft_s", criteria.max_ttft_p99_regression),
                        ("e2e_s", criteria.max_e2e_p99_regression)):
        both = [(b[name], s[name]) for b, s in matched
                if b.get(name) is not None and s.get(name) is not None and b[name] > 0]
        if len(both) < 2:
            continue
        q = gate_percentile(len(both))
        stat = f"{name.removesuffix('_s').upper()} {'median' if q == 50 else f'p{q}'}"
        base, spec = (np.array(x) for x in zip(*both, strict=True))
        point, (low, high) = paired_regression(base, spec, q, seed=seed)
        span = f"95 % CI {100 * low:+.0f} … {100 * high:+.0f} %, limit {100 * limit:.0f} %"
        if low > limit:
            fails.append(f"{stat} regressed {100 * point:.0f} % ({span}, {len(both)} requests)")
            continue
        if high <= limit:
            continue
        n = requests_to_resolve(len(both), point, (low, high), limit)
        more = f"about {n} paired requests would resolve it" if n else \
            "the estimate sits on the limit"
        if point > limit:
            holds.append(f"{stat} regression of {100 * point:+.0f} % measured but not "
                         f"demonstrated ({span}); {more}")
        else:
            caveats.append(f"{stat} regression of {100 * limit:.0f} % not ruled out (measured "
                           f"{100 * point:+.0f} %, {span}); {more}")
    return fails, holds, caveats


def _memory_gate(matched: list[tuple[dict[str, Any], dict[str, Any]]], criteria: Decide
                 ) -> list[str]:
    peaks = [(s["cuda_max_allocated_mb"], s["cuda_total_mb"]) for _, s in matched
             if s.get("cuda_max_allocated_mb") is not None and s.get("cuda_total_mb")]
    if peaks:
        used, total = max(peaks)
        if 1 - used / total < criteria.min_gpu_memory_headroom:
            return [f"GPU memory headroom {100 * (1 - used / total):.0f} % < "
                    f"{100 * criteria.min_gpu_memory_headroom:.0f} % (peak "
                    f"{used / 1024:.1f} of {total / 1024:.1f} GiB)"]
    return []


TIE_MARGINS = {"float32": 0.01, "float16": 0.1, "bfloat16": 0.5}  # logits, by runner dtype


def tie_margin(criteria: Decide, dtype: str | None) -> float:
    """The logit margin under which a greedy divergence is a numerical tie: the recipe's
    ``greedy_tie_margin``, else one by the dtype the margin was measured in (a few ulps of a
    logit of magnitude ~20, with room for rounding that builds up over the layers)."""
    if criteria.greedy_tie_margin is not None:
        return criteria.greedy_tie_margin
    return TIE_MARGINS.get(dtype or "", TIE_MARGINS["bfloat16"])


def _greedy_gate(matched: list[tuple[dict[str, Any], dict[str, Any]]], criteria: Decide,
                 divergences: dict[tuple[str, str], dict[str, Any]]
                 ) -> tuple[dict[str, int], list[str], list[str], list[str]]:
    """(counts, fails, holds, caveats). A spec output that differs from its baseline is a
    numerical tie when the target's logit margin between the two tokens at the first
    difference is within the tie margin, a divergence when it is not (or when one output
    stopped where the other went on), and unmeasured when the eval recorded no margin."""
    differ = [s for b, s in matched if b.get("output_digest") != s.get("output_digest")]
    ties = unmeasured = 0
    margins = set()
    for s in differ:
        d = divergences.get((s["condition"], s["request_id"]))
        if d is None:
            unmeasured += 1
        elif d.get("margin") is not None and d["margin"] <= tie_margin(criteria, d.get("dtype")):
            ties += 1
            margins.add(tie_margin(criteria, d.get("dtype")))
    n, diverged = len(matched), len(differ) - ties - unmeasured
    counts = {"identical": n - len(differ), "ties": ties, "diverged": diverged,
              "unmeasured": unmeasured}
    tol = "/".join(f"{m:g}" for m in sorted(margins))
    tie_text = f"{ties} at a numerical tie (logit margin ≤ {tol})"
    fails = [f"greedy identity {100 * (n - len(differ)) / n:.1f} %: {diverged} of {n} spec "
             "outputs differ from the baseline beyond a numerical tie"
             + (f" (+{tie_text})" if ties else "")] if diverged else []
    holds = [f"greedy identity: {unmeasured} of {n} spec outputs differ from the baseline "
             "with no logit margin recorded (an endpoint eval, or an eval stopped before "
             "measuring them: `--resume` it)"] if unmeasured else []
    caveats = [f"greedy identity: {n - ties} of {n} outputs identical, {tie_text}"] \
        if ties and not fails else []
    return counts, fails, holds, caveats


def decide(records: Sequence[dict[str, Any]], criteria: Decide, greedy: bool, seed: int = 0,
           audit: dict[str, Any] | None = None, needs_audit: bool = False,
           divergences: Sequence[dict[str, Any]] = ()) -> list[Verdict]:
    """A verdict per condition (category 'all') and per category within it."""
    by_pair = {(d["condition"], d["request_id"]): d for d in divergences}
    out = []
    for condition in sorted({r["condition"] for r in records}):
        for category in [None, *sorted({r["category"] for r in records
                                        if r["condition"] == condition})]:
            out.append(judge(records, condition, criteria, greedy, category, seed, audit,
                             needs_audit, by_pair))
    return out


def apply_where(verdicts: Sequence[Verdict]) -> dict[str, dict[str, Any]]:
    """Per method: the conditions that are GO, and per concurrency the best GO draft length
    (an int, or "adaptive")."""
    table: dict[str, dict[str, Any]] = {}
    for v in verdicts:
        if v.category != "all":
            continue
        method, d, _ = condition_parts(v.condition)  # d: an int or "adaptive"
        c = v.condition.split("/")[2]
        entry = table.setdefault(method, {"go": [], "best_d": {}})
        if v.verdict == GO:
            entry["go"].append(v.condition)
            best = entry["best_d"].get(c)
            if best is None or v.speedup > best[1]:
                entry["best_d"][c] = (d, v.speedup)
    return table


@dataclass(frozen=True)
class ServePolicy:
    """What `trtspec serve --policy` runs: ``method`` (none = plain decoding) and D by the
    number of running requests, as measured: ``schedule`` pairs (c, D) for every concurrency
    the eval measured, D = 0 where no draft length was GO there; more running requests than
    the highest measured c were not measured and get plain decoding."""

    method: str
    schedule: tuple[tuple[int, int | str], ...]
    go_methods: tuple[str, ...] = ()

    @property
    def text(self) -> str | None:
        """The schedule as ``--draft-len-schedule`` writes it, or None for plain decoding."""
        return ",".join(f"{c}:{d}" for c, d in self.schedule) if self.method != "none" else None


def serve_policy(decision: dict[str, Any], method: str | None = None) -> ServePolicy:
    """The policy of a decided eval (its ``decision.json``), by :func:`apply_where`: the method
    with the most GO conditions (or ``method``; ValueError when that one has none), and per
    measured concurrency its best GO draft length, else 0."""
    import dataclasses

    names = {f.name for f in dataclasses.fields(Verdict)}
    overall = [Verdict(**{"ci": (float("nan"),) * 2, "requests": 0,
                          **{k: x for k, x in v.items() if k in names}})
               for v in decision["verdicts"] if v["category"] == "all"]
    levels = sorted({condition_parts(v.condition)[2] for v in overall})
    go = {m: e for m, e in apply_where(overall).items() if e["go"]}
    if method is not None and method != "none" and method not in go:
        offer = f"GO: {', '.join(sorted(go))}" if go else "nothing is GO"
        raise ValueError(f"{method} has no GO condition in this eval ({offer})")
    if method is None:
        method = max(go, key=lambda m: len(go[m]["go"]), default="none")
    if method == "none":
        return ServePolicy("none", (), tuple(go))
    best = go[method]["best_d"]  # "c4" → [D, speedup]
    return ServePolicy(method, tuple((c, best[f"c{c}"][0] if f"c{c}" in best else 0)
                                     for c in levels), tuple(go))
