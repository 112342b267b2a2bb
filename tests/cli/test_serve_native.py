"""`trtspec serve --native`: trtllm-serve launched on a TensorRT-LLM build's options file,
against the stand-in executable on PATH (tests/serve/trtllm_serve_standin.py, NOT
TensorRT-LLM)."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest

from trtspec.cli import main

ROOT = Path(__file__).resolve().parents[2]


def _stop_when_healthy(events, sig: int) -> threading.Thread:
    """Send ``sig`` to this process (what Ctrl-C or a supervisor does) once `serve --native`
    saw the stand-in healthy: it polls /health, and the stand-in records each answer."""

    def go() -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if events("health"):
                time.sleep(1.0)  # serve --native prints the endpoint on that answer
                os.kill(os.getpid(), sig)
                return
            time.sleep(0.05)

    thread = threading.Thread(target=go, daemon=True)
    thread.start()
    return thread


def test_native_serves_the_built_options_with_the_schedule_and_forwards_sigterm(
        trtllm_build, trtllm_serve, monkeypatch, capsys) -> None:
    recipe, engines = trtllm_build()
    thread = _stop_when_healthy(trtllm_serve, signal.SIGTERM)
    main(["serve", str(recipe), "--engines", str(engines), "--native", "--port", "0",
          "--draft-len-schedule", "1:4,2:2", "--kv-cache-fraction", "0.5"])
    thread.join(5)
    printed = capsys.readouterr().out
    (started,) = trtllm_serve("start")
    argv = started["argv"]
    assert argv[0] == "toy/standin-target"
    assert argv[argv.index("--kv_cache_free_gpu_memory_fraction") + 1] == "0.5"
    options = started["options"]
    assert options["speculative_config"]["decoding_type"] == "NGram"  # build's file (ngram-d4)
    # 1.2.1's form: keys are the smallest batch size a D applies from
    assert options["speculative_config"]["draft_len_schedule"] == {"1": 4, "2": 2, "3": 0}
    assert f"http://127.0.0.1:{argv[argv.index('--port') + 1]}/v1" in printed
    assert [e["signal"] for e in trtllm_serve("signal")] == ["SIGTERM"]
    assert "stopped on SIGTERM" in printed
    written = Path(argv[argv.index("--config") + 1])
    assert written.parent == engines / "standin-ngram" / "h200" / "serve"
    assert written.name == "ngram-d4-policy.yaml"


def test_native_plain_decoding_serves_the_baseline_options(
        trtllm_build, trtllm_serve, capsys) -> None:
    recipe, engines = trtllm_build()
    thread = _stop_when_healthy(trtllm_serve, signal.SIGINT)
    main(["serve", str(recipe), "--engines", str(engines), "--native", "--port", "0",
          "--method", "none"])
    thread.join(5)
    (started,) = trtllm_serve("start")
    assert "speculative_config" not in started["options"]
    assert [e["signal"] for e in trtllm_serve("signal")] == ["SIGINT"]


@pytest.mark.parametrize("case", ["no executable", "torch recipe", "in-process flag"])
def test_native_refuses_in_one_line(case: str, trtllm_build, tmp_path: Path, monkeypatch,
                                    capsys) -> None:
    recipe, engines = trtllm_build()
    args = ["serve", str(recipe), "--engines", str(engines), "--native"]
    if case == "no executable":
        monkeypatch.setenv("PATH", str(tmp_path))
    elif case == "torch recipe":
        args[1] = str(ROOT / "recipes" / "cpu-smollm2.yaml")
    else:
        args += ["--slots", "4", "--prefill-stall", "2"]
    with pytest.raises(SystemExit) as e:
        main(args)
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and len(err.splitlines()) == 1
    said = {"no executable": ("trtllm-serve", "pip install 'trtspec[trtllm]'", "docs/gpu.md"),
            "torch recipe": ("the torch backend", "drop --native"),
            "in-process flag": ("--slots", "--prefill-stall", "drop them")}[case]
    assert all(s in err for s in said), err
