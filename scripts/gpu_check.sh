#!/usr/bin/env bash
# The GPU path checked and measured in one command: scripts/gpu_check.py runs the stages of
# scripts/gpu_stages/ (comm, build, parity, rl, memory, offload, checkpoint, lora, qwen3vl, qwen3vl_moe, qwen35,
# qwen35_moe, speed). As each stage ends, its figures or its error go to $OUT/gpu_check.json (the
# whole file, rewritten atomically); everything printed also goes to $OUT/gpu_check.log; OUT
# defaults to runs/gpu_check/ (git-ignored). The last line printed is the report as one JSON
# object. Exit 0 when every stage ran and passed its checks, 1 when one did not, 2 when something
# is missing, 124 when stopped by the time limit (the stages done by then are in the JSON file).
#
#   scripts/gpu_check.sh [--only STAGE,...] [--layers N]   on one GPU of a machine with Python,
#                         torch (CUDA) and transformers: in the project's venv where there is one,
#                         else the machine's python3; what it lacks (megatron-core, einops, Pillow)
#                         is installed from the wheel folder $YATT_MM_GPU_WHEELS (default
#                         .gpu_wheels/) into .gpu_site/, nothing else touched. It stops itself after
#                         GPU_CHECK_LIMIT_S seconds (default 420: SIGTERM, which records the running
#                         stage as stopped; SIGKILL 15 s later if it hangs)
#   scripts/gpu_check.sh --cpu    the same script on a CPU at small sizes, in the project's venv
#                         (CUDA-only figures say "skipped: no CUDA"); the test suite runs it
#
# A GPU machine without network: run scripts/gpu_wheels.sh where PyPI is reachable (it fills
# .gpu_wheels/, about 3 MB), copy the repo with that folder to the machine, run this script there.
# A stage that failed reruns alone with --only STAGE (the stages it needs run with it).
# Extra arguments go to gpu_check.py (--help).
set -euo pipefail
cd "$(dirname "$0")/.."

export OUT=${OUT:-$PWD/runs/gpu_check}
mkdir -p "$OUT"
LOG=$OUT/gpu_check.log
: >"$LOG"
# everything printed, stdout and stderr alike (NCCL's and CUDA's own lines too), also to the log
exec > >(tee -a "$LOG") 2> >(tee -a "$LOG" >&2)
export PYTHONUNBUFFERED=1
export HF_HUB_OFFLINE=1  # every model is a local directory; a hub call could only wait for a timeout there

PY=${PYTHON:-.venv/bin/python}  # the project's venv where there is one
[[ -x $PY ]] || PY=python3
if [[ " $* " == *" --cpu "* ]]; then
  exec "$PY" scripts/gpu_check.py "$@"
fi

WHEELS=${YATT_MM_GPU_WHEELS:-.gpu_wheels}
SITE=.gpu_site
export PYTHONPATH="$PWD/$SITE${PYTHONPATH:+:$PYTHONPATH}"
missing=()
for pair in megatron.core:megatron-core einops:einops PIL:pillow; do
  "$PY" -c "import ${pair%%:*}" 2>/dev/null || missing+=("${pair##*:}")
done
if ((${#missing[@]})); then
  if [[ ! -d $WHEELS ]]; then
    echo "gpu_check: missing ${missing[*]} and no wheel folder $WHEELS: run scripts/gpu_wheels.sh where PyPI is reachable and copy the folder here" >&2
    exit 2
  fi
  echo "gpu_check: installing ${missing[*]} from $WHEELS into $SITE"
  "$PY" -m pip install --quiet --no-index --no-deps --find-links "$WHEELS" --target "$SITE" "${missing[@]}"
fi
# fla (flash-linear-attention: Qwen3.5's DeltaNet kernels, the gpu extra's), where its wheels are
# in the folder: the qwen35 stages then run its Triton kernels, else Megatron's pure-torch rule
if ! "$PY" -c "import fla" 2>/dev/null && compgen -G "$WHEELS/flash_linear_attention-*.whl" >/dev/null; then
  echo "gpu_check: installing flash-linear-attention from $WHEELS into $SITE"
  "$PY" -m pip install --quiet --no-index --no-deps --find-links "$WHEELS" --target "$SITE" flash-linear-attention fla-core
fi
exec timeout --kill-after=15 "${GPU_CHECK_LIMIT_S:-420}" "$PY" scripts/gpu_check.py "$@"
