"""Launch TensorRT-LLM's ``trtllm-serve`` as a child process and hand back its endpoint.

trtspec never imports ``tensorrt_llm`` here: the OpenAI-compatible server of TensorRT-LLM is an
executable, so all a launch needs is ``trtllm-serve`` on PATH (``pip install
'trtspec[trtllm]'``). What it is started with (TensorRT-LLM 1.2.1's CLI,
``tensorrt_llm/commands/serve.py``):

    trtllm-serve MODEL --backend pytorch --tp_size N --pp_size N --max_batch_size N
        --max_num_tokens N --max_seq_len N [--kv_cache_free_gpu_memory_fraction F]
        --host H --port P [--tokenizer T] --config OPTIONS.yaml

``--config`` is the LLM API options YAML (``--extra_llm_api_options`` before 1.2; 1.2.1 takes
both); its keys override the flags. :class:`TrtllmServer` writes the options file it was given
(the one ``trtspec build`` wrote, with a policy's ``speculative_config`` fields merged in by
:func:`merged_options`), starts the process with its output to a log file, in a session of its
own (trtllm-serve starts MPI workers: a stop reaches the whole group), waits until ``GET
/health`` answers 200, and stops it with SIGTERM, then SIGKILL after a grace period. A server
that exits before it is healthy, or never gets healthy, is one line with its log's last lines.

Two servers fit side by side on one GPU when each takes part of the KV cache
(``kv_cache_fraction``: TensorRT-LLM's ``kv_cache_free_gpu_memory_fraction``, a fraction of the
memory free when that server starts, so the second server's share is of what the first left).
"""

from __future__ import annotations

import contextlib
import copy
import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

import yaml

EXECUTABLE = "trtllm-serve"
INSTALL = "pip install 'trtspec[trtllm]'"
DOCS = "docs/gpu.md"
OPTIONS_FLAG = "--config"  # TensorRT-LLM 1.2.1; --extra_llm_api_options before
HEALTH_TIMEOUT_S = 1800.0  # loading an 8B model and capturing its CUDA graphs takes minutes
GRACE_S = 30.0  # after SIGTERM, before SIGKILL
LOG_TAIL = 5


class LaunchError(RuntimeError):
    """A server that could not be started, exited early or never got healthy: one line."""


def find_executable(name: str = EXECUTABLE) -> str:
    """The path of ``trtllm-serve`` on PATH, or one line saying how to get it."""
    found = shutil.which(name)
    if found is None:
        raise LaunchError(f"{name} is not on PATH: install TensorRT-LLM ({INSTALL}, on a "
                          f"machine with an NVIDIA GPU; see {DOCS})")
    return found


def merged_options(options: Mapping[str, Any], speculative: Mapping[str, Any] | None = None,
                   **settings: Any) -> dict[str, Any]:
    """``options`` (an LLM API options file's content) with ``speculative``'s fields merged
    into its ``speculative_config`` (a policy's ``max_draft_len`` / ``max_concurrency`` /
    ``draft_len_schedule``) and top-level ``settings`` that are not None. A copy: the file
    ``trtspec build`` wrote is left as it was."""
    out = copy.deepcopy(dict(options))
    if speculative:
        if not isinstance(out.get("speculative_config"), dict):
            raise LaunchError("a draft-length schedule needs a speculative_config to merge "
                              "into: these options decode plainly")
        out["speculative_config"].update(copy.deepcopy(dict(speculative)))
    out.update({k: v for k, v in settings.items() if v is not None})
    return out


def read_options(path: str | Path) -> dict[str, Any]:
    """An LLM API options YAML as ``trtspec build`` wrote it (one line if it is not there)."""
    path = Path(path)
    if not path.is_file():
        raise LaunchError(f"{path}: no such options file (`trtspec build RECIPE` writes them "
                          "on the GPU machine)")
    try:
        loaded = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise LaunchError(f"{path}: not valid YAML ({str(e).splitlines()[0]})") from None
    if not isinstance(loaded, dict):
        raise LaunchError(f"{path}: an options file is a mapping of LLM API options")
    return loaded


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now (trtllm-serve needs an explicit one)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


@dataclass
class ServerSpec:
    """What one trtllm-serve runs: the model, its options (written to ``<name>.yaml``) and the
    flags. ``name`` names the options file and the log (``baseline``, ``ngram-d4`` …)."""

    name: str
    model: str
    options: dict[str, Any]
    backend: str = "pytorch"  # tensorrt: an engine directory (the engine workflow)
    tp_size: int = 1
    pp_size: int = 1
    max_batch_size: int | None = None
    max_num_tokens: int | None = None
    max_seq_len: int | None = None
    kv_cache_fraction: float | None = None
    tokenizer: str | None = None
    host: str = "127.0.0.1"
    port: int = 0  # 0: a free port
    extra_argv: tuple[str, ...] = field(default_factory=tuple)

    def argv(self, executable: str, options_path: Path) -> list[str]:
        """The command line (the options file last: its keys override the flags)."""
        argv = [executable, self.model, "--backend", self.backend,
                "--tp_size", str(self.tp_size), "--pp_size", str(self.pp_size)]
        for flag, value in (("--max_batch_size", self.max_batch_size),
                            ("--max_num_tokens", self.max_num_tokens),
                            ("--max_seq_len", self.max_seq_len),
                            ("--kv_cache_free_gpu_memory_fraction", self.kv_cache_fraction),
                            ("--tokenizer", self.tokenizer)):
            if value is not None:
                argv += [flag, str(value)]
        argv += ["--host", self.host, "--port", str(self.port), *self.extra_argv,
                 OPTIONS_FLAG, str(options_path)]
        return argv


