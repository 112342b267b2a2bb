"""The recipe reference: every key path of the recipe models, from one walk over them.

The documented reference is rendered from it (``python -m trtspec.build.recipe.reference --write
docs/recipe-reference.md``), so the docs cannot drift from the models (a test compares them).
``load_recipe`` uses the same walk for its one-line errors: a key that belongs to another variant of
``backend`` or ``methods[]`` names that variant, and an unknown key gets the nearest valid path.
"""

from __future__ import annotations

import argparse
import difflib
import sys
import types
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo

from trtspec.build.recipe.schema import Recipe, RecipeError

START, END = "<!-- recipe-reference:start -->", "<!-- recipe-reference:end -->"
ITEM = "[]"  # a list item in a key path: methods[].min_n


@dataclass(frozen=True)
class Key:
    """One key path; ``variant`` is (tag key, tag) inside a discriminated union, e.g.
    ("method", "ngram") for methods[].min_n, else None; a section has keys of its own."""

    path: tuple[str, ...]
    field: FieldInfo
    variant: tuple[str, str] | None
    section: bool

    @property
    def dotted(self) -> str:
        return _dotted(self.path)


def _dotted(path: Sequence[str]) -> str:
    return ".".join(path).replace(f".{ITEM}", ITEM)


@cache
def keys() -> tuple[Key, ...]:
    """Every key path of a recipe, depth first, each union variant's keys apart."""
    return tuple(_walk(Recipe, (), None))


def _walk(model: type[BaseModel], prefix: tuple[str, ...],
          variant: tuple[str, str] | None) -> list[Key]:
    out = []
    for name, field in model.model_fields.items():
        path = (*prefix, name)
        models, in_list = _models(field.annotation)
        out.append(Key(path, field, variant, bool(models)))
        for sub in models:
            out += _walk(sub, (*path, ITEM) if in_list else path,
                         _tag(sub) if len(models) > 1 else variant)
    return out


def _strip(tp: Any) -> Any:
    return get_args(tp)[0] if get_origin(tp) is Annotated else tp


def _is_union(tp: Any) -> bool:
    return get_origin(tp) in (Union, types.UnionType)


def _is_model(tp: Any) -> bool:
    return isinstance(tp, type) and issubclass(tp, BaseModel)


def _models(tp: Any) -> tuple[list[type[BaseModel]], bool]:
    """The models a field holds (several for a union), and whether it is a list of them."""
    tp = _strip(tp)
    if get_origin(tp) is list:
        return _models(get_args(tp)[0])[0], True
    arms = [_strip(a) for a in (get_args(tp) if _is_union(tp) else (tp,))]
    return [a for a in arms if _is_model(a)], False


def _tag(model: type[BaseModel]) -> tuple[str, str]:
    """A union variant's discriminator: its first single-value Literal field."""
    for name, field in model.model_fields.items():
        if get_origin(field.annotation) is Literal and len(get_args(field.annotation)) == 1:
            return name, str(get_args(field.annotation)[0])
    raise TypeError(f"{model.__name__} has no tag field")


@cache
def _unions() -> dict[tuple[str, ...], dict[str, list[Key]]]:
    """Per discriminated union's path (("backend",), ("methods", ITEM)): each tag's keys."""
    out: dict[tuple[str, ...], dict[str, list[Key]]] = {}
    for k in keys():
        if k.variant:
            out.setdefault(k.path[:-1], {}).setdefault(k.variant[1], []).append(k)
    return out


# ---- the documented reference ----------------------------------------------------------------

