"""docs/ builds into a site with `mkdocs build --strict` (what `make docs`, part of `make test`,
runs), and strict mode has teeth: a broken link or a page left out of the navigation fails it.
(Not with --quiet: it silences the warnings that strict mode counts, and the build passes.)"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _build(project: Path, site: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict",
                           "-f", str(project / "mkdocs.yml"), "-d", str(site)],
                          capture_output=True, text=True, env=env, timeout=120)


@pytest.fixture
def project(tmp_path: Path) -> Path:
    """A copy of the docs and their config, to break."""
    shutil.copytree(ROOT / "docs", tmp_path / "docs")
    shutil.copy(ROOT / "mkdocs.yml", tmp_path / "mkdocs.yml")
    return tmp_path


def test_the_docs_build_strictly_with_every_page_in_the_nav(project: Path) -> None:
    built = _build(project, project / "site")
    assert built.returncode == 0, built.stderr
    for page in (ROOT / "docs").glob("*.md"):
        name = "index.html" if page.stem == "index" else f"{page.stem}/index.html"
        assert (project / "site" / name).is_file(), f"{page.name} was not built"


def test_a_broken_link_fails_the_build(project: Path) -> None:
    page = project / "docs" / "serve.md"
    page.write_text(page.read_text() + "\nSee [the missing page](missing.md).\n")
    built = _build(project, project / "site")
    assert built.returncode != 0 and "missing.md" in built.stderr


def test_a_page_left_out_of_the_nav_fails_the_build(project: Path) -> None:
    (project / "docs" / "orphan.md").write_text("# Orphan\n")
    built = _build(project, project / "site")
    assert built.returncode != 0 and "orphan.md" in built.stderr
