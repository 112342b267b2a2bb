"""The trtllm-serve launcher against the stand-in executable on PATH (tests/serve/
trtllm_serve_standin.py, NOT TensorRT-LLM): flags, options file, schedule, health, signals."""

from __future__ import annotations

import json
import os
import signal
import urllib.request
from pathlib import Path

import pytest
import yaml

from trtspec.serve.launch import (
    LaunchError,
    ServerSpec,
    TrtllmServer,
    find_executable,
    forwarding,
    merged_options,
    same_scheduler,
)

SPEC = {"max_batch_size": 4, "max_num_tokens": 8192, "max_seq_len": 1024,
        "speculative_config": {"decoding_type": "NGram", "max_draft_len": 4,
                               "max_matching_ngram_size": 3}}


def spec(name: str = "ngram-d4", options: dict | None = None, **kw) -> ServerSpec:
    return ServerSpec(name=name, model="toy/target", options=options or SPEC, tp_size=1,
                      pp_size=1, max_batch_size=4, max_num_tokens=8192, max_seq_len=1024, **kw)


def test_the_server_gets_1_2_1_flags_and_the_options_file_with_the_schedule_merged_in(
        trtllm_serve, tmp_path: Path) -> None:
    schedule = {"max_draft_len": 4, "draft_len_schedule": {1: 4, 3: 0}}
    options = merged_options(SPEC, schedule)
    assert SPEC["speculative_config"].get("draft_len_schedule") is None  # a copy
    with TrtllmServer(spec("ngram-d4-policy", options, kv_cache_fraction=0.4),
                      tmp_path / "servers") as server:
        with urllib.request.urlopen(f"{server.url}/models", timeout=5) as r:
            assert json.loads(r.read())["data"][0]["id"] == "toy/target"
        argv = server.argv
    started = trtllm_serve("start")
    assert len(started) == 1 and started[0]["argv"] == argv[1:]
    assert argv[0] == find_executable()
    flags = dict(zip(argv[2::2], argv[3::2], strict=True))
    assert argv[1] == "toy/target"
    assert flags == {"--backend": "pytorch", "--tp_size": "1", "--pp_size": "1",
                     "--max_batch_size": "4", "--max_num_tokens": "8192",
                     "--max_seq_len": "1024", "--kv_cache_free_gpu_memory_fraction": "0.4",
                     "--host": "127.0.0.1", "--port": str(server.spec.port),
                     "--config": str(tmp_path / "servers" / "ngram-d4-policy.yaml")}
    written = yaml.safe_load((tmp_path / "servers" / "ngram-d4-policy.yaml").read_text())
    assert json.loads(json.dumps(written)) == started[0]["options"]  # what the server read
    assert written["speculative_config"] == {**SPEC["speculative_config"], **schedule}  # int keys
    assert [e["signal"] for e in trtllm_serve("signal")] == ["SIGTERM"]  # stopped
    assert trtllm_serve("exit")
    assert server.process is not None and server.process.returncode == 0
    assert "not TensorRT-LLM" in server.log_path.read_text()  # its output went to the log


def test_a_schedule_needs_a_speculative_config_and_the_baseline_gets_the_spec_scheduler() -> None:
    with pytest.raises(LaunchError, match="speculative_config"):
        merged_options({"max_batch_size": 4}, {"max_concurrency": 2})
    two_model = {**SPEC, "disable_overlap_scheduler": True}
    assert same_scheduler({"max_batch_size": 4}, two_model) == {
        "max_batch_size": 4, "disable_overlap_scheduler": True}
    assert same_scheduler({"max_batch_size": 4}, SPEC) == {"max_batch_size": 4}


def test_a_server_that_exits_before_it_is_healthy_is_one_line_with_its_log(
        trtllm_serve, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("TRTLLM_STANDIN_EXIT", "3")
    with pytest.raises(LaunchError) as e:
        TrtllmServer(spec(), tmp_path).start()
    text = str(e.value)
    assert "\n" not in text and "exited with code 3 before it was healthy" in text
    assert "the stand-in was told to exit" in text and str(tmp_path / "ngram-d4.log") in text


def test_a_server_never_healthy_times_out_and_is_stopped(tmp_path: Path) -> None:
    exe = tmp_path / "never-healthy"
    exe.write_text("#!/bin/sh\necho loading forever\nexec sleep 60\n")
    exe.chmod(0o755)
    server = TrtllmServer(spec(), tmp_path, executable=str(exe), health_timeout=0.5, grace=2)
    with pytest.raises(LaunchError, match=r"was not healthy at .* after 0.5 s.*loading forever"):
        server.start()
    assert server.process is not None and server.process.poll() is not None  # stopped


def test_a_server_ignoring_sigterm_is_killed_after_the_grace_period(
        trtllm_serve, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("TRTLLM_STANDIN_IGNORE_TERM", "1")
    server = TrtllmServer(spec(), tmp_path, grace=0.5).start()
    assert server.stop() == -signal.SIGKILL
    assert [e["signal"] for e in trtllm_serve("signal")] == ["SIGTERM"]
    assert not trtllm_serve("exit")


def test_sigint_and_sigterm_are_forwarded_to_the_server(trtllm_serve, tmp_path: Path) -> None:
    before = signal.getsignal(signal.SIGINT)
    server = TrtllmServer(spec(), tmp_path).start()
    try:
        with forwarding([server]) as received:
            os.kill(os.getpid(), signal.SIGINT)  # what Ctrl-C sends to this process
            assert server.wait() == 0
    finally:
        server.stop()
    assert received == [signal.SIGINT]
    assert [e["signal"] for e in trtllm_serve("signal")] == ["SIGINT"]
    assert signal.getsignal(signal.SIGINT) is before  # put back


def test_without_the_executable_one_line_names_it_the_extra_and_the_docs(
        tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(LaunchError) as e:
        find_executable()
    text = str(e.value)
    assert "trtllm-serve" in text and "pip install 'trtspec[trtllm]'" in text
    assert "docs/gpu.md" in text and "\n" not in text
