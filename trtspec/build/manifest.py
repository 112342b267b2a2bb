"""What was built: versions, GPU, flags and digests, so every later number traces back to it.

``engines/<recipe>/<gpu>/manifest.json`` for the recipe as written; ``--set`` overrides that
change what is built get their own ``<gpu>-<digest>/`` folder (see :func:`build_dir`). Engines
are not portable across compute capabilities ("The engine plan file is generated on an
incompatible device"), so opening a manifest whose GPU differs from this machine's fails with one
line; torch-backend manifests built on the CPU are portable.
"""

from __future__ import annotations

import hashlib
import json
import re
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from trtspec.build.gpu import DetectedGpu
from trtspec.spec.cost_curve import CostCurve

MANIFEST = "manifest.json"


BUILT_RECIPE = "recipe.yaml"  # the recipe as built, beside manifest.json in a build folder

class ManifestError(ValueError):
    """A manifest that cannot be used here (one line)."""


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class GpuInfo(Strict):
    name: str
    compute_capability: str
    driver: str | None = None
    count: int = 1
    detected: bool = Field(description="False when planned for with --gpu on another machine")


class Artifact(Strict):
    name: str  # target, target-spec, draft, medusa, eagle, llmapi-ngram-d4 …
    role: Literal["target", "draft", "heads", "config"]
    source: str  # the model spec it came from
    path: str  # where it is (a directory or file)
    flags: dict[str, Any] = Field(default_factory=dict)
    config_digest: str | None = None
    tokenizer_digest: str | None = None
    vocab_size: int | None = None
    num_layers: int | None = None


class RunnerInfo(Strict):
    """How the torch backend runs the target (see trtspec.runtime.compiled)."""

    kind: Literal["compiled", "eager", "transformers"]  # as built: after any fallback
    requested: Literal["compiled", "eager", "transformers"] = "compiled"  # the recipe's
    compile_seconds: float | None = None  # build's warm-up: compiling, or loading the cache
    cache_dir: str | None = None  # inductor's cache, reused by eval and serve
    note: str | None = None  # why it is not what was requested
    prepacked: bool | None = None  # GEMM weights prepacked for oneDNN when the build measured
    # its cost curve (None: a build from before trtspec prepacked: not prepacked)
    packed_attention: bool | None = None  # a call of 2+ tokens a row attended packed (grouped
    # query heads as rows of their key/value head) when the build measured its cost curve
    # (None: a build from before trtspec recorded it)


class Manifest(Strict):
    schema_version: Literal[1] = 1
    recipe: str
    recipe_digest: str  # the whole recipe that built it (provenance)
    build_digest: str | None = None  # Recipe.build_digest(): what the artefacts depend on
    build_inputs: dict[str, Any] = Field(default_factory=dict)  # to name what changed
    methods: dict[str, str] = Field(default_factory=dict)  # method → Recipe.method_digests()
    backend: Literal["torch", "trtllm"]
    workflow: Literal["engine", "pytorch"] | None = None
    created: str = Field(default_factory=lambda: datetime.now(timezone.utc).isoformat())
    versions: dict[str, str | None]
    gpu: GpuInfo | None = None
    draft_lengths: list[int]
    d0: int | None = None
    d0_derivation: str | None = None
    artifacts: list[Artifact]
    commands: list[str] = Field(default_factory=list)
    # the adaptive draft length's costs (torch backend); None: built before it was measured
    cost_curve: CostCurve | None = None
    runner: RunnerInfo | None = None  # torch backend; None: built before runners were recorded

    def save(self, directory: Path) -> Path:
        directory.mkdir(parents=True, exist_ok=True)
        from trtspec.build.files import write_atomic

        return write_atomic(directory / MANIFEST, self.model_dump_json(indent=2) + "\n")

    def left_out(self) -> dict[str, str]:
        """Methods the build left out (heads whose folder did not exist then) → why, and how to
        get them."""
        return {a.name: a.flags["missing"] for a in self.artifacts if "missing" in a.flags}

    def artifact(self, name: str) -> Artifact:
        for a in self.artifacts:
            if a.name == name:
                return a
        raise ManifestError(f"manifest of '{self.recipe}' has no artifact '{name}'")


