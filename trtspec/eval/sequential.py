"""``trtspec eval --until-decided``: add requests to the conditions still INCONCLUSIVE, in rounds,
until each is decided or the budget is spent, with the error controlled over the looks.

Terms:

* **look** — one decision over the records so far. Look 1 follows the eval's plan; each later
  look follows a **round**: new requests, stratified by category (the plan's share of each
  category), measured for the conditions whose verdict over all categories was INCONCLUSIVE.
* **budget** N — the most paired requests a condition may get (``--max-requests``, default:
  4× the plan, at most every row of the workloads).
* **α per look** — alpha spending (:func:`trtspec.analysis.stats.look_alphas`): look k of a
  condition with n_k paired requests tests at spent(n_k / N) − spent(n_{k−1} / N), so over every
  look the chance of a wrong GO (or a wrong NO-GO) stays ≤ α. Within a look, Holm over its cells.

New requests are rows of the workloads the eval has not measured (the built-in workload and
SPEED-Bench hold more than a plan takes); when they run out, the eval says so and stops rather
than measuring the same prompts again as if they were new. ``sequential.json`` in the eval
folder records each look (its requests, conditions and α) so that ``trtspec decide`` judges
each condition at the α of its last look, and a resumed eval replays the same rounds.
"""

from __future__ import annotations

import json
import random
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from trtspec.analysis.stats import ALPHA, look_alphas
from trtspec.build.files import write_atomic
from trtspec.build.recipe import RecipeError

SEQUENTIAL = "sequential.json"
Judge = Callable[[dict[str, float], dict[str, int]], dict[str, tuple[str, int]]]
METHOD = ("alpha spending: Hwang–Shih–DeCani (γ = −2) α·(e^(2n/N) − 1)/(e² − 1), little spent "
          "early and most late, each look tested at its increment")


def read_sequential(out: Path) -> dict[str, Any] | None:
    path = Path(out) / SEQUENTIAL
    return json.loads(path.read_text()) if path.is_file() else None


def unused_rows(pool: Sequence[Any], used: set[str], shares: Counter, seed: int,
                round_index: int) -> list[Any]:
    """The next round's requests: per category, as many as ``shares`` says, drawn (seeded)
    from the rows of ``pool`` not in ``used``; fewer where a category runs out."""
    rng = random.Random(seed * 7919 + round_index)
    by_category: dict[str, list[Any]] = {}
    for r in pool:
        if r.id not in used:
            by_category.setdefault(r.category, []).append(r)
    picked = []
    for category, want in sorted(shares.items()):
        rows = by_category.get(category, [])
        picked += rng.sample(rows, min(want, len(rows)))
    order = {r.id: i for i, r in enumerate(pool)}
    return sorted(picked, key=lambda r: order[r.id])


def share_out(shares: Counter, room: int) -> Counter:
    """A round's requests per category: the plan's shares, scaled down by largest remainders
    when the budget has less room than a full round (a cut in pool order would take the whole
    cut from the last categories)."""
    total = sum(shares.values())
    if total <= room:
        return Counter(shares)
    exact = {c: k * room / total for c, k in shares.items()}
    out = Counter({c: int(x) for c, x in exact.items()})
    for c in sorted(exact, key=lambda c: (int(exact[c]) - exact[c], c))[:room - sum(out.values())]:
        out[c] += 1
    return out


class Looks:
    """The looks of a sequential eval, as stored in ``sequential.json``."""

    def __init__(self, out: Path, budget: int, alpha: float = ALPHA) -> None:
        stored = read_sequential(out) or {}
        if stored and stored.get("method") != METHOD:  # its looks spent α another way
            raise RecipeError(f"{out / SEQUENTIAL}: that eval spent its α with another "
                              f"function ({stored.get('method')}); going on would spend more "
                              "than α. `trtspec decide` it as it is, or start a new eval")
        self.out, self.budget, self.alpha = out, stored.get("budget", budget), alpha
        self.looks: list[dict[str, Any]] = stored.get("looks", [])

    def alpha_at(self, n: int) -> float:
        """α of a look at which the conditions it judges have ``n`` paired requests."""
        sizes = [look["n"] for look in self.looks if look["n"] < n] + [n]
        return look_alphas(sorted(set(sizes)), self.budget, self.alpha)[-1]

    def last(self, key: str) -> dict[str, Any]:
        """condition → its last look's ``key`` (its α, or its Holm family size)."""
        out: dict[str, Any] = {}
        for look in self.looks:
            for c in look["conditions"]:
                if look.get(key) is not None:
                    out[c] = look[key]
        return out

    def alphas(self) -> dict[str, float]:
        """condition → the α of its last look."""
        return self.last("alpha")

    def save(self) -> None:
        write_atomic(self.out / SEQUENTIAL, json.dumps({
            "method": METHOD, "alpha": self.alpha, "budget": self.budget,
            "looks": self.looks, "alphas": self.alphas(), "families": self.last("family")},
            indent=2) + "\n")


