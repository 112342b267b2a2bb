"""The README's tour, run as written: build → eval → audit → decide → serve → approve on the CPU
recipe, in a fresh project folder (its own engines/, reports/ and mlflow.db), with the exit code
and the outcome each step promises. Two liberties: the project's engines/ starts as a copy of
the session's build of the same recipe (so step 1 finds it up to date, as a second run of the
tour does), and serve's `--port 8000` becomes a free port.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import signal
from pathlib import Path

import openai
import pytest
from conftest import copy_build, launch

from trtspec.cli import main

ROOT = Path(__file__).resolve().parents[1]


def tour() -> list[list[str]]:
    """The tour's commands: each fenced block of the README's tour section is one command."""
    text = (ROOT / "README.md").read_text()
    section = text.split("\n## A tour", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```bash\n(.*?)```", section, flags=re.S)
    return [shlex.split(block.replace("\\\n", " ")) for block in blocks]


def run(argv: list[str]) -> int:
    try:
        main(argv)
    except SystemExit as e:
        return e.code or 0
    return 0


def test_the_tour_is_six_steps_of_one_command() -> None:
    steps = tour()
    assert [argv[:2] for argv in steps] == [["trtspec", c] for c in (
        "build", "eval", "audit", "decide", "serve", "approve")]


def test_the_readme_tour_runs_as_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                        cpu_build, capsys: pytest.CaptureFixture[str]) -> None:
    import trtspec.build.gpu

    if trtspec.build.gpu.detect():  # the build folder would be engines/cpu-smollm2/<gpu>/
        pytest.skip("the tour as written is for a machine without an NVIDIA GPU")
    (tmp_path / "recipes").mkdir()
    shutil.copy(ROOT / "recipes" / "cpu-smollm2.yaml", tmp_path / "recipes")
    copy_build(cpu_build, tmp_path / "engines")
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("TRTSPEC_ENGINES", raising=False)
    build, evaluate, audit, decide, serve, approve = (argv[1:] for argv in tour())

    assert run(build) == 0 and "up to date" in capsys.readouterr().out
    assert (tmp_path / "engines" / "cpu-smollm2" / "cpu" / "manifest.json").is_file()
    assert run(evaluate) == 0
    out = tmp_path / "reports" / "tour"
    assert (out / "records.jsonl").is_file() and (out / "mlflow.json").is_file()
    assert run(audit) == 1  # a weak PASS: the sampler is right, 200 samples cannot say so
    ngram = json.loads((out / "audit.json").read_text())["methods"]["ngram"]
    assert ngram["passed"] and ngram["weak"] and ngram["power"] < 0.8, ngram
    assert run(decide) == 1  # not every condition GO
    decision = json.loads((out / "decision.json").read_text())
    assert all(v["verdict"] != "GO" for v in decision["verdicts"])  # a weak audit holds GO
    assert "weak" in (out / "report.md").read_text() and (out / "report.html").is_file()
    capsys.readouterr()

    port = serve[serve.index("--port") + 1]
    assert port == "8000"
    proc, url = launch(*[a for a in serve[1:] if a not in ("--port", port)])  # a free port
    try:
        reply = openai.OpenAI(base_url=url, api_key="x").chat.completions.create(
            model="smollm2-135m-instruct", messages=[{"role": "user", "content": "Hi"}],
            max_tokens=8)
        assert reply.usage.completion_tokens <= 8
    finally:
        proc.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 0, stderr
    assert "plain decoding" in stdout  # nothing is GO: the policy says so at start-up

    assert run(approve) == 2  # no GO, weak audit: refused, nothing registered
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "GO" in err[0], err
