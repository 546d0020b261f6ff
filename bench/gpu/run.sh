#!/usr/bin/env bash
# The GPU check on the device machine: the carried wheels (bench/gpu/wheels/, from `make gpu-wheels`) installed into
# a private folder ahead of the image's own packages, then bench/gpu/run_check.py with its results and its log under
# $OUT (the device tool brings that folder back). Arguments go to run_check.py (--dry-run, --sections ...).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT="${OUT:-bench/results/gpu}"
mkdir -p "$OUT"
SITE="${GPU_CHECK_SITE:-/tmp/lightalign-gpu-site}"
if compgen -G "bench/gpu/wheels/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
    bench/gpu/wheels/*.whl || { echo "installing the carried wheels failed" >&2; exit 3; }
  export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
else
  echo "bench/gpu/wheels/ holds no wheels (make gpu-wheels; carry bench/gpu/wheels): the image's own packages run" >&2
fi
export PYTHONUNBUFFERED=1
python3 bench/gpu/run_check.py --out "$OUT" "$@" 2>&1 | tee "$OUT/gpu_check.log"
exit "${PIPESTATUS[0]}"