def until_decided(out: Path, plan: Sequence[Any], pool: Sequence[Any], budget: int,
                  conditions: Sequence[str], measure: Callable[[Sequence[Any], Sequence[str],
                                                                int], None],
                  judge: Judge, seed: int, say: Callable[[str], None] = print) -> Looks:
    """Look after the plan, then add rounds to the undecided conditions until none is left,
    the budget is spent or the workloads run out. ``measure(requests, conditions, look)``
    records the requests for those conditions; ``judge(alphas, families)`` returns condition →
    (verdict over all categories, the Holm family size it was judged in), at the given α per
    condition, with at least the given family size for the conditions of earlier looks (the
    family each was tested in then)."""
    looks = Looks(out, budget)
    shares = Counter(r.category for r in plan)
    used = {r.id for r in plan}
    n, active = len(plan), list(conditions)
    for look in looks.looks:  # a resumed eval: the rounds it already chose, measured again
        used |= set(look["request_ids"])
    if not looks.looks:
        looks.looks.append({"n": n, "alpha": looks.alpha_at(n), "conditions": active,
                            "request_ids": [r.id for r in plan], "verdicts": {}})
        _judge(judge, looks)
    by_id = {r.id: r for r in pool}
    for k, look in enumerate(looks.looks[1:], 1):  # resume: fill in what a kill left out
        missing = [i for i in look["request_ids"] if i not in by_id]
        if missing:
            raise ValueError(f"{out / SEQUENTIAL}: look {k + 1} measured {missing[0]}, which the "
                             "workloads no longer hold: start a new eval")
        measure([by_id[i] for i in look["request_ids"]], look["conditions"], k)
        if not look["verdicts"]:  # killed before it was judged
            _judge(judge, looks, k)
    last = looks.looks[-1]
    n = last["n"]
    active = [c for c in last["conditions"] if last["verdicts"].get(c) == "INCONCLUSIVE"]
    budget = looks.budget  # a resumed eval keeps the budget its α was spent over
    while active:
        room = budget - n
        if room <= 0 and len(pool) > budget:
            say(f"until-decided: budget of {budget} requests per condition spent; "
                f"{len(active)} condition(s) still INCONCLUSIVE: {', '.join(active)}")
            break
        batch = unused_rows(pool, used, share_out(shares, room), seed, len(looks.looks)) \
            if room > 0 else []
        if not batch:
            say(f"until-decided: the workloads have no unused rows left ({len(used)} measured); "
                f"{len(active)} condition(s) still INCONCLUSIVE: {', '.join(active)}. Add rows "
                "to the workload rather than measuring the same prompts again")
            break
        n += len(batch)
        used |= {r.id for r in batch}
        say(f"until-decided: look {len(looks.looks) + 1}: {len(batch)} more requests for "
            f"{', '.join(active)} ({n} per condition, budget {budget}, "
            f"α this look {looks.alpha_at(n):.2g})")
        looks.looks.append({"n": n, "alpha": looks.alpha_at(n), "conditions": active,
                            "request_ids": [r.id for r in batch], "verdicts": {}})
        looks.save()  # the round is chosen before it is measured: a resume replays it
        measure(batch, active, len(looks.looks) - 1)
        _judge(judge, looks)
        active = [c for c in active if looks.looks[-1]["verdicts"][c] == "INCONCLUSIVE"]
    return looks


def cut_short(looks: dict[str, Any] | None) -> set[str]:
    """The conditions of a round that was measured (in part) but never judged: the eval was
    killed before its look, so its records may be the fast half."""
    last = looks["looks"][-1] if looks else {}
    return set() if last.get("verdicts", True) else set(last["conditions"])


def looks_lines(looks: dict[str, Any] | None) -> list[str]:
    """Report lines: the looks of an ``--until-decided`` eval (its ``sequential.json``), so a
    reader sees how many requests each verdict needed."""
    if not looks:
        return []
    lines = ["## Looks (`--until-decided`)", "",
             f"Budget {looks['budget']} paired requests per condition; {looks['method']}.", "",
             "The looks judge the speedup alone; the latency gates are tested once, by the "
             "verdicts above, so a look's GO can end INCONCLUSIVE or NO-GO there.", "",
             "| look | requests per condition | α this look | conditions judged | "
             "verdicts (speedup only) |",
             "|---:|---:|---:|---|---|"]
    for k, look in enumerate(looks["looks"], 1):
        verdicts = ", ".join(f"{c}: {v}" for c, v in look.get("verdicts", {}).items()) or "—"
        lines.append(f"| {k} | {look['n']} | {look['alpha']:.2g} | "
                     f"{', '.join(look['conditions'])} | {verdicts} |")
    return lines


def _judge(judge: Judge, looks: Looks, k: int = -1) -> None:
    """Judge look ``k``'s conditions at its α (earlier looks' conditions at theirs, each in a
    family at least as large as the one it was tested in), and store verdicts and family."""
    k = k % len(looks.looks)
    look = looks.looks[k]
    earlier = Looks.__new__(Looks)
    earlier.looks = looks.looks[:k]
    alphas = {**earlier.alphas(), **{c: look["alpha"] for c in look["conditions"]}}
    families = {c: m for c, m in earlier.last("family").items() if c not in look["conditions"]}
    judged = judge(alphas, families)
    look["verdicts"] = {c: judged.get(c, ("INCONCLUSIVE", 0))[0] for c in look["conditions"]}
    look["family"] = max((judged[c][1] for c in look["conditions"] if c in judged), default=0)
    looks.save()