def reference_markdown() -> str:
    """One table per section (and per method and backend kind): key path, type, default or
    "required", and meaning (the Field description)."""
    groups: dict[tuple[tuple[str, ...], tuple[str, str] | None], list[Key]] = {}
    for k in keys():
        groups.setdefault((k.path[:-1], k.variant), []).append(k)
    out: list[str] = []
    for (parent, variant), rows in groups.items():
        title = f"`{_dotted(parent)}`" if parent else "Top level"
        if variant:
            title += f" with `{variant[0]}: {variant[1]}`"
        out += ["", f"## {title}", "", "| key | type | default | meaning |", "|---|---|---|---|"]
        out += [f"| `{k.dotted}` | {_cell(_type(k.field.annotation, k.field.metadata))} | "
                f"{_default(k.field)} | {_cell(k.field.description or '')} |" for k in rows]
    return "\n".join(out).strip() + "\n"


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _type(tp: Any, metadata: Sequence[Any] = ()) -> str:
    origin, args = get_origin(tp), get_args(tp)
    if origin is Annotated:
        extra = [m for a in args[1:] for m in (a.metadata if isinstance(a, FieldInfo) else [a])]
        return _type(args[0], [*metadata, *extra])
    if origin is Literal:
        names = [f"`{a}`" for a in args]
        return " or ".join([", ".join(names[:-1]), names[-1]] if len(names) > 1 else names)
    if _is_union(tp):
        arms = [a for a in args if a is not type(None)]
        if all(_is_model(_strip(a)) for a in arms):
            return "mapping"
        text = " or ".join(_type(a, metadata) for a in arms)
        return text + (" or null" if len(arms) < len(args) else "")
    if origin is list:
        item = _type(args[0])
        item = f"({item})" if " or " in item else item  # list of (int or `adaptive`)
        return f"list of {'mappings' if item == 'mapping' else item}{_limits(metadata)}"
    if _is_model(tp):
        return "mapping"
    return f"{getattr(tp, '__name__', tp)}{_limits(metadata)}"


def _limits(metadata: Sequence[Any]) -> str:
    words = [word.format(getattr(m, attr)) for m in metadata
             for attr, word in (("ge", "≥ {}"), ("gt", "> {}"), ("le", "≤ {}"), ("lt", "< {}"),
                                ("min_length", "at least {}"), ("pattern", "matching `{}`"))
             if getattr(m, attr, None) is not None]
    return f" ({', '.join(words)})" if words else ""


def _default(field: FieldInfo) -> str:
    if field.is_required():
        return "required"
    return f"`{_yaml(field.get_default(call_default_factory=True))}`"


def _yaml(value: Any) -> str:
    """A default as a recipe writes it (a section's defaults are an empty mapping)."""
    if isinstance(value, BaseModel):
        return "{}"
    if value is None or isinstance(value, bool):
        return {None: "null", True: "true", False: "false"}[value]
    if isinstance(value, list):
        return f"[{', '.join(map(_yaml, value))}]"
    return str(value) if value != "" else '""'


def write_page(page: Path) -> None:
    """Rewrite the block between the markers with the current reference."""
    text = page.read_text()
    start, end = text.find(START), text.find(END)
    if start < 0 or end < start:
        raise RecipeError(f"{page}: no {START} … {END} block to rewrite")
    page.write_text(f"{text[:start]}{START}\n\n{reference_markdown()}\n{text[end:]}")


# ---- one-line errors for keys that do not fit ------------------------------------------------

def _normalise(loc: Sequence[Any]) -> tuple[tuple[str, ...], list[str],
                                             tuple[tuple[str, ...], str] | None]:
    """pydantic's loc → (key path with ITEM for indices, the path as written, the union
    variant it is in as (union path, tag)); pydantic's union-branch names are dropped."""
    unions = _unions()
    path: list[str] = []
    shown: list[str] = []
    variant: tuple[tuple[str, ...], str] | None = None
    for i, part in enumerate(loc):
        here = tuple(path)
        if isinstance(part, int):
            path.append(ITEM)
            shown.append(str(part))
        elif here in unions and (variant is None or variant[0] != here):
            variant = (here, str(part))
        elif "[" in str(part) and i < len(loc) - 1:  # list[int], literal['auto']
            continue
        else:
            path.append(str(part))
            shown.append(str(part))
    return tuple(path), shown, variant