def load_manifest(path: str | Path) -> Manifest:
    path = Path(path)
    if path.is_dir():
        path = path / MANIFEST
    if not path.is_file():
        raise ManifestError(f"{path}: no manifest here: run `trtspec build RECIPE` first")
    try:
        return Manifest.model_validate(json.loads(path.read_text()))
    except (json.JSONDecodeError, ValidationError) as e:
        first = e.errors()[0] if isinstance(e, ValidationError) else {"loc": (), "msg": str(e)}
        where = ".".join(map(str, first["loc"]))
        raise ManifestError(f"{path}: not a valid trtspec manifest ({where}: {first['msg']}): "
                            "rebuild with `trtspec build RECIPE --force`") from None


def check_gpu(manifest: Manifest, gpus: list[DetectedGpu], path: str | Path = "") -> None:
    """Refuse a manifest built for another compute capability than this machine's GPU."""
    if manifest.gpu is None:
        return  # built for the CPU: portable
    where = f"{path}: " if path else ""
    built = f"{manifest.gpu.name} (compute capability {manifest.gpu.compute_capability})"
    if not gpus:
        raise ManifestError(f"{where}built for {built}, but this machine has no NVIDIA GPU: run "
                            "it on that GPU or rebuild for this machine")
    here = gpus[0]
    if here.compute_capability != manifest.gpu.compute_capability:
        raise ManifestError(
            f"{where}built for {built}, but this machine has {here.name} (compute capability "
            f"{here.compute_capability}): engines are not portable across GPUs, rebuild with "
            "`trtspec build RECIPE --force`")


def open_built(recipe: Any, recipe_path: str | Path, engines_root: str | Path = "engines"
               ) -> tuple[Manifest, Path]:
    """The manifest ``trtspec build`` wrote for this recipe (and its --set overrides) on this
    machine, checked: same GPU class, and built for what this recipe needs (see
    :func:`check_covers`). Its folder is :func:`build_dir`'s; when that holds no build, another
    build of this recipe for this GPU that covers it (more methods, say) is used."""
    from trtspec.build.gpu import detect, profile

    gpus = detect()
    slug = profile(recipe.gpu.name).slug if recipe.gpu.name != "auto" else (  # as build names it
        gpus[0].profile().slug if gpus and gpus[0].profile() else "cpu")
    folder, _ = build_dir(recipe, recipe_path, slug, engines_root)
    path = folder / MANIFEST
    if not path.is_file():
        found, nearest = _covering(recipe, _other_builds(folder, slug))
        if found is not None:
            path = found
        elif nearest is not None:
            raise ManifestError(f"{recipe_path}: no build in {folder}/, and {nearest}: run "
                                "`trtspec build` with this recipe and its --set overrides")
        elif folder.name != slug:
            raise ManifestError(f"{path}: no build for these --set overrides (they change what "
                                f"is built): run `trtspec build {recipe_path}` with the same --set")
    manifest = load_manifest(path)
    check_gpu(manifest, gpus, path)
    problem = check_covers(manifest, recipe)
    if problem:
        raise ManifestError(f"{recipe_path}: {path} {problem}: run `trtspec build` with this "
                            "recipe and its --set overrides")
    return manifest, path


def _other_builds(folder: Path, slug: str) -> list[Path]:
    """The other build folders of this recipe for this GPU, the as-written one first."""
    if not folder.parent.is_dir():
        return []
    pattern = rf"{re.escape(slug)}(-[0-9a-f]{{8}})?"
    found = [p for p in sorted(folder.parent.iterdir()) if p != folder
             and re.fullmatch(pattern, p.name) and (p / MANIFEST).is_file()]
    return sorted(found, key=lambda p: p.name != slug)


def _covering(recipe: Any, folders: list[Path]) -> tuple[Path | None, str | None]:
    """(the first folder's manifest that covers the recipe, None), else (None, what the first
    readable one lacks, or None when there is none)."""
    nearest = None
    for folder in folders:
        try:
            problem = check_covers(load_manifest(folder), recipe)
        except ManifestError:
            continue
        if problem is None:
            return folder / MANIFEST, None
        nearest = nearest or f"{folder / MANIFEST} {problem}"
    return None, nearest


