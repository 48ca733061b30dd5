#!/usr/bin/env bash
# Fill .gpu_wheels/ (or $1) with what scripts/gpu_check.sh installs on a GPU machine that has
# Python 3.12, torch, transformers, einops and Pillow but no network: megatron-core (pinned as in
# pyproject; it imports einops, the one package of its own it needs besides torch, numpy and
# packaging), einops as a fallback, and fla (flash-linear-attention, Qwen3.5's DeltaNet kernels, as
# the gpu extra pins it). About 4.5 MB: copy it to the GPU machine with the repo.
# GPU_PYTHON_VERSION picks the wheels' Python (default 3.12); the script fails if the folder
# outgrows GPU_WHEELS_MAX_MB (default 48), which would mean it fetched far more than these two.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-.gpu_wheels}
PYVER=${GPU_PYTHON_VERSION:-3.12}
python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version "$PYVER" --implementation cp \
  --abi "cp${PYVER/./}" --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d "$OUT" \
  megatron-core==0.16.1 einops flash-linear-attention==0.6.0 fla-core==0.6.0
ls -la "$OUT"
size_mb=$(du -sm "$OUT" | cut -f1)
echo "$OUT: ${size_mb} MB"
if ((size_mb > ${GPU_WHEELS_MAX_MB:-48})); then
  echo "gpu_wheels: $OUT is ${size_mb} MB, over GPU_WHEELS_MAX_MB=${GPU_WHEELS_MAX_MB:-48}: the call carries 64 MiB in all" >&2
  exit 1
fi
