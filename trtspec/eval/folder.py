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
import os
import shutil
import time
import uuid
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from trtspec.build.files import write_atomic
from trtspec.build.recipe import Recipe, RecipeError, load_recipe

EVAL_META = "eval.json"


class Interrupted(Exception):
    """Ctrl-C during an eval: what was kept, and where (the CLI says how to go on). A folder
    this eval created is removed when nothing was measured yet (``discarded``)."""

    def __init__(self, out: Path, kept: int, total: int | None, discarded: bool = False
                 ) -> None:
        super().__init__(f"interrupted: {kept} records kept in {out}")
        self.out, self.kept, self.total, self.discarded = out, kept, total, discarded


@dataclass(frozen=True)
class Selection:
    """What an eval measures besides the recipe file, as the user chose it on the command line
    (empty = the recipe's). Stored in eval.json, so a resumed eval measures the same."""

    workloads: tuple[str, ...] = ()  # builtin, speed-bench:<config> or JSONL paths
    per_category: int | None = None  # a custom JSONL runs whole unless this is given
    num_prompts: int | None = None  # a seeded sample of the requests, spread over categories
    repeat: int = 1  # each request measured this many times (its own id and seed each time)
    max_tokens: int | None = None  # every request's output limit (the workload's own too)
    ignore_eos: bool = False  # fixed output lengths
    concurrency: tuple[int, ...] = ()
    request_rate: float | None = None  # open-loop arrivals per second (inf: all at once)
    overrides: tuple[str, ...] = ()  # --set, as given
    speed_bench_dir: str | None = None  # where SPEED-Bench files are [default: data/speed-bench]
    # started by a trtspec that stored no selection: the recipe's per_category sampled custom
    # JSONL too, and --per-category was not recorded
    legacy: bool = False

    @classmethod
    def make(cls, workloads: Sequence[str] = (), speed_bench_dir: str | None = None,
             **fields: Any) -> Selection:
        """Paths become absolute, so a resumed eval finds them from any folder."""
        return cls(workloads=tuple(_workload_spec(w) for w in workloads),
                   speed_bench_dir=_absolute(speed_bench_dir) if speed_bench_dir else None,
                   **{k: tuple(v) if isinstance(v, list | tuple) else v
                      for k, v in fields.items()})

    def knob_overrides(self) -> list[str]:
        """The benchmark knobs as recipe overrides (so the recipe digest covers them)."""
        knobs = [f"sampling.max_tokens={self.max_tokens}"] * (self.max_tokens is not None)
        knobs += ["sampling.ignore_eos=true"] * self.ignore_eos
        if self.concurrency:
            knobs.append(f"eval.concurrency=[{', '.join(map(str, self.concurrency))}]")
        if self.request_rate is not None:
            rate = ".inf" if self.request_rate == float("inf") else repr(self.request_rate)
            knobs.append(f"eval.request_rate={rate}")
        return knobs

    def all_overrides(self) -> list[str]:
        return [*self.overrides, *self.knob_overrides()]

    def flags(self) -> list[str]:
        """The command-line flags that chose this selection, as a user would type them (empty:
        the recipe as written): what a report shows a reviewer under "overrides"."""
        out = []
        for name, flag in _FLAGS.items():
            value = getattr(self, name)
            if value in (None, (), False) or (name == "repeat" and value == 1):
                continue
            if value is True:  # a switch: --ignore-eos
                out.append(flag)
            elif name in ("overrides", "workloads"):  # one flag per item
                out += [f"{flag} {v}" for v in value]
            else:
                out.append(f"{flag} {_show(name, value)}")
        return out


_FLAGS = {"workloads": "--workload", "per_category": "--per-category",
          "num_prompts": "--num-prompts", "repeat": "--repeat", "max_tokens": "--max-tokens",
          "ignore_eos": "--ignore-eos", "concurrency": "--concurrency",
          "request_rate": "--request-rate", "overrides": "--set",
          "speed_bench_dir": "--speed-bench-dir"}


