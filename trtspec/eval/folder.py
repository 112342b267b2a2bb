"""The eval folder: what an eval measures (its :class:`Selection`), its requests, and starting
or resuming it.

A new eval never touches an existing folder. A resumed eval measures what its first part
measured: the workloads, per-category sampling, benchmark knobs and --set overrides come from
the folder's eval.json; passing different ones is an error that names the difference.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from trtspec.files import write_atomic
from trtspec.recipe import Recipe, RecipeError, load_recipe

EVAL_META = "eval.json"


class Interrupted(Exception):
    """Ctrl-C during an eval: what was kept, and where (the CLI says how to go on)."""

    def __init__(self, out: Path, kept: int, total: int | None) -> None:
        super().__init__(f"interrupted: {kept} records kept in {out}")
        self.out, self.kept, self.total = out, kept, total


@dataclass(frozen=True)
class Selection:
    """What an eval measures besides the recipe file, as the user chose it on the command line
    (empty = the recipe's). Stored in eval.json, so a resumed eval measures the same."""

    workloads: tuple[str, ...] = ()  # builtin, speed-bench:<config> or JSONL paths
    per_category: int | None = None  # a custom JSONL runs whole unless this is given
    num_prompts: int | None = None  # a seeded sample of the requests, spread over categories
    max_tokens: int | None = None  # every request's output limit (the workload's own too)
    ignore_eos: bool = False  # fixed output lengths
    concurrency: tuple[int, ...] = ()
    overrides: tuple[str, ...] = ()  # --set, as given

    @classmethod
    def make(cls, workloads: Sequence[str] = (), **fields: Any) -> Selection:
        """JSONL paths become absolute, so a resumed eval finds them from any folder."""
        return cls(workloads=tuple(_workload_spec(w) for w in workloads),
                   **{k: tuple(v) if isinstance(v, list | tuple) else v
                      for k, v in fields.items()})

    def knob_overrides(self) -> list[str]:
        """The benchmark knobs as recipe overrides (so the recipe digest covers them)."""
        knobs = [f"sampling.max_tokens={self.max_tokens}"] * (self.max_tokens is not None)
        knobs += ["sampling.ignore_eos=true"] * self.ignore_eos
        if self.concurrency:
            knobs.append(f"eval.concurrency=[{', '.join(map(str, self.concurrency))}]")
        return knobs

    def all_overrides(self) -> list[str]:
        return [*self.overrides, *self.knob_overrides()]


_FLAGS = {"workloads": "--workload", "per_category": "--per-category",
          "num_prompts": "--num-prompts", "max_tokens": "--max-tokens",
          "ignore_eos": "--ignore-eos", "concurrency": "--concurrency", "overrides": "--set"}


def _workload_spec(spec: str) -> str:
    if spec == "builtin" or spec.startswith("speed-bench:"):
        return spec
    return str(Path(spec).expanduser().resolve())


def stored_meta(out: Path) -> dict[str, Any]:
    path = out / EVAL_META
    if not path.is_file():
        raise RecipeError(f"{out} is not an eval folder (no {EVAL_META}): nothing to resume; "
                          "pass reports/<eval-id>")
    return json.loads(path.read_text())


def resumed_selection(out: Path, given: Selection) -> Selection:
    """The eval folder's selection, with what ``given`` leaves empty taken from it; a value
    given that differs from the folder's is an error naming it."""
    meta = stored_meta(out)
    if "selection" in meta:
        stored = Selection(**{k: tuple(v) if isinstance(v, list) else v
                              for k, v in meta["selection"].items() if k in _FLAGS})
    else:  # written before selections were stored: what it recorded
        stored = Selection(workloads=tuple(meta.get("workloads", ())),
                           overrides=tuple(meta.get("overrides", ())))
    differ, merged = [], {}
    for field in dataclasses.fields(Selection):
        mine, theirs = getattr(given, field.name), getattr(stored, field.name)
        empty = mine in (None, (), False)
        merged[field.name] = theirs if empty else mine
        if not empty and mine != theirs:
            differ.append(f"{_FLAGS[field.name]} {_show(mine)} (that eval ran "
                          f"{_show(theirs)})")
    if differ:
        raise RecipeError(f"--resume {out}: {'; '.join(differ)}. Resume takes them from the eval "
                          f"folder: drop them, or start a new eval")
    return Selection(**merged)


def _show(value: Any) -> str:
    if value in (None, (), False):
        return "the recipe's" if value != () else "none"
    if isinstance(value, tuple):
        return " ".join(map(str, value))
    return str(value)


def load_requests(recipe: Recipe, selection: Selection, speed_bench_dir: str | Path,
                  say: Callable[[str], None]) -> list[Any]:
    """The eval's requests, and one line per workload saying how many per category it runs.

    The recipe's ``eval.per_category`` samples built-in and SPEED-Bench workloads; a custom
    JSONL runs whole unless ``--per-category`` is given."""
    from trtspec.eval.workloads import load_workload

    requests = []
    for spec in selection.workloads or recipe.eval.workloads:
        custom = spec != "builtin" and not spec.startswith("speed-bench:")
        n = selection.per_category or (None if custom else recipe.eval.per_category)
        got = load_workload(spec, speed_bench_dir, n, recipe.sampling.seed)
        counts = Counter(r.category for r in got)
        how = f"at most {n} per category" if n else "all of it"
        say(f"workload {spec}: {len(got)} requests ({how}): "
            + ", ".join(f"{c} {k}" for c, k in sorted(counts.items())))
        requests += got
    if selection.num_prompts is not None:
        requests = spread_sample(requests, selection.num_prompts, recipe.sampling.seed)
        counts = Counter(r.category for r in requests)
        say(f"--num-prompts {selection.num_prompts}: "
            + ", ".join(f"{c} {k}" for c, k in sorted(counts.items())))
    if selection.max_tokens is not None:  # the knob fixes every request's limit
        requests = [r.model_copy(update={"max_tokens": None}) for r in requests]
    return requests


def spread_sample(requests: Sequence[Any], n: int, seed: int) -> list[Any]:
    """n requests, seeded, taken from the categories in turn (each category's order shuffled),
    kept in input order: like vLLM's --num-prompts, but no category crowds out the others."""
    import random

    if n > len(requests):
        raise RecipeError(f"--num-prompts {n}: the workloads hold only {len(requests)} "
                          "requests")
    rng = random.Random(seed)
    queues: dict[str, list[int]] = {}
    for i, r in enumerate(requests):
        queues.setdefault(r.category, []).append(i)
    for q in queues.values():
        rng.shuffle(q)
    keep: list[int] = []
    while len(keep) < n:
        for q in queues.values():
            if q and len(keep) < n:
                keep.append(q.pop())
    return [requests[i] for i in sorted(keep)]


def start(recipe_path: str | Path, selection: Selection, eval_id: str | None,
          resume: str | Path | None, reports_root: str | Path, speed_bench_dir: str | Path,
          tag: str, extra: dict[str, Any], say: Callable[[str], None]
          ) -> tuple[Path, Recipe, list[Any], Selection, bool]:
    """(the eval folder, the recipe as this eval runs it, its requests, the selection, whether
    this call created the folder).

    A new eval never touches an existing folder: an eval id in use is refused before anything
    is written. A resumed eval takes its selection from the folder and must be the same eval:
    the same recipe digest (after overrides), requests and endpoint, else it stops and says
    what differs."""
    if resume:
        out = Path(resume)
        selection = resumed_selection(out, selection)
    recipe = load_recipe(recipe_path, selection.all_overrides())
    if not resume:
        out = Path(reports_root) / (eval_id or
                                    f"{recipe.name}{tag}-{time.strftime('%Y%m%d-%H%M%S')}")
        if out.exists() and any(out.iterdir()):
            raise FileExistsError(f"{out} exists: pass --resume {out} to continue that eval, "
                                  "or choose another --eval-id")
    requests = load_requests(recipe, selection, speed_bench_dir, say)
    meta = {"recipe": recipe.name, "recipe_digest": recipe.digest(),
            "overrides": selection.all_overrides(),
            "workloads": list(selection.workloads or recipe.eval.workloads),
            "selection": asdict(selection),
            "requests": len(requests), "request_ids": _ids_digest(requests), **extra}
    if resume:
        _check_same_eval(out, meta)
        return out, recipe, requests, selection, False
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        out.mkdir(exist_ok=out.exists())  # an empty folder is fine; a racing eval is not
    except FileExistsError:
        raise FileExistsError(f"{out} was just created by another eval: choose another "
                              "--eval-id") from None
    shutil.copyfile(recipe_path, out / "recipe.yaml")
    write_atomic(out / EVAL_META, json.dumps(meta, indent=2) + "\n")
    return out, recipe, requests, selection, True


def _ids_digest(requests: Sequence[Any]) -> str:
    return hashlib.sha256("\n".join(r.id for r in requests).encode()).hexdigest()[:16]


def _check_same_eval(out: Path, meta: dict[str, Any]) -> None:
    """Refuse to resume an eval folder with another recipe, request set or endpoint."""
    stored = stored_meta(out)
    names = {"recipe_digest": "the recipe (after --set overrides)",
             "requests": "number of requests", "request_ids": "requests",
             "endpoint": "endpoint", "baseline_endpoint": "baseline endpoint",
             "model": "model", "conditions": "conditions", "client": "endpoint client mode"}
    differ = [label for key, label in names.items()
              if (key in stored or key in meta) and stored.get(key) != meta.get(key)]
    if differ:
        raise RecipeError(f"--resume {out}: {', '.join(differ)} differ from that eval's "
                          f"(it ran {stored.get('workloads')} with overrides "
                          f"{stored.get('overrides') or 'none'}): the recipe file or a "
                          "workload file changed since; start a new eval")


def discard_if_empty(out: Path) -> None:
    """Remove a folder this eval created when it stopped before recording anything: a failed
    start leaves no empty eval behind (nothing measured is lost)."""
    records = out / "records.jsonl"
    if not records.is_file() or not records.read_text().strip():
        shutil.rmtree(out, ignore_errors=True)
