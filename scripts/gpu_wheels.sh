#!/usr/bin/env bash
# Fill .gpu_wheels/ (or $1) with what scripts/gpu_check.sh installs on a GPU machine that has
# Python 3.12, torch and transformers but no network: megatron-core (pinned as in pyproject),
# einops and dill (imported by megatron-core), Pillow (the processors). About 10 MB.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-.gpu_wheels}
PYVER=${GPU_PYTHON_VERSION:-3.12}
python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version "$PYVER" --implementation cp \
  --abi "cp${PYVER/./}" --platform manylinux_2_28_x86_64 -d "$OUT" \
  megatron-core==0.16.1 einops dill pillow
ls -la "$OUT"