def misplaced_keys(errors: Sequence[Any], set_keys: Collection[str] = ()
                   ) -> tuple[str, str] | None:
    """(where, message) when keys of one variant sit in another: switching backend.kind or a
    methods.N.method (often by --set) keeps the old variant's keys."""
    unions = _unions()
    found: dict[str, tuple[tuple[str, ...], str, list[tuple[str, str]]]] = {}
    missing: dict[str, list[str]] = {}
    for err in errors:
        path, shown, variant = _normalise(err["loc"])
        if variant is None or path[:-1] != variant[0]:
            continue
        union, tag = variant
        where = ".".join(shown[:-1])
        if err["type"] == "missing":
            missing.setdefault(where, []).append(path[-1])
        elif err["type"] == "extra_forbidden":
            owners = [t for t, ks in unions[union].items()
                      if t != tag and path[-1] in {k.path[-1] for k in ks}]
            if owners:
                found.setdefault(where, (union, tag, []))[2].append((path[-1], " or ".join(owners)))
    if not found:
        return None
    where, (union, tag, wrong) = next(iter(found.items()))
    tag_key = _tag_key(union)
    owners = list(dict.fromkeys(owner for _, owner in wrong))
    names = (f"{', '.join(key for key, _ in wrong)} ({'a key' if len(wrong) == 1 else 'keys'} "
             f"of {tag_key} {owners[0]})" if len(owners) == 1 else
             ", ".join(f"{key} ({tag_key} {owner})" for key, owner in wrong))
    paths = [f"{where}.{key}" for key, _ in wrong]
    in_set = [p for p in paths if any(p == s or p.startswith(f"{s}.") for s in set_keys)]
    in_file = [p for p in paths if p not in in_set]
    fixes = []
    if in_file:
        fixes.append(f"remove {', '.join(in_file)} from the recipe")
    if in_set:
        fixes.append(f"drop {', '.join(in_set)} from --set")
    needs = f"; {tag} needs {', '.join(missing[where])}" if missing.get(where) else ""
    return where, f"{tag_key} {tag} takes no {names}: {' and '.join(fixes)}{needs}"


def _tag_key(union: tuple[str, ...]) -> str:
    """The discriminator of the union at ``union``: kind, method."""
    first = next(iter(_unions()[union].values()))[0]
    return first.variant[0] if first.variant else ""


def unknown_key(loc: Sequence[Any], value: Any) -> tuple[str, str]:
    """(where, message) for a key no model has: the nearest valid key path, by its full path
    or by its last segment in another section; else the keys its section takes."""
    path, shown, variant = _normalise(loc)
    full, full_shown = path, list(shown)
    while isinstance(value, dict) and len(value) == 1:  # targt: {model: x} → targt.model
        key, value = next(iter(value.items()))
        full, full_shown = (*full, str(key)), [*full_shown, str(key)]
    allowed = {k.dotted: k for k in keys() if not (
        variant and k.variant and k.path[:len(variant[0])] == variant[0]
        and k.variant[1] != variant[1])}  # other variants of the union this key is in
    best = _nearest(full, allowed)
    if best:
        return ".".join(full_shown), f"unknown key (did you mean {_show(best, full, full_shown)}?)"
    parent = path[:-1]
    while parent and not any(k.path[:-1] == parent for k in allowed.values()):
        parent = parent[:-1]
    names = [k.path[-1] for k in allowed.values() if k.path[:-1] == parent]
    section = ".".join(shown[:len(parent)]) if parent else "a recipe"
    if variant and parent == variant[0]:
        section += f" with {_tag_key(variant[0])} {variant[1]}"
        other = _nearest(full, {k.dotted: k for k in keys()})  # a key of another variant?
        tags = [k.variant[1] for k in keys()
                if k.path == other and k.variant and k.variant[1] != variant[1]]
        if other and tags:
            return ".".join(shown), (f"unknown key for {section} (did you mean "
                                     f"{_show(other, full, full_shown)}, a key of "
                                     f"{_tag_key(variant[0])} {' or '.join(tags)}?)")
    return ".".join(shown), f"unknown key ({section} takes {', '.join(names)})"


