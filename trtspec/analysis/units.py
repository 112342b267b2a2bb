"""The independent unit of a record: what a bootstrap resamples and what a sample size counts.

Requests that ran together (a turn) share its shocks, and copies of one prompt share what makes
it fast or slow: neither is independent evidence twice (see :func:`independent_units`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def unit_of(r: dict[str, Any]) -> Any:
    """A record's independent unit: its turn (``block``, shared by the requests that ran
    together), or the request itself for records written before turns were recorded."""
    return r["block"] if r.get("block") is not None else ("request", r["request_id"])


def prompt_of(record: dict[str, Any]) -> str:
    """The prompt a record measured: its ``prompt_id`` (``--repeat`` copies name the request
    they copy), or for records written before it, the copies' id convention ``id#2``,
    ``id#3`` … (an older eval's custom ids that look like it are read as copies too)."""
    if record.get("prompt_id"):
        return record["prompt_id"]
    head, _, tail = record["request_id"].rpartition("#")
    return head if head and tail.isdigit() and int(tail) >= 2 else record["request_id"]


def independent_units(records: Sequence[dict[str, Any]]) -> tuple[list[Any], str]:
    """Per record, the independent unit it belongs to, and the unit's name.

    Requests of one turn share its shocks (:func:`unit_of`), and copies of one prompt
    (``--repeat``) share what makes the prompt fast or slow (its acceptance, its length): a
    unit is a connected group of turns that share prompts, so neither is counted as
    independent evidence twice. Named "request" (each its own), "turn", "prompt" (each
    prompt's copies, one request a turn) or "turn group" (turns joined by shared prompts)."""
    parent: dict[Any, Any] = {}

    def root(x: Any) -> Any:
        while parent.setdefault(x, x) != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    turns = [("turn", unit_of(r)) for r in records]
    for r, t in zip(records, turns, strict=True):
        a, b = root(t), root(("prompt", prompt_of(r)))
        if a != b:
            parent[a] = b
    units = [root(t) for t in turns]
    if len(set(units)) == len(set(turns)):
        return units, "turn" if len(set(turns)) < len(turns) else "request"
    return units, "turn group" if len(set(turns)) < len(turns) else "prompt"