def _absolute(path: str) -> str:
    return os.path.abspath(os.path.expanduser(path))


def _workload_spec(spec: str) -> str:
    return _absolute(spec) if _custom(spec) else spec


def _near_recipe(path: str, recipe_path: str | Path) -> str:
    """A relative path named in a recipe: from the working directory if it is there, else from
    the recipe's project (the folder holding its recipes/), else from the recipe's folder."""
    if os.path.isabs(path) or os.path.exists(path):
        return _absolute(path)
    recipe = Path(recipe_path).absolute()
    bases = [p.parent for p in recipe.parents if p.name == "recipes"][:1] + [recipe.parent]
    return next((str(b / path) for b in bases if (b / path).exists()), _absolute(path))


def stored_meta(out: Path) -> dict[str, Any]:
    path = out / EVAL_META
    if not path.is_file():
        raise RecipeError(f"{out} is not an eval folder (no {EVAL_META}): nothing to resume; "
                          "pass reports/<eval-id>")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise RecipeError(f"{path}: not valid JSON ({e.msg}, line {e.lineno}): the eval folder "
                          "is damaged") from None


def meta_if_any(out: Path) -> dict[str, Any]:
    """eval.json, or {} for a folder without one (written by hand, or by an older trtspec)."""
    return stored_meta(out) if (out / EVAL_META).is_file() else {}


def arms_of(out: Path) -> tuple[str, ...]:
    """The arms an eval measures: both in process; an endpoint eval has a baseline arm only
    with a baseline endpoint."""
    meta = meta_if_any(out)
    return ("spec",) if "endpoint" in meta and not meta.get("baseline_endpoint") \
        else ("baseline", "spec")


def completeness(out: Path, records: Sequence[dict[str, Any]]) -> tuple[int, int | None]:
    """(requests measured in some arm of some condition, how many a complete eval has; None
    when eval.json does not say). A failed request counts as measured: it is reported as
    failed, and resume measures it again."""
    expected = meta_if_any(out).get("expected_records")
    return len({(r["condition"], r["arm"], r["request_id"]) for r in records}), expected


def stored_selection(out: Path) -> Selection:
    meta = stored_meta(out)
    if "selection" in meta:
        return Selection(**{k: tuple(v) if isinstance(v, list) else v
                            for k, v in meta["selection"].items()
                            if k in _FLAGS or k == "legacy"})
    # written before selections were stored: what it recorded, read as it ran then
    return Selection(workloads=tuple(_workload_spec(w) for w in meta.get("workloads", ())),
                     overrides=tuple(meta.get("overrides", ())), legacy=True)


def resumed_selection(out: Path, given: Selection, recipe_path: str | Path) -> Selection:
    """The eval folder's selection, with the values ``given`` where they change nothing: the
    same recipe digest and the same requests as eval.json recorded (`--concurrency 1` where the
    recipe's is [1], --set items in another order, a workload file given by another path).
    Otherwise an error naming each value that differs."""
    meta, stored = stored_meta(out), stored_selection(out)
    changed = {f.name: getattr(given, f.name) for f in dataclasses.fields(Selection)
               if f.name != "legacy" and getattr(given, f.name) not in (None, (), False)
               and getattr(given, f.name) != getattr(stored, f.name)}
    if not changed:
        return stored
    merged = dataclasses.replace(stored, **changed)
    recipe = load_recipe(recipe_path, merged.all_overrides())
    requests = load_requests(recipe, merged, recipe_path, lambda _: None)
    if meta.get("recipe_digest") in recipe.digests() and \
            meta.get("request_ids") == _ids_digest(requests):
        return merged
    differ = [f"{_FLAGS[name]} {_show(name, value)} (that eval ran "
              f"{_show(name, getattr(stored, name))})" for name, value in changed.items()
              if not (stored.legacy and getattr(stored, name) is None)]
    differ += [f"{_FLAGS[name]} {_show(name, value)}" for name, value in changed.items()
               if stored.legacy and getattr(stored, name) is None]
    raise RecipeError(f"--resume {out}: {'; '.join(differ)} would measure another eval. Resume "
                      f"takes them from the eval folder: drop them, or start a new eval")


