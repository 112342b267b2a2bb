"""The README and docs/ agree with `trtspec --help`, the README stays a five-minute read whose
links resolve, and nothing users get points outside the repository."""

from __future__ import annotations

import re
from pathlib import Path

import click
import pytest

from trtspec.cli import cli

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
PAGES = sorted((ROOT / "docs").glob("*.md"))
DOCS = "\n".join([README, *(page.read_text() for page in PAGES)])  # what users read


def _code() -> list[str]:
    """Every command line in the README's and docs' code: fenced blocks (continuations joined)
    and inline spans."""
    lines: list[str] = []
    for block in re.findall(r"```[a-z]*\n(.*?)```", DOCS, flags=re.S):
        lines += block.replace("\\\n", " ").splitlines()
    prose = re.sub(r"```.*?```", "", DOCS, flags=re.S)
    return lines + re.findall(r"`([^`\n]+)`", prose)


def _invocations() -> list[tuple[str, list[str]]]:
    """(command, its tokens) for each `trtspec COMMAND …` in the README's and docs' code."""
    found = []
    for line in _code():
        for match in re.finditer(r"(?:^|[\s/])trtspec ([a-z][a-z-]*)((?: [^#;|&]*)?)", line):
            found.append((match.group(1), match.group(2).split()))
    return found


def test_every_command_the_docs_run_exists_with_the_options_it_uses() -> None:
    commands = cli.commands
    invocations = _invocations()
    assert len(invocations) > 20
    for name, tokens in invocations:
        assert name in commands, f"the docs run `trtspec {name}`, which does not exist"
        options = {opt for p in commands[name].params for opt in p.opts + p.secondary_opts}
        for token in tokens:
            flag = token.split("=")[0]
            if flag.startswith("-") and flag not in ("-", "--"):
                assert flag in options, f"docs: `trtspec {name}` has no option {flag}"


def test_every_command_and_option_in_help_is_documented() -> None:
    help_text = cli.get_help(click.Context(cli))
    listed = set(re.findall(r"^  ([a-z][a-z-]*)  ", help_text.split("Commands:")[1], re.M))
    assert listed == set(cli.commands)
    used = {name for name, _ in _invocations()}
    for name in listed:
        assert name in used, f"`trtspec {name}` is in --help but the docs never show it"
        for param in cli.commands[name].params:
            for flag in (o for o in param.opts + param.secondary_opts if o.startswith("--")):
                assert re.search(rf"{re.escape(flag)}(?![\w-])", DOCS), \
                    f"`trtspec {name} {flag}` is in --help but not in the docs"


def test_the_readme_is_a_five_minute_read_whose_links_resolve() -> None:
    assert len(README.splitlines()) <= 250, "README over 250 lines: move the detail to docs/"
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", README)
    assert len(links) >= 10
    for link in links:
        assert "://" in link or (ROOT / link).is_file(), f"README links to {link}, not a file"
    documented = {link for link in links if link.startswith("docs/")}
    assert documented == {f"docs/{page.name}" for page in PAGES} - {"docs/index.md"}, \
        "every docs/ page (but the site's index) is in the README's table, and only those"


def test_nothing_users_get_points_outside_the_repository() -> None:
    files = [ROOT / "README.md", *PAGES, ROOT / "mkdocs.yml", *(ROOT / "recipes").glob("*.yaml"),
             *(ROOT / "trtspec").rglob("*.py"), *(ROOT / "engines").glob("*.md"),
             *(ROOT / "reports").glob("*.md"), *(ROOT / "benchmarks").glob("*.py"),
             *ROOT.glob("constraints*.txt"), ROOT / "Makefile", ROOT / "pyproject.toml"]
    for path in files:
        text = path.read_text()
        # spelled in pieces, so this file does not itself name what it looks for
        for needle in ("../" + "shared", "DESIGN" + ".md", "REFERENCE" + ".md",
                       "REFERENCE" + " §", "seed-" + "speculative"):
            assert needle not in text, f"{path.relative_to(ROOT)} refers to {needle}"


def test_a_fresh_clone_tracks_only_readmes_and_benchmark_reports_in_engines_and_reports() -> None:
    """engines/ and reports/ exist in a clone (their READMEs, committed benchmark tables and
    the raw blocks a table rests on, ``bench-*.json``); what build and eval generate there is
    ignored by git."""
    import shutil
    import subprocess

    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")

    def git(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True)

    assert git("ls-files", "engines").stdout.split() == ["engines/README.md"]
    assert all(re.fullmatch(r"reports/bench-[a-z][a-z0-9-]*\.(md|json)", f)
               for f in git("ls-files", "reports").stdout.split())
    generated = ["engines/demo/cpu/manifest.json", "engines/demo/cpu/inductor/x",
                 "engines/demo/h200-1a2b3c4d/engines/target/rank0.engine",
                 "reports/demo-20261130-120000/records.jsonl"]
    ignored = git("check-ignore", *generated).stdout.split()
    assert ignored == generated
    tree = (ROOT / "engines" / "README.md").read_text()
    for written in ("manifest.json", "recipe.yaml", "inductor/", "checkpoints/", "llmapi/"):
        assert written in tree, f"engines/README.md does not say build writes {written}"
