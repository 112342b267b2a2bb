"""`trtspec` command: version, toy generate, one-line errors with non-zero exit codes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from trtspec import __version__

ROOT = Path(__file__).resolve().parents[2]


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "trtspec", *args], capture_output=True,
                          text=True, timeout=120)


def test_version() -> None:
    out = run("--version")
    assert out.returncode == 0 and __version__ in out.stdout


def test_generate_toy_json_reports_tokens_and_stats() -> None:
    out = run("generate", "--backend", "toy", "--method", "draft_model", "-n", "4",
              "--max-tokens", "12", "-D", "3", "--seed", "5", "--json")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert len(data["completions"]) == 4
    assert all(len(c["token_ids"]) == 12 for c in data["completions"])
    stats = data["stats"]
    assert stats["emitted_tokens"] == 4 * 11
    assert 1.0 <= stats["al_pooled"] <= 4.0
    plain = json.loads(run("generate", "--backend", "toy", "--method", "none", "--json").stdout)
    assert plain["stats"]["acceptance_rate"] is None and plain["stats"]["al_pooled"] == 1.0


def test_generate_prints_a_table() -> None:
    out = run("generate", "--backend", "toy", "--method", "draft_model", "--temperature", "0",
              "--max-tokens", "8")
    assert out.returncode == 0 and "acceptance_rate" in out.stderr and "request 0" in out.stderr


def test_generate_text_goes_to_stdout_and_statistics_to_stderr() -> None:
    """`trtspec generate … > out.txt` keeps just the text; --json is one object on stdout."""
    from click.testing import CliRunner

    from trtspec.cli import cli

    runner = CliRunner()
    toy = ["generate", "--backend", "toy", "--method", "draft_model", "--max-tokens", "8"]
    result = runner.invoke(cli, [*toy, "-n", "2"])
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert len(lines) == 2 and all(len(line.split()) == 8 for line in lines)
    assert all(t.isdigit() for line in lines for t in line.split())  # token ids only
    for text in ("request 0", "request 1", "speculation stats", "acceptance_rate",
                 "output tokens / s"):
        assert text in result.stderr and text not in result.stdout
    result = runner.invoke(cli, [*toy, "--json"])
    assert result.exit_code == 0 and result.stderr == ""
    assert len(json.loads(result.stdout)["completions"][0]["token_ids"]) == 8


def test_generate_method_none_shows_undefined_rates_as_a_dash() -> None:
    out = run("generate", "--backend", "toy", "--method", "none", "--max-tokens", "6")
    assert out.returncode == 0, out.stderr
    assert "nan" not in out.stdout + out.stderr
    rows = {line.split("│")[1].strip(): line.split("│")[2].strip()
            for line in out.stderr.splitlines() if line.count("│") == 3}
    assert rows["acceptance_rate"] == "—" and rows["alpha"] == "—"
    assert rows["al_pooled"] == "1.000"


def refuse_to_load(monkeypatch) -> None:
    """Any weight loading fails the test: these errors must come first."""
    import trtspec.runtime.models

    def load(*args, **kwargs):
        raise AssertionError("loaded weights before checking the options")

    monkeypatch.setattr(trtspec.runtime.models, "load", load)


def test_draft_model_without_a_draft_is_refused_before_loading(monkeypatch, capsys) -> None:
    from trtspec.cli import main

    refuse_to_load(monkeypatch)
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "--method", "draft_model"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.count("\n") == 1, err
    assert "--method draft_model needs a draft model: pass --draft-model NAME" in err
    assert "see 'trtspec generate --help'" in err


def test_a_missing_cuda_device_is_refused_before_loading(monkeypatch, capsys) -> None:
    import torch

    from trtspec.cli import main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # also on a GPU machine
    refuse_to_load(monkeypatch)
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "--device", "cuda"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.count("\n") == 1, err
    assert "--device" in err and "no CUDA GPU" in err


def test_bad_input_is_one_line_and_nonzero() -> None:
    for args, text in [(("generate", "--backend", "toy", "--prompt", "1 99"), "outside 0..31"),
                       (("generate", "--backend", "toy", "--prompt", "a b"), "are token ids"),
                       (("generate", "--top-p", "0"), "--top-p")]:
        out = run(*args)
        assert out.returncode == 2, (args, out.stderr)
        assert text in out.stderr and "Traceback" not in out.stderr


def test_generate_torch_streams_text_and_stats(smollm2) -> None:
    out = run("generate", "--model", "smollm2-135m-instruct", "--method", "ngram", "-D", "4",
              "--temperature", "0", "--max-tokens", "12", "--prompt", "List three colours.")
    assert out.returncode == 0, out.stderr
    assert "acceptance_rate" in out.stderr and "output tokens / s" in out.stderr
    assert "acceptance_rate" not in out.stdout and out.stdout.strip()  # the text alone
    data = json.loads(run("generate", "--method", "layer_skip", "--draft-layers", "20",
                          "--temperature", "0.7", "--seed", "1", "--max-tokens", "6",
                          "--json").stdout)
    assert len(data["completions"][0]["token_ids"]) <= 6 and data["completions"][0]["text"]
    # adaptive D times the draft now (no build): a view over the target's cache cannot prefill,
    # so the timing uses one with a cache of its own
    out = run("generate", "--method", "layer_skip", "--draft-layers", "20", "-D", "adaptive",
              "--temperature", "0", "--max-tokens", "6", "--json")
    assert out.returncode == 0, out.stderr
    assert "timing the models now" in out.stderr


def test_torch_errors_are_one_line(tmp_path) -> None:
    for args, text in [(("generate", "--model", "no-such-model"), "is not a built-in"),
                       (("generate", "--method", "draft_model"), "needs a draft model"),
                       (("generate", "--backend", "toy", "--method", "layer_skip"),
                        "no layers to skip")]:
        out = run(*args)
        assert out.returncode == 2, (args, out.stderr)
        assert text in out.stderr and "Traceback" not in out.stderr


def test_audit_and_decide_errors_are_one_line(tmp_path) -> None:
    (tmp_path / "endpoint").mkdir()
    (tmp_path / "endpoint" / "recipe.yaml").write_text(
        (ROOT / "recipes" / "cpu-smollm2.yaml").read_text())
    recipe = str(ROOT / "recipes" / "cpu-smollm2.yaml")
    for args, text in [(("audit", str(tmp_path)), "is not an eval folder"),
                       (("audit", str(tmp_path / "endpoint")), "endpoint eval cannot be audited"),
                       (("audit", recipe, "--engines", str(tmp_path)),
                        "run `trtspec build RECIPE` first"),
                       (("decide", str(tmp_path)), "not an eval folder")]:
        out = run(*args)
        assert out.returncode == 2, (args, out.stderr)
        assert text in out.stderr and "Traceback" not in out.stderr
