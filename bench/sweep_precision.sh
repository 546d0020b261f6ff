#!/bin/sh
# The precision sweep of issue #52 (item 2): every method (SFT, DPO, GRPO, KTO, RLOO, online DPO, distillation),
# lightalign vs TRL, fp32 and bf16 on both sides (lightalign bf16-mixed / 32-true, TRL bf16=True / False, the rest
# identical), on the `small` model and the held-out `uniform` data shape (bench/data.py; every tuning run of
# docs/performance.md used `longtail` or the shipped data), 2 repeats alternating, one thread pinned to one core that
# nothing else uses (the suite's --sweep preset does not wait for a quiet machine). Per method: every variant's
# figure, efficiency against its own dtype's matmul peak, peak RSS and PSS, the pairs at the same precision and best
# vs best. Results: bench/results/suite_precision.json (+ .png), the log: bench/results/suite_precision.log.
#
#   sh bench/sweep_precision.sh             # core 1, the bench venv .venv-bench
#   CORE=0 PYTHON=python sh bench/sweep_precision.sh
set -e
cd "$(dirname "$0")/.."
CORE=${CORE:-1}
PYTHON=${PYTHON:-.venv-bench/bin/python}
mkdir -p bench/results
taskset -c "$CORE" "$PYTHON" bench/suite.py --sweep --threads 1 --precisions fp32 bf16 "$@" \
    2>&1 | tee bench/results/suite_precision.log
