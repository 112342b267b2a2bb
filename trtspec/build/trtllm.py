"""Runs engine-workflow steps as subprocesses, one log per step. The only place (with
runtime/trtllm.py) that touches TensorRT-LLM, behind a guarded import."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

from trtspec.build.plan import Plan

try:  # guarded: TensorRT-LLM needs Linux + an NVIDIA GPU + CUDA; plans work without it
    import tensorrt_llm
except Exception:  # ImportError, or a broken CUDA install raising at import
    tensorrt_llm = None


class BuildRefused(RuntimeError):
    """This machine cannot run the plan; the message says why and what would run."""


def execute(plan: Plan, has_gpu: bool) -> list[str]:
    """Run the plan's steps in order; returns the commands run. Fails with the step's log tail."""
    if tensorrt_llm is None or not has_gpu:
        why = ("TensorRT-LLM is not importable here (on a Linux machine with an NVIDIA GPU: "
               "pip install 'trtspec[trtllm]', see docs/gpu.md)" if tensorrt_llm is None
               else "no NVIDIA GPU here")
        raise BuildRefused(f"cannot build for TensorRT-LLM: {why}. `trtspec build --dry-run` "
                           "prints the plan to run on the GPU machine")
    if plan.workflow == "engine" and not os.environ.get("TRTLLM_EXAMPLES"):
        raise BuildRefused("set TRTLLM_EXAMPLES to TensorRT-LLM's examples/ directory "
                           "(convert_checkpoint.py scripts live there)")
    logs = plan.out_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    commands = []
    for i, step in enumerate(plan.steps, 1):
        if step.kind == "write":
            Path(step.path).parent.mkdir(parents=True, exist_ok=True)
            Path(step.path).write_text(step.content)
            continue
        if step.kind != "run":
            continue
        argv = [os.path.expandvars(a) for a in step.argv]
        log = logs / f"{i:02d}-{re.sub(r'[^A-Za-z0-9]+', '-', step.name).strip('-')}.log"
        commands.append(step.shell())
        with log.open("w") as f:
            proc = subprocess.run(argv, stdout=f, stderr=subprocess.STDOUT, check=False)
        if proc.returncode:
            tail = " | ".join(log.read_text().strip().splitlines()[-3:])
            raise RuntimeError(f"step {i} ({step.name}) failed with exit code {proc.returncode}; "
                               f"log {log}: {tail}")
    return commands
