#!/usr/bin/env bash
# Download the wheels of bench/gpu/wheels.txt for the device machine's Python (CPython 3.12, x86-64 Linux) into
# bench/gpu/wheels/ (ignored by git), without their dependencies (the image has the rest), and check that they and
# the working tree that travels with them stay under the device tool's 64 MiB.
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHON="${PYTHON:-python3}"
rm -rf bench/gpu/wheels
mkdir -p bench/gpu/wheels
"$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d bench/gpu/wheels -r bench/gpu/wheels.txt
wheels_kib=$(du -sk bench/gpu/wheels | cut -f1)
# what travels besides: tracked files and untracked files git does not ignore
tree_kib=$(git ls-files -z -co --exclude-standard | du -ck --files0-from=- 2>/dev/null | tail -1 | cut -f1)
total_kib=$((wheels_kib + tree_kib))
ls -l bench/gpu/wheels
echo "wheels $((wheels_kib / 1024)) MiB + working tree $((tree_kib / 1024)) MiB = $((total_kib / 1024)) MiB of the 64 MiB that travel"
if [ "$total_kib" -ge $((64 * 1024)) ]; then
  echo "over the device tool's 64 MiB: drop a wheel from bench/gpu/wheels.txt" >&2
  exit 1
fi
