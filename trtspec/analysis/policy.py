"""What ``trtspec serve --policy`` runs, from a decision: the method and D by load.

* **apply where** — per method, the GO conditions and per concurrency the GO draft length with
  the highest CI lower bound (not the highest estimate: among many GO cells the highest
  estimate is the one most inflated by noise, the winner's curse).
* **serve policy** — the method with the most GO conditions and, per measured concurrency, its
  best GO D (0 where none is GO); more running requests than measured: plain decoding.
* **policy file** — ``schedules/trtspec-policy.yaml`` beside a decided eval's report: the same
  policy with the crossover applied (:mod:`trtspec.analysis.schedules`), in a form a deployment
  keeps and ``trtspec serve --policy FILE`` reads.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from trtspec.analysis.decide import GO, Verdict
from trtspec.analysis.records import condition_parts
from trtspec.spec.adaptive import ADAPTIVE

POLICY = "trtspec-policy.yaml"


def apply_where(verdicts: Sequence[Verdict]) -> dict[str, dict[str, Any]]:
    """Per method: the conditions that are GO, and per concurrency the GO draft length (an
    int, or "adaptive") with the highest CI lower bound, [D, speedup, CI low]. The lower bound,
    not the point estimate: among many GO cells the highest estimate is the one most likely
    inflated by noise (the winner's curse)."""
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
            if best is None or _lower_first(v.ci[0], v.speedup) > _lower_first(best[2], best[1]):
                entry["best_d"][c] = (d, v.speedup, v.ci[0])
    return table


def _lower_first(low: float, speedup: float) -> tuple[float, float]:
    """Order GO cells by CI lower bound, then estimate (a decision.json without CIs: estimate)."""
    return (low if low == low else float("-inf"), speedup)


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
    best = go[method]["best_d"]  # "c4" → [D, speedup, CI low]
    return ServePolicy(method, tuple((c, best[f"c{c}"][0] if f"c{c}" in best else 0)
                                     for c in levels), tuple(go))


def write_policy(path: str | Path, policy: ServePolicy, eval_id: str,
                 crossover: dict[str, Any] | None = None, build_digest: str | None = None
                 ) -> Path:
    """Write what ``trtspec serve --policy FILE`` reads: method, schedule (running requests →
    D; 0 above the last key), eval id, crossover, and the digest of the build it was decided
    on (serve refuses another build)."""
    from trtspec.build.files import write_atomic

    body: dict[str, Any] = {"method": policy.method, "eval": eval_id,
                            "schedule": {int(n): d for n, d in policy.schedule}}
    if build_digest:
        body["build_digest"] = build_digest
    if policy.go_methods:
        body["go_methods"] = list(policy.go_methods)
    if crossover:
        body["crossover"] = crossover
    header = (f"# trtspec serve --policy FILE: from eval {eval_id}.\n"
              "# schedule: up to N running requests draft D tokens (D = 0: plain decoding);\n"
              "# above the last N, plain decoding. crossover: c*, the concurrency where the\n"
              "# fitted speedup falls below decide.min_speedup, with its 95 % CI.\n")
    return write_atomic(Path(path), header + yaml.safe_dump(body, sort_keys=False))


def read_policy(path: str | Path) -> ServePolicy:
    """The policy in a ``trtspec-policy.yaml``; ValueError (one line) when malformed."""
    p = Path(path)
    try:
        body = yaml.safe_load(p.read_text())
    except (OSError, yaml.YAMLError) as e:
        raise ValueError(f"{p}: cannot read a policy ({type(e).__name__}): write it with "
                         "`trtspec decide`") from None
    if not isinstance(body, dict) or not isinstance(body.get("method"), str):
        raise ValueError(f"{p}: not a trtspec policy (no method): write it with `trtspec "
                         "decide`")
    raw = body.get("schedule") or {}
    if not isinstance(raw, dict):
        raise ValueError(f"{p}: schedule must map running requests to D, e.g. {{1: 4, 4: 2}}")
    steps: list[tuple[int, int | str]] = []
    for n, d in raw.items():
        if not (isinstance(n, int) and n >= 1 and (d == ADAPTIVE or (
                isinstance(d, int) and not isinstance(d, bool) and d >= 0))):
            raise ValueError(f"{p}: schedule entry {n!r}: {d!r} is not RUNNING ≥ 1: D ≥ 0 "
                             "(or adaptive)")
        steps.append((n, d))
    if [n for n, _ in steps] != sorted({n for n, _ in steps}):
        raise ValueError(f"{p}: schedule keys must increase")
    if body["method"] != "none" and not steps:
        raise ValueError(f"{p}: method {body['method']} has an empty schedule")
    return ServePolicy(body["method"], tuple(steps), tuple(body.get("go_methods") or ()))


def decided_build(path: str | Path) -> str | None:
    """The build digest a policy was decided on: a policy file's ``build_digest``, or an eval
    folder's manifest.json (None: not recorded, or an endpoint eval)."""
    import json

    p = Path(path)
    try:
        if p.is_file():
            body = yaml.safe_load(p.read_text())
            return body.get("build_digest") if isinstance(body, dict) else None
        if (p / "manifest.json").is_file():
            return json.loads((p / "manifest.json").read_text()).get("build_digest")
    except (OSError, ValueError, yaml.YAMLError):
        return None
    return None
