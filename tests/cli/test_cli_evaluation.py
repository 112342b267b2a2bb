"""`trtspec eval`'s shared pieces: the build folder is found from any working directory."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from trtspec.cli import main
from trtspec.cli.evaluation import engines_root

ROOT = Path(__file__).resolve().parents[2]


def test_the_build_folder_comes_from_the_flag_the_environment_or_the_recipe_s_project(
        tmp_path: Path, monkeypatch) -> None:
    project = tmp_path / "proj"
    (project / "recipes" / "team").mkdir(parents=True)
    recipe = project / "recipes" / "team" / "x.yaml"
    recipe.write_text("name: x\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("TRTSPEC_ENGINES", raising=False)
    assert engines_root(recipe, "e") == (Path("e"), "from --engines")
    assert engines_root("proj/recipes/team/x.yaml", None) == (
        Path("proj/engines"), "the project of proj/recipes/team/x.yaml")
    loose = tmp_path / "x.yaml"
    assert engines_root(loose, None)[0] == Path("engines")
    monkeypatch.setenv("TRTSPEC_ENGINES", "/elsewhere")
    assert engines_root(recipe, None) == (Path("/elsewhere"), "from $TRTSPEC_ENGINES")
    monkeypatch.chdir(project / "recipes")  # outside the working directory: absolute
    assert engines_root(recipe, "../../e")[0] == tmp_path / "e"


def test_eval_from_another_folder_looks_in_the_recipe_s_project_and_says_so(
        tmp_path: Path, monkeypatch, capsys) -> None:
    project = tmp_path / "proj"
    (project / "recipes").mkdir(parents=True)
    shutil.copyfile(ROOT / "recipes" / "cpu-smollm2.yaml", project / "recipes" / "cpu.yaml")
    (tmp_path / "somewhere").mkdir()
    monkeypatch.chdir(tmp_path / "somewhere")
    monkeypatch.delenv("TRTSPEC_ENGINES", raising=False)
    with pytest.raises(SystemExit) as exit_info:
        main(["eval", str(project / "recipes" / "cpu.yaml"), "--no-mlflow"])
    err = " ".join(capsys.readouterr().err.split())
    assert exit_info.value.code == 2
    assert f"looked in {project / 'engines'}: the project of" in err
    assert "--engines or $TRTSPEC_ENGINES choose another" in err
    assert not (tmp_path / "somewhere" / "reports").exists()


def test_progress_off_a_terminal_is_a_line_every_few_seconds_with_time_left() -> None:
    from trtspec.cli.evaluation import Ticker

    lines: list[str] = []
    now = [100.0]
    tick = Ticker(None, None, tty=False, every=10.0, echo=lines.append)
    tick.clock = lambda: now[0]
    tick(0, 40, "ngram/D4/c1: loading and warming up")
    now[0] += 300  # warm-up: not counted in the rate
    tick(0, 40, "ngram/D4/c1 baseline")
    for done in range(1, 11):  # one record every 3 s
        now[0] += 3
        tick(done, 40, "ngram/D4/c1 spec")
    assert lines == ["eval: 0/40 records · now ngram/D4/c1: loading and warming up",
                     "eval: 0/40 records · now ngram/D4/c1 baseline",
                     "eval: 4/40 records, about 1m48s left · now ngram/D4/c1 spec",
                     "eval: 8/40 records, about 1m36s left · now ngram/D4/c1 spec"]
    tick(40, 40, "ngram/D4/c1 spec")  # the last one always
    assert lines[-1] == "eval: 40/40 records · now ngram/D4/c1 spec"
