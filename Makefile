# Two commands do all the set-up on a fresh machine (README.md):
#   make quickstart   -> venv, CPU torch, lightalign, then the offline quickstart run
#   make test         -> venv, CPU torch, lightalign[dev] at the versions of constraints.txt, then the test suite
#   make test-latest  -> a separate venv (.venv-latest) on the newest releases (torch stays 2.13.0, the CPU wheel),
#                        then the same suite; `make lock` then writes those versions into constraints.txt
#   make test-portable -> the same suite twice more: with AVX2 kernels (ATEN_CPU_CAPABILITY=avx2,
#                        ONEDNN_MAX_CPU_ISA=AVX2) and with 2 threads per worker (the suite's workers use 1 otherwise)
#   make gpu-wheels   -> the wheels bench/gpu/run.sh carries to a GPU machine without a package index (docs/gpu.md)
#   make bench        -> a separate venv (.venv-bench: CPU torch, lightalign[bench] = TRL + matplotlib), then the
#                        benchmark suite (bench/suite.py; BENCH_ARGS="--quick --models tiny" for a smoke run)
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# TRL is benchmark-only: it never enters the dev/runtime venv.
BENCH_VENV ?= .venv-bench
BENCH_BIN := $(BENCH_VENV)/bin
BENCH_ARGS ?=
# Where pip finds torch. Empty: pip's own configuration (PyPI's torch==2.13.0 is the CUDA build, several GB); on a
# machine that reaches only PyPI and download.pytorch.org, TORCH_INDEX=https://download.pytorch.org/whl/cpu gives
# the CPU build (2.13.0+cpu, which pip prefers to PyPI's 2.13.0). The wheel test of the suite (tests/packaging/) installs torch the same way.
TORCH_INDEX ?=
TORCH_PIP_ARGS := $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX),)
export TORCH_INDEX
export HF_HUB_OFFLINE := 1
export HF_DATASETS_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: install quickstart test test-portable test-latest lock bench gpu-wheels

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# The CPU wheel of torch first: a bare `torch` requirement would pull a multi-GB CUDA build.
# constraints.txt: the exact versions of the last green run, so a fresh clone tests what was tested.
# pip byte-compiles what it installs on one core (~80 s of a fresh install here); compileall on every core does the
# same work (test folders left out: they are never imported and one of torch's is Python 3.12 syntax).
$(VENV)/.installed: pyproject.toml constraints.txt | $(BIN)/python
	$(BIN)/python -m pip install -q --no-compile torch==2.13.0 $(TORCH_PIP_ARGS) -c constraints.txt
	$(BIN)/python -m pip install -q --no-compile -c constraints.txt -e '.[dev]'
	$(BIN)/python -m compileall -q -j 0 -x '/(tests?|testing)/' \
		"$$($(BIN)/python -c 'import sysconfig; print(sysconfig.get_path("purelib"))')" > /dev/null
	touch $@

install: $(VENV)/.installed

quickstart: install
	$(BIN)/lightalign fit --config configs/quickstart.yaml

test: install
	$(BIN)/pytest -q -n 2

# Float results differ with the CPU's kernels and the thread count; the suite must not care. Not part of CI (each
# pass costs as long as `make test`).
test-portable: install
	ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 $(BIN)/pytest -q -n 2 -p no:cacheprovider
	OMP_NUM_THREADS=2 $(BIN)/pytest -q -n 2 -p no:cacheprovider

LATEST_VENV ?= .venv-latest
LATEST_BIN := $(LATEST_VENV)/bin

# The suite on the newest releases of every dependency (torch stays the CPU wheel 2.13.0: a newer one is a CUDA build).
test-latest:
	rm -rf $(LATEST_VENV)
	$(PYTHON) -m venv $(LATEST_VENV)
	$(LATEST_BIN)/python -m pip install -q torch==2.13.0 $(TORCH_PIP_ARGS)
	$(LATEST_BIN)/python -m pip install -q --upgrade -e '.[dev]'
	@echo 'versions that differ from constraints.txt (< newest, > locked):'
	$(LATEST_BIN)/python -m pip freeze --exclude-editable | diff - constraints.txt | grep -v -e '^[<>] #' -e 'torch==' | grep '^[<>]' || true
	$(LATEST_BIN)/pytest -q -n 2 -p no:cacheprovider

# After a green `make test-latest`: its versions become the lock (commit it with the run's result).
lock:
	{ sed -n '1,2p' constraints.txt; $(LATEST_BIN)/python -m pip freeze --exclude-editable | grep -v -e '^torch==' -e '^lightalign' -e '^#'; \
	  echo 'torch==2.13.0'; } > constraints.txt.new && mv constraints.txt.new constraints.txt

$(BENCH_BIN)/python:
	$(PYTHON) -m venv $(BENCH_VENV)

$(BENCH_VENV)/.installed: pyproject.toml | $(BENCH_BIN)/python
	$(BENCH_BIN)/python -m pip install -q torch==2.13.0 $(TORCH_PIP_ARGS)
	$(BENCH_BIN)/python -m pip install -q -e '.[bench]'
	touch $@

bench: $(BENCH_VENV)/.installed
	$(BENCH_BIN)/python bench/suite.py $(BENCH_ARGS)

# The pure-Python wheels of bench/gpu/wheels.txt for the device machine's Python 3.12, into bench/gpu/wheels/ (ignored),
# checked to fit the device tool's 64 MiB with the working tree (docs/gpu.md).
gpu-wheels: | $(BIN)/python
	PYTHON=$(BIN)/python bash bench/gpu/fetch_wheels.sh