def _show(name: str, value: Any) -> str:
    if value in (None, (), False):
        return {"overrides": "none", "ignore_eos": "no --ignore-eos"}.get(name, "the recipe's")
    if isinstance(value, tuple):
        return (" " if name == "workloads" else ",").join(map(str, value)) \
            if name != "overrides" else " ".join(f"--set {v}" for v in value)
    return str(value)


def load_requests(recipe: Recipe, selection: Selection, recipe_path: str | Path,
                  say: Callable[[str], None]) -> list[Any]:
    """The eval's requests, and one line per workload saying how many per category it runs.

    The recipe's ``eval.per_category`` samples built-in and SPEED-Bench workloads; a custom
    JSONL runs whole unless ``--per-category`` is given. Paths the recipe names are found from
    the working directory, else from the recipe's project or folder."""
    from trtspec.eval.workloads import load_workload

    bench = selection.speed_bench_dir or _near_recipe("data/speed-bench", recipe_path)
    requests: list[Any] = []
    seen: set[str] = set()
    for spec in _specs(recipe, selection, recipe_path):
        custom = _custom(spec)
        n = selection.per_category or (
            None if custom and not selection.legacy else recipe.eval.per_category)
        got = load_workload(spec, bench, n, recipe.sampling.seed,
                            None if custom else recipe.eval.categories, seen)
        counts = Counter(r.category for r in got)
        how = f"at most {n} per category" if n else "all of it"
        say(f"workload {spec}: {len(got)} requests ({how}): "
            + ", ".join(f"{c} {k}" for c, k in sorted(counts.items())))
        requests += got
    _check_groups(recipe, seen)
    if selection.num_prompts is not None:
        requests = spread_sample(requests, selection.num_prompts, recipe.sampling.seed)
        counts = Counter(r.category for r in requests)
        say(f"--num-prompts {selection.num_prompts}: "
            + ", ".join(f"{c} {k}" for c, k in sorted(counts.items())))
    if selection.repeat > 1:  # copies as new requests: ids r#2, r#3 … (and so their seeds)
        requests = [r if k == 0 else r.model_copy(update={"id": f"{r.id}#{k + 1}",
                                                          "copy_of": r.id})
                    for k in range(selection.repeat) for r in requests]
        say(f"--repeat {selection.repeat}: {len(requests)} requests")
    if selection.max_tokens is not None:  # the knob fixes every request's limit
        requests = [r.model_copy(update={"max_tokens": None}) for r in requests]
    return requests


def _specs(recipe: Recipe, selection: Selection, recipe_path: str | Path) -> list[str]:
    """The eval's workloads: the selection's, else the recipe's (paths found near it)."""
    return list(selection.workloads) or [w if _workload_spec(w) == w else _near_recipe(
        w, recipe_path) for w in recipe.eval.workloads]


def _custom(spec: str) -> bool:
    """A JSONL path, not ``builtin`` or ``speed-bench:<config>``."""
    return spec != "builtin" and not spec.startswith("speed-bench:")


def _check_groups(recipe: Recipe, seen: set[str]) -> None:
    """eval.categories against the categories of the built-in / SPEED-Bench workloads it
    applied to (``seen``; none: nothing to check): a name they lack is a typo, and a group
    named after a category it does not list would merge into it silently."""
    groups = recipe.eval.categories or {}
    if not groups or not seen:
        return
    listed = {c for members in groups.values() for c in members}
    missing = sorted(listed - seen)
    if missing:
        raise RecipeError(f"eval.categories lists {', '.join(missing)}, which the workloads do "
                          f"not have (they have {', '.join(sorted(seen))})")
    clash = sorted(g for g in groups if g in seen - listed)
    if clash:
        raise RecipeError(f"eval.categories: group {clash[0]!r} is also a category of the "
                          "workload that no group lists: rename the group or list it")