def _nearest(path: tuple[str, ...], allowed: dict[str, Key]) -> tuple[str, ...] | None:
    """A sibling like the last segment; else, in a section that does not exist, the whole
    path (targt.model); else the same last segment in another section (target.tp_size)."""
    siblings = [k.path[-1] for k in allowed.values() if k.path[:-1] == path[:-1]]
    hit = difflib.get_close_matches(path[-1], siblings, 1, 0.7)
    if hit:
        return (*path[:-1], hit[0])
    hit = [] if siblings else difflib.get_close_matches(_dotted(path), list(allowed), 1, 0.8)
    if hit:
        return allowed[hit[0]].path
    hit = difflib.get_close_matches(path[-1], {k.path[-1] for k in allowed.values()}, 1, 0.8)
    if not hit:
        return None
    same = [k for k in allowed.values() if k.path[-1] == hit[0]]
    return max(same, key=lambda k: difflib.SequenceMatcher(None, _dotted(path), k.dotted)
               .ratio()).path


def _show(path: tuple[str, ...], user: tuple[str, ...], shown: list[str]) -> str:
    """A suggested path with the user's list indices where they line up (methods.1.max_n)."""
    return _dotted([shown[i] if p == ITEM and i < len(user) and user[i] == ITEM else p
                    for i, p in enumerate(path)])


def first_error(e: ValidationError, set_keys: list[str]) -> str:
    """The first problem as 'key.path: message (hint)'; other union branches are not counted.
    Keys of another backend kind or method come first (naming where they belong), and an
    unknown key gets the nearest valid key path."""
    errors = e.errors()
    locs = [_loc(err["loc"]) for err in errors]
    # a missing key is often a misspelt one (targte: → no target): report the spelling
    extra = [i for i, err in enumerate(errors) if err["type"] == "extra_forbidden"]
    near = [i for i in extra if errors[i]["loc"][:-1] == errors[0]["loc"][:-1]]
    first = (near or extra or [0])[0] if errors[0]["type"] == "missing" else 0
    err, loc = errors[first], locs[first]
    msg = err["msg"].removeprefix("Value error, ") + _HINTS.get(err["type"], "")
    if err["type"] == "extra_forbidden":
        loc, msg = unknown_key(err["loc"], err["input"])
    loc, msg = misplaced_keys(errors, set_keys) or (loc, msg)
    others = {other for other in locs if other != loc and not loc.startswith(other)
              and not other.startswith(f"{loc}.")}
    more = f" (+{len(others)} more)" if others else ""
    return f"{loc or 'recipe'}: {msg}{more}"


def _loc(parts: tuple[Any, ...]) -> str:
    """A key path without pydantic's union-branch names (tags, 'list[…]', "literal['auto']")."""
    tags = ("draft_model", "layer_skip", "ngram", "suffix", "medusa", "eagle", "torch", "trtllm")
    return ".".join(str(p) for p in parts if p not in tags and "[" not in str(p))


_HINTS = {"missing": " (add it to the recipe)"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m trtspec.build.recipe.reference",
        description="Print the recipe reference (markdown), or rewrite it in a docs page.")
    parser.add_argument("--write", metavar="PAGE", type=Path,
                        help=f"rewrite the block between {START} and {END}")
    args = parser.parse_args(argv)
    if args.write is None:
        sys.stdout.write(reference_markdown())
        return 0
    try:
        write_page(args.write)
    except OSError as e:
        print(f"error: {e.filename}: {e.strerror}", file=sys.stderr)
        return 2
    except RecipeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote the recipe reference into {args.write}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
