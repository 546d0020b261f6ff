# Two commands do all the set-up on a fresh machine (README.md):
#   make quickstart   -> venv, CPU torch, lightalign, then the offline quickstart run
#   make test         -> venv, CPU torch, lightalign[dev], then the test suite
#   make bench        -> a separate venv (.venv-bench: CPU torch, lightalign[bench] = TRL + matplotlib), then the
#                        benchmark suite (bench/suite.py; BENCH_ARGS="--quick --models tiny" for a smoke run)
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# TRL is benchmark-only: it never enters the dev/runtime venv.
BENCH_VENV ?= .venv-bench
BENCH_BIN := $(BENCH_VENV)/bin
BENCH_ARGS ?=
export HF_HUB_OFFLINE := 1
export HF_DATASETS_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: install quickstart test bench

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# The CPU wheel of torch first: a bare `torch` requirement would pull a multi-GB CUDA build.
$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $@

install: $(VENV)/.installed

quickstart: install
	$(BIN)/lightalign fit --config configs/quickstart.yaml

test: install
	$(BIN)/pytest -q -n 2

$(BENCH_BIN)/python:
	$(PYTHON) -m venv $(BENCH_VENV)

$(BENCH_VENV)/.installed: pyproject.toml | $(BENCH_BIN)/python
	$(BENCH_BIN)/python -m pip install -q torch==2.13.0
	$(BENCH_BIN)/python -m pip install -q -e '.[bench]'
	touch $@

bench: $(BENCH_VENV)/.installed
	$(BENCH_BIN)/python bench/suite.py $(BENCH_ARGS)