def workload_pool(recipe: Recipe, selection: Selection, recipe_path: str | Path) -> list[Any]:
    """Every row of the eval's workloads (no per-category sample, no --num-prompts): what
    ``eval --until-decided`` draws new requests from."""
    from trtspec.eval.workloads import load_workload

    bench = selection.speed_bench_dir or _near_recipe("data/speed-bench", recipe_path)
    rows = []
    for spec in _specs(recipe, selection, recipe_path):
        rows += load_workload(spec, bench, None, recipe.sampling.seed,
                              None if _custom(spec) else recipe.eval.categories)
    if selection.max_tokens is not None:
        rows = [r.model_copy(update={"max_tokens": None}) for r in rows]
    return rows


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
          resume: str | Path | None, reports_root: str | Path, tag: str,
          extra: Callable[[Recipe, list[Any]], dict[str, Any]], say: Callable[[str], None],
          requests: list[Any] | None = None) -> tuple[Path, Recipe, list[Any], Selection, bool]:
    """(the eval folder, the recipe as this eval runs it, its requests, the selection, whether
    this call created the folder).

    A new eval never touches an existing folder: an eval id in use is refused before anything
    is written. A resumed eval takes its selection from the folder and must be the same eval:
    the same recipe digest (after overrides), requests and endpoint, else it stops and says
    what differs. ``extra`` adds what the caller stores (endpoints, conditions, the number of
    records a complete eval has); ``requests`` replaces the selection's (a confirmation)."""
    if resume:
        out = Path(resume)
        selection = resumed_selection(out, selection, recipe_path)
    recipe = load_recipe(recipe_path, selection.all_overrides())
    if not resume:
        out = Path(reports_root) / (eval_id or
                                    f"{recipe.name}{tag}-{time.strftime('%Y%m%d-%H%M%S')}")
        if out.exists() and any(out.iterdir()):
            raise FileExistsError(f"{out} exists: pass --resume {out} to continue that eval, "
                                  "or choose another --eval-id")
    if requests is None:
        requests = load_requests(recipe, selection, recipe_path, say)
    meta = {"recipe": recipe.name, "recipe_digest": recipe.digest(),
            "overrides": selection.all_overrides(),
            "workloads": list(selection.workloads or recipe.eval.workloads),
            "selection": asdict(selection),
            "requests": len(requests), "request_ids": _ids_digest(requests),
            **extra(recipe, requests)}
    if resume:
        _check_same_eval(out, meta, recipe)
        return out, recipe, requests, selection, False
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        out.mkdir(exist_ok=out.exists())  # an empty folder is fine; a racing eval is not
    except FileExistsError:
        raise FileExistsError(f"{out} was just created by another eval: choose another "
                              "--eval-id") from None
    shutil.copyfile(recipe_path, out / "recipe.yaml")
    meta["folder_id"] = uuid.uuid4().hex  # tells this folder's MLflow runs from another's
    meta["provenance"] = provenance(recipe, endpoint="endpoint" in meta)
    write_atomic(out / EVAL_META, json.dumps(meta, indent=2) + "\n")
    return out, recipe, requests, selection, True


def provenance(recipe: Recipe, endpoint: bool) -> dict[str, Any]:
    """What a reviewer needs to trace an eval's numbers to the code and machine that made them:
    the versions (trtspec, python, torch, transformers, tensorrt_llm), the git commit of the
    trtspec source that ran and whether its tracked files differed from it (None: not run from
    a git checkout), and the hardware the models ran on (None for an endpoint eval: the
    server's hardware is not visible to its client). Folders from before this was stored have
    none; the report says "not recorded" rather than guess."""
    from trtspec.build.manifest import versions

    sha, dirty = source_revision()
    return {"versions": versions(), "git_sha": sha, "git_dirty": dirty,
            "hardware": None if endpoint else hardware(recipe)}


