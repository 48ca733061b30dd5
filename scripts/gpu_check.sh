#!/usr/bin/env bash
# The GPU path checked and measured in one command (scripts/gpu_check.py; under 8 minutes on one
# H200). Prints progress, then one JSON line with every figure; exit 0 when every check passed.
#
#   scripts/gpu_check.sh          on a GPU machine with Python, torch (CUDA) and transformers and
#                                 no network: what it lacks (megatron-core, einops, dill, Pillow)
#                                 is installed from the wheel folder $YATT_MM_GPU_WHEELS (default
#                                 .gpu_wheels/, filled by scripts/gpu_wheels.sh where PyPI is
#                                 reachable; kept out of git) into .gpu_site/, nothing else touched
#   scripts/gpu_check.sh --cpu    the same script on this machine's CPU, in the project's venv
#                                 (the CUDA-only figures come out null); the test suite runs it
# Extra arguments go to gpu_check.py (--help).
set -euo pipefail
cd "$(dirname "$0")/.."

if [[ " $* " == *" --cpu "* ]]; then
  PY=${PYTHON:-.venv/bin/python}
  [[ -x $PY ]] || PY=python3
  exec "$PY" scripts/gpu_check.py "$@"
fi

PY=${PYTHON:-python3}
WHEELS=${YATT_MM_GPU_WHEELS:-.gpu_wheels}
SITE=.gpu_site
export PYTHONPATH="$PWD/$SITE${PYTHONPATH:+:$PYTHONPATH}"
missing=()
for pair in megatron.core:megatron-core einops:einops dill:dill PIL:pillow; do
  "$PY" -c "import ${pair%%:*}" 2>/dev/null || missing+=("${pair##*:}")
done
if ((${#missing[@]})); then
  if [[ ! -d $WHEELS ]]; then
    echo "gpu_check: missing ${missing[*]} and no wheel folder $WHEELS: run scripts/gpu_wheels.sh where PyPI is reachable and bring the folder along" >&2
    exit 2
  fi
  echo "gpu_check: installing ${missing[*]} from $WHEELS into $SITE"
  "$PY" -m pip install --quiet --no-index --no-deps --find-links "$WHEELS" --target "$SITE" "${missing[@]}"
fi
exec timeout 480 "$PY" scripts/gpu_check.py "$@"