def build_dir(recipe: Any, recipe_path: str | Path, slug: str, engines_root: str | Path
              ) -> tuple[Path, Path | None]:
    """Where ``trtspec build`` writes this recipe's build and where eval and audit look for it:
    ``<root>/<name>/<slug>/`` when the recipe as written (its file, no --set) builds all it
    needs, else ``<root>/<name>/<slug>-<digest>/``, so builds with other --set overrides never
    replace each other (a recipe file that is not valid without its overrides keeps
    ``<slug>/``). Returns (that folder, the as-written recipe's folder when the overrides moved
    it, else None)."""
    from trtspec.build.recipe import load_recipe

    home = Path(engines_root) / recipe.name / slug
    try:
        written = load_recipe(recipe_path)
    except (ValueError, OSError):  # valid only with its overrides: nothing to keep apart from
        return home, None
    if _builds_all_of(written, recipe):
        return home, None
    return (home.with_name(f"{slug}-{_build_key(recipe)[:8]}"),
            Path(engines_root) / written.name / slug)


def _builds_all_of(written: Any, recipe: Any) -> bool:
    """The as-written recipe's build serves ``recipe``: the same build inputs (the GPU's name
    aside: the folder's slug names the GPU) and each of its methods with the same settings."""
    def inputs(r: Any) -> dict[str, Any]:
        out = r.build_inputs()
        out["gpu"] = {k: v for k, v in out["gpu"].items() if k != "name"}
        return out

    built = written.method_digests()
    return inputs(written) == inputs(recipe) and all(
        built.get(method) == digest for method, digest in recipe.method_digests().items())


def _build_key(recipe: Any) -> str:
    """A digest of everything a build depends on: its inputs and its methods' settings."""
    data = {"build": recipe.build_digest(), "methods": recipe.method_digests()}
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()


def check_covers(manifest: Manifest, recipe: Any) -> str | None:
    """None when the build serves this recipe: the same build inputs (target, dtype, backend,
    device, GPU, and for engines limits and draft lengths), and every method of the recipe
    built with the same settings (a subset of the built methods is fine); else what differs."""
    if manifest.build_digest is None:
        return "was written by an older trtspec (no build digest)"
    if manifest.build_digest != recipe.build_digest():
        changed = _changed(manifest.build_inputs, recipe.build_inputs())
        return f"was built for other settings ({'; '.join(changed) or 'build inputs'})"
    for method, digest in recipe.method_digests().items():
        if method not in manifest.methods:
            return (f"has no {method} (built: {', '.join(manifest.methods) or 'no method'})")
        if manifest.methods[method] != digest:
            return f"was built with other {method} settings"
    return None


def _left_out_at_default() -> dict[str, Any]:
    """Build inputs that Recipe.build_inputs leaves out while at their default: the default."""
    from trtspec.build.recipe import TorchBackend

    return {"backend.runner": TorchBackend.model_fields["runner"].default}


def _changed(built: dict[str, Any], wanted: dict[str, Any], prefix: str = "") -> list[str]:
    """'key.path: built → wanted' for every leaf that differs."""
    out = []
    for key in sorted(set(built) | set(wanted)):
        default = _left_out_at_default().get(prefix + key)
        a, b = built.get(key, default), wanted.get(key, default)
        if isinstance(a, dict) and isinstance(b, dict):
            out += _changed(a, b, f"{prefix}{key}.")
        elif a != b:
            out.append(f"{prefix}{key}: built {a}, recipe {b}")
    return out


def versions() -> dict[str, str | None]:
    """trtspec, python, torch, transformers and tensorrt_llm versions (None = not installed)."""
    from importlib.metadata import PackageNotFoundError, version

    out: dict[str, str | None] = {"python": sys.version.split()[0]}
    for dist in ("trtspec", "torch", "transformers", "tensorrt_llm"):
        try:
            out[dist] = version(dist if dist != "tensorrt_llm" else "tensorrt-llm")
        except PackageNotFoundError:
            out[dist] = None
    return out


def file_digest(*paths: Path) -> str | None:
    """sha256 over the given files that exist (in order); None when none does."""
    digest, found = hashlib.sha256(), False
    for p in paths:
        if p.is_file():
            found = True
            digest.update(p.name.encode())
            digest.update(p.read_bytes())
    return digest.hexdigest() if found else None


def build_fingerprint(m: Any) -> tuple[Any, ...]:
    """What makes two builds the same models: the build digest and each artifact's config and
    tokenizer digests (a rebuild behind the same recipe changes the latter)."""
    return (m.build_digest, sorted((a.name, a.config_digest, a.tokenizer_digest)
                                   for a in m.artifacts))
