"""Workloads: what an eval sends. Custom JSONL, SPEED-Bench (speed_bench.py) and a built-in set.

Custom JSONL, one request per line::

    {"id": "q1", "category": "summarise", "prompt": "…", "max_tokens": 128}
    {"id": "q2", "category": "chat", "messages": [{"role": "user", "content": "…"}]}

The built-in workload was written for trtspec (no dataset text): 8 categories × 6 requests,
copy-heavy (summarise, edit, answer from a text, refactor code) and open-ended (chat, story,
reasoning, explain), with short prompts and long (≥ 1.5k-token) contexts.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Sequence
from pathlib import Path

from trtspec.eval.workloads.request import WorkloadRequest, load_jsonl


def per_category(requests: Sequence[WorkloadRequest], n: int, seed: int = 0
                 ) -> list[WorkloadRequest]:
    """A stratified, seeded sample: up to n requests from each category, in input order."""
    by_category: dict[str, list[int]] = {}
    for i, r in enumerate(requests):
        by_category.setdefault(r.category, []).append(i)
    rng = random.Random(seed)
    keep = sorted(i for idx in by_category.values() for i in rng.sample(idx, min(n, len(idx))))
    return [requests[i] for i in keep]


# ---- built-in workload ---------------------------------------------------------------------

_DISTRICTS = ["Northgate", "Riverside", "Old Harbor", "Hillcrest", "Eastfield", "Millbrook",
              "Southport", "Cedar Park", "Lakeside", "Westbrook", "Pine Hill"]
_LINES = ["Blue Line", "Green Line", "Harbor Express", "Route 12", "Route 40", "Night Owl"]


def _transit_report() -> str:
    """A long fictional report, generated deterministically (≈ 1.8k tokens)."""
    rng = random.Random(7)
    parts = ["Harbor City Transit Authority: Annual Service Review\n"]
    for i, district in enumerate(_DISTRICTS, 1):
        riders = rng.randint(12, 95) * 1000
        change = rng.choice([-6, -3, 2, 4, 7, 11])
        line = rng.choice(_LINES)
        late = rng.randint(3, 19)
        parts.append(
            f"Section {i}: {district}. Average weekday ridership in {district} was {riders:,}, "
            f"a change of {change} percent from the previous year. Most trips used the {line}. "
            f"Buses and trains arrived late on {late} percent of trips, mostly during the "
            f"evening peak. Residents asked for more frequent service on weekends and for "
            f"better lighting at stops. The authority plans to add two shelters in {district} "
            f"next spring and to review the timetable of the {line} in the autumn. Staff noted "
            f"that ticket machines in {district} failed less often after the software update, "
            f"and that the new contactless cards now account for most fares. A survey of "
            f"{rng.randint(200, 900)} riders found that {rng.randint(55, 90)} percent were "
            f"satisfied with cleanliness and {rng.randint(40, 80)} percent with punctuality.\n")
    parts.append("Budget: the authority spent most of its capital budget on track renewal and "
                 "electric buses, and expects fares to stay flat for another year.\n")
    return "\n".join(parts)


def _inventory_module() -> str:
    """A long Python module with repetitive helpers (≈ 1.6k tokens): refactoring material."""
    items = ["apple", "bread", "cheese", "dates", "eggs", "flour", "grapes", "honey", "ink",
             "jam", "kale", "lemon"]
    funcs = []
    for i, item in enumerate(items):
        funcs.append(
            f"def restock_{item}(stock, amount):\n"
            f"    if amount < 0:\n"
            f"        raise ValueError('amount must be positive')\n"
            f"    if '{item}' not in stock:\n"
            f"        stock['{item}'] = 0\n"
            f"    stock['{item}'] = stock['{item}'] + amount\n"
            f"    if stock['{item}'] > {100 + 10 * i}:\n"
            f"        print('too much {item}')\n"
            f"    return stock\n\n\n"
            f"def sell_{item}(stock, amount):\n"
            f"    if stock.get('{item}', 0) < amount:\n"
            f"        print('not enough {item}')\n"
            f"        return stock\n"
            f"    stock['{item}'] = stock['{item}'] - amount\n"
            f"    return stock\n")
    return "\n\n".join(funcs)


_SHORT_TEXT = (
    "The library will close early on Friday for staff training. Books due that day can be "
    "returned on Saturday without a fine. The children's reading club moves to next Tuesday, and "
    "the printer on the second floor is being replaced.")
_MEMO = (
    "Team, the quarterly planning meeting is moved from Monday to Wednesday at 10:00 in room 4B. "
    "Please bring your project updates, the draft budget and any risks you want to discuss. "
    "Lunch will be provided. If you cannot attend, send your update to Priya by Tuesday noon.")
_CODE = (
    "def total(xs):\n    t = 0\n    for i in range(len(xs)):\n        t = t + xs[i]\n    return t\n"
    "\n\ndef average(xs):\n    t = 0\n    for i in range(len(xs)):\n        t = t + xs[i]\n"
    "    return t / len(xs)\n")


def builtin() -> list[WorkloadRequest]:
    """48 requests, 8 categories (4 copy-heavy, 4 open-ended), short and long contexts."""
    report, module = _transit_report(), _inventory_module()
    spec: dict[str, list[str]] = {
        "summarise": [
            f"Summarise this notice in one sentence:\n\n{_SHORT_TEXT}",
            f"Summarise this memo as three bullet points:\n\n{_MEMO}",
            f"Summarise the following report in five sentences, reusing its wording:\n\n{report}",
            f"Write a one-paragraph summary of the ridership figures in this report:\n\n{report}",
            f"List every district in this report with its ridership, one per line:\n\n{report}",
            f"Give the memo below a title and a two-sentence summary:\n\n{_MEMO}",
        ],
        "edit": [
            f"Rewrite this notice in a friendlier tone, keeping every fact:\n\n{_SHORT_TEXT}",
            f"Fix the grammar and return the text: {_MEMO.replace('is moved', 'are move')}",
            f"Turn this memo into a numbered checklist:\n\n{_MEMO}",
            f"Rewrite this notice in the passive voice:\n\n{_SHORT_TEXT}",
            f"Replace every 'percent' with '%' in this report and return it:\n\n{report[:3000]}",
            f"Translate the memo to plain English for a new employee:\n\n{_MEMO}",
        ],
        "answer_from_text": [
            f"According to the notice, when can Friday's books be returned?\n\n{_SHORT_TEXT}",
            f"Who should absent team members send their update to?\n\n{_MEMO}",
            f"Which district had the highest ridership? Quote the sentence.\n\n{report}",
            f"Which lines does the report mention, and for which districts?\n\n{report}",
            f"What did riders in Riverside ask for? Answer from the text.\n\n{report}",
            f"What will be provided at the meeting, and where is it?\n\n{_MEMO}",
        ],
        "code_refactor": [
            f"Refactor this code to use built-ins, keeping the names:\n\n{_CODE}",
            f"Add type hints and docstrings to this code:\n\n{_CODE}",
            f"Refactor this module: replace the per-item functions with two generic "
            f"functions, restock(stock, item, amount) and sell(stock, item, amount):\n\n{module}",
            f"Add a docstring to every function in this module and return it:\n\n{module}",
            f"Rewrite average() to reuse total():\n\n{_CODE}",
            f"Find the bug risk in this code and fix it (empty lists):\n\n{_CODE}",
        ],
        "chat": [
            "Hi! Can you suggest a name for a small bakery by the sea?",
            "What should I pack for a three-day hiking trip?",
            "How do I politely decline a meeting invitation?",
            "Recommend three board games for a family evening and say why.",
            "I have eggs, spinach and cheese. What can I cook for dinner?",
            "What is a good way to start learning to draw?",
        ],
        "story": [
            "Write a short story about a robot who learns to bake bread.",
            "Tell a bedtime story about a lighthouse and a lost whale.",
            "Write a story in which a town's clocks all stop at noon.",
            "Write a short mystery set on a night train.",
            "Tell a fable about a fox who wants to fly.",
            "Write the opening of a science-fiction story on a farm on Mars.",
        ],
        "reasoning": [
            "A train leaves at 9:40 and arrives at 13:05. How long is the trip? Show your steps.",
            "If 3 pens cost 4.50, how much do 7 pens cost? Explain.",
            "Alice is older than Bob; Bob is older than Carol. Who is youngest? Explain why.",
            "A rectangle has a perimeter of 30 and a width of 5. What is its area? Step by step.",
            "Is 221 a prime number? Reason it out.",
            "You have two jugs of 3 and 5 litres. How do you measure exactly 4 litres?",
        ],
        "explain": [
            "Explain how a rainbow forms, for a ten-year-old.",
            "Why do we have seasons on Earth?",
            "Explain what a hash table is and when to use one.",
            "How does a bicycle stay upright when moving?",
            "Explain compound interest with a simple example.",
            "What is the difference between weather and climate?",
        ],
    }
    return [WorkloadRequest(id=f"{category}-{i}", category=category, prompt=text,
                            source="builtin")
            for category, texts in spec.items() for i, text in enumerate(texts)]


COPY_HEAVY = ("summarise", "edit", "answer_from_text", "code_refactor")


def load_workload(spec: str, speed_bench_dir: str | Path = "data/speed-bench",
                  per_category_n: int | None = None, seed: int = 0,
                  groups: dict[str, list[str]] | None = None,
                  seen: set[str] | None = None) -> list[WorkloadRequest]:
    """``builtin``, ``speed-bench:<config>`` or a path to a JSONL file; ``groups`` (the recipe's
    ``eval.categories``, applied to the built-in and SPEED-Bench workloads) merges categories
    before the per-category sample; ``seen`` collects the categories they had before."""
    if spec == "builtin":
        requests = builtin()
    elif spec.startswith("speed-bench:"):
        from trtspec.eval.workloads import speed_bench

        config = spec.split(":", 1)[1]
        requests = speed_bench.load(speed_bench.find_file(speed_bench_dir, config), config)
    else:
        requests = load_jsonl(spec)
    if seen is not None and groups:
        seen.update(r.category for r in requests)
    if groups:
        requests = regroup(requests, groups)
    return per_category(requests, per_category_n, seed) if per_category_n else requests


def regroup(requests: Sequence[WorkloadRequest], groups: dict[str, list[str]]
            ) -> list[WorkloadRequest]:
    """Each request of a listed category moved to the group that lists it; other categories
    keep their names. Why: a verdict per category needs ≥ 8 requests in each, so a small eval
    judges a few groups (e.g. copy-heavy vs open-ended) rather than eight cells it can never
    decide."""
    group_of = {c: g for g, members in groups.items() for c in members}
    return [r.model_copy(update={"category": group_of[r.category]})
            if r.category in group_of else r for r in requests]


def categories(requests: Iterable[WorkloadRequest]) -> list[str]:
    return sorted({r.category for r in requests})