class TrtllmServer:
    """One trtllm-serve child: ``with TrtllmServer(spec, folder) as server: server.url``.

    ``folder`` receives ``<name>.yaml`` (the options file used) and ``<name>.log`` (its
    output). Entering starts it and waits for /health (``health_timeout`` seconds); leaving
    stops it (SIGTERM to its process group, SIGKILL after ``grace`` seconds)."""

    def __init__(self, spec: ServerSpec, folder: str | Path, executable: str | None = None,
                 health_timeout: float = HEALTH_TIMEOUT_S, grace: float = GRACE_S) -> None:
        self.spec, self.folder = spec, Path(folder)
        self.executable = executable or find_executable()
        self.health_timeout, self.grace = health_timeout, grace
        self.process: subprocess.Popen[bytes] | None = None
        self.options_path = self.folder / f"{spec.name}.yaml"
        self.log_path = self.folder / f"{spec.name}.log"
        if spec.port == 0:
            spec.port = free_port(spec.host if spec.host not in ("0.0.0.0", "::") else
                                  "127.0.0.1")

    @property
    def root(self) -> str:
        """http://host:port, where a client reaches it (0.0.0.0 is reached at 127.0.0.1)."""
        host = "127.0.0.1" if self.spec.host in ("0.0.0.0", "::", "") else self.spec.host
        return f"http://{host}:{self.spec.port}"

    @property
    def url(self) -> str:
        """The OpenAI base URL (…/v1)."""
        return f"{self.root}/v1"

    @property
    def argv(self) -> list[str]:
        return self.spec.argv(self.executable, self.options_path)

    def start(self) -> TrtllmServer:
        """Write the options file, start the process, wait for /health."""
        self.folder.mkdir(parents=True, exist_ok=True)
        self.options_path.write_text(yaml.safe_dump(self.spec.options, sort_keys=False))
        with self.log_path.open("wb") as log:
            try:
                self.process = subprocess.Popen(self.argv, stdout=log,
                                                stderr=subprocess.STDOUT,
                                                stdin=subprocess.DEVNULL,
                                                start_new_session=True)
            except OSError as e:
                raise LaunchError(f"{self.executable}: cannot start it ({e.strerror or e})"
                                  ) from None
        try:
            self.wait_healthy()
        except BaseException:
            self.stop()
            raise
        return self

    def wait_healthy(self) -> None:
        """Until GET /health answers 200; one line when the process exits first or the
        timeout passes."""
        assert self.process is not None
        deadline = time.monotonic() + self.health_timeout
        pause = 0.05
        while True:
            code = self.process.poll()
            if code is not None:
                raise LaunchError(f"{EXECUTABLE} ({self.spec.name}) exited with code {code} "
                                  f"before it was healthy; {self.log_path}: {self.log_tail()}")
            if self.healthy():
                return
            if time.monotonic() > deadline:
                raise LaunchError(f"{EXECUTABLE} ({self.spec.name}) was not healthy at "
                                  f"{self.root}/health after {self.health_timeout:g} s; "
                                  f"{self.log_path}: {self.log_tail()}")
            time.sleep(pause)
            pause = min(pause * 2, 1.0)

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.root}/health", timeout=2) as r:
                return bool(r.status == 200)
        except (OSError, ValueError):  # refused, 503 while loading, timeout
            return False

    def log_tail(self, lines: int = LOG_TAIL) -> str:
        """The log's last lines, joined into one."""
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"
        tail = [line.strip() for line in text.strip().splitlines()[-lines:] if line.strip()]
        return " | ".join(tail) or "(empty log)"

    def send(self, sig: int) -> None:
        """``sig`` to the server's process group: it and the workers it started, which may
        outlive it (MPI ranks holding GPU memory) after it exited or crashed."""
        if self.process is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, sig)

    def stop(self) -> int | None:
        """SIGTERM to the group, then SIGKILL to whatever of it is left after the grace
        period; the server's exit code (None: never started)."""
        if self.process is None:
            return None
        self.send(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=self.grace)
        self.send(signal.SIGKILL)  # workers that outlived the leader, or the leader itself
        self.process.wait()
        return self.process.returncode

    def wait(self) -> int:
        """Block until the server exits (signals sent meanwhile are forwarded by
        :func:`forwarding`); its exit code."""
        assert self.process is not None
        return self.process.wait()

    def __enter__(self) -> TrtllmServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


@contextlib.contextmanager
def forwarding(servers: Sequence[TrtllmServer],
               signals: Sequence[int] = (signal.SIGINT, signal.SIGTERM)) -> Iterator[list[int]]:
    """While inside, SIGINT and SIGTERM go to the servers (their process groups) instead of
    stopping this process, and a second one kills them; yields the signals received, in
    order. The handlers before are put back on leaving."""
    received: list[int] = []

    def forward(sig: int, _frame: FrameType | None) -> None:
        received.append(sig)
        for server in servers:  # a second signal: a server deaf to the first (loading) is
            server.send(sig if len(received) == 1 else signal.SIGKILL)  # killed, no hang

    before = {sig: signal.signal(sig, forward) for sig in signals}
    try:
        yield received
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


def same_scheduler(baseline: Mapping[str, Any], spec: Mapping[str, Any],
                   keys: Sequence[str] = ("disable_overlap_scheduler",)) -> dict[str, Any]:
    """The baseline's options with the speculative arm's scheduler settings (both arms run
    the same scheduler: TensorRT-LLM's two-model speculation turns the overlap scheduler off,
    which alone changes step times)."""
    out = copy.deepcopy(dict(baseline))
    for key in keys:
        if key in spec:
            out[key] = spec[key]
    return out