def source_revision() -> tuple[str | None, bool]:
    """(the commit of the git checkout trtspec runs from, whether its tracked files have
    uncommitted changes); (None, False) when trtspec is not tracked by git where it is
    installed (a wheel, or a virtualenv inside some other repository)."""
    import subprocess

    package = Path(__file__).resolve().parents[1]

    def git(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["git", "-C", str(package), *args], capture_output=True,
                              text=True, timeout=10, check=False)

    try:
        if git("ls-files", "--error-unmatch", "__init__.py").returncode != 0:
            return None, False
        sha = git("rev-parse", "HEAD").stdout.strip()
        changed = git("status", "--porcelain", "--untracked-files=no").stdout.strip()
    except (OSError, subprocess.SubprocessError):  # no git, or it hung
        return None, False
    return sha or None, bool(sha and changed)


def hardware(recipe: Recipe) -> dict[str, Any]:
    """The device an in-process eval's models run on: ``device`` (cpu, cuda:0, …), ``name``
    (the GPU as its driver names it, or the CPU model), ``count`` (GPUs the target spans, or
    CPU cores)."""
    import platform

    device = recipe.backend.device if recipe.backend.kind == "torch" else "cuda"
    if device == "auto":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda"):
        from trtspec.build.gpu import detect

        index = int(device.partition(":")[2] or 0)
        gpus = detect()
        name = gpus[index].name if index < len(gpus) else "GPU not detected"
        return {"device": device, "name": name, "count": recipe.gpu.count}
    if device == "cpu":
        model = next((line.split(":", 1)[1].strip() for line in _cpuinfo()
                      if line.startswith("model name")), platform.processor() or
                     platform.machine())
        return {"device": "cpu", "name": model, "count": os.cpu_count() or 1}
    return {"device": device, "name": platform.machine(), "count": 1}  # mps


def _cpuinfo() -> list[str]:
    try:
        return Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:  # not Linux
        return []


def _ids_digest(requests: Sequence[Any]) -> str:
    return hashlib.sha256("\n".join(r.id for r in requests).encode()).hexdigest()[:16]


def _check_same_eval(out: Path, meta: dict[str, Any], recipe: Recipe) -> None:
    """Refuse to resume an eval folder with another recipe, request set or endpoint."""
    stored = stored_meta(out)
    if stored.get("recipe_digest") in recipe.digests():  # recorded by an older trtspec
        meta = {**meta, "recipe_digest": stored["recipe_digest"]}
    changed_requests = "a workload file changed since" + (
        "" if "selection" in stored else ", or that eval ran with a --per-category that older "
        "trtspec did not record: pass it again")
    names = {  # what differs → why it can
        "recipe_digest": ("the recipe", "the recipe file changed since"),
        "requests": ("the number of requests", changed_requests),
        "request_ids": ("the requests", changed_requests),
        "endpoint": ("the endpoint", f"that eval ran against {stored.get('endpoint')}"),
        "baseline_endpoint": ("the baseline endpoint",
                              f"that eval ran against {stored.get('baseline_endpoint')}"),
        "model": ("the model", f"that eval asked for {stored.get('model')}"),
        "conditions": ("the conditions", "the build's draft lengths changed since"),
        "client": ("the load mode", "that eval was measured by an older trtspec, in batches "
                   "that start together rather than by clients of the serving scheduler")}
    differ = [(label, why) for key, (label, why) in names.items()
              if (key in stored or key in meta) and stored.get(key) != meta.get(key)]
    if differ:
        why = "; ".join(dict.fromkeys(w for _, w in differ))
        raise RecipeError(f"--resume {out}: {', '.join(label for label, _ in differ)} "
                          f"differ from that eval's ({why}): start a new eval")


def discard_if_empty(out: Path) -> None:
    """Remove a folder this eval created when it stopped before recording anything: a failed
    start leaves no empty eval behind (nothing measured is lost)."""
    records = out / "records.jsonl"
    if not records.is_file() or not records.read_text().strip():
        shutil.rmtree(out, ignore_errors=True)
