"""The import contracts `make lint` checks (import-linter, `[tool.importlinter]` in
pyproject.toml) hold, and have teeth: a copy of the package with one wrong import fails them,
naming it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def lint(tmp_path: Path, edits: dict[str, str]) -> subprocess.CompletedProcess:
    """lint-imports on a copy of trtspec with ``edits`` (module file → a line appended)."""
    shutil.copytree(ROOT / "trtspec", tmp_path / "trtspec",
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    for path, line in edits.items():
        with (tmp_path / path).open("a") as f:
            f.write(f"\n{line}\n")
    lint_imports = Path(sys.executable).parent / "lint-imports"
    return subprocess.run([str(lint_imports), "--no-cache"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(tmp_path)})


def test_the_package_keeps_every_contract(tmp_path: Path) -> None:
    done = lint(tmp_path, {})
    assert done.returncode == 0, done.stdout
    assert "0 broken" in done.stdout


@pytest.mark.parametrize(("edits", "message"), [
    ({"trtspec/runtime/toy.py": "import trtspec.cli"},
     "trtspec.runtime is not allowed to import trtspec.cli"),
    ({"trtspec/spec/sample/verify.py": "import trtspec.spec.executor"},
     "trtspec.spec.sample is not allowed to import trtspec.spec.executor"),
    ({"trtspec/analysis/stats.py": "import trtspec.analysis.gof",
      "trtspec/analysis/gof.py": "import trtspec.analysis.stats"},
     "no import circles among the modules of any package BROKEN"),
], ids=["upward", "sampler", "circle"])
def test_a_wrong_import_breaks_a_contract_and_is_named(tmp_path: Path, edits: dict[str, str],
                                                        message: str) -> None:
    done = lint(tmp_path, edits)
    assert done.returncode != 0 and message in done.stdout, done.stdout
