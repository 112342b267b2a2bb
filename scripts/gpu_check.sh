#!/usr/bin/env bash
# The one prepared device check, for a lent GPU machine (≤ 10 minutes, no internet, python3 with
# CUDA torch, TensorRT-LLM perhaps): makes or reuses .venv-gpu (it sees python3's packages),
# installs trtspec from this checkout as `make install` does and goes on when an install fails,
# then runs the GPU tests, the torch backend on CUDA (SmolLM2's acceptance; t(T) on random
# weights of Llama-3.1-8B's shape), the verify benchmark on CUDA and, when it imports,
# TensorRT-LLM's checks; each part under a time limit. Ends with a table (stdout and
# reports/gpu-check.md; every part's output in reports/gpu-check.log). Without a GPU every GPU
# part is skipped, says why, and the exit code is 0. Options: scripts/gpu_check.py --help
# (e.g. --report "$OUT/gpu-check.md" to keep the report elsewhere, --no-install).
set -euo pipefail
cd "$(dirname "$0")/.."
exec "${PYTHON:-python3}" scripts/gpu_check.py "$@"
