#!/usr/bin/env bash
# The GPU path checked and measured in one command: scripts/gpu_check.py, whose docstring lists
# the stages (comm, build, parity, rl, memory, offload, qwen3vl, qwen3vl_moe, qwen35, qwen35_moe,
# speed). As each
# stage ends, its figures or its error go to $OUT/gpu_check.json (the whole file, rewritten
# atomically); everything printed also goes to $OUT/gpu_check.log; OUT defaults to
# runs/gpu_check/ (git-ignored). The last line printed is the report as one JSON object. Exit 0
# when every stage ran and passed its checks, 1 when one did not, 2 when something is missing,
# 124 when stopped by the time limit (the stages done by then are in the JSON file).
#
#   scripts/gpu_check.sh [--only STAGE,...]   on a GPU machine with Python, torch (CUDA) and
#                         transformers and no network: what it lacks (megatron-core, einops,
#                         Pillow) is installed from the wheel folder $YATT_MM_GPU_WHEELS (default
#                         .gpu_wheels/) into .gpu_site/, nothing else touched; the check stops
#                         itself after GPU_CHECK_LIMIT_S seconds (default 420: SIGTERM, which
#                         records the running stage as stopped; SIGKILL 15 s later if it hangs)
#   scripts/gpu_check.sh --cpu    the same script on this machine's CPU at small sizes, in the
#                         project's venv (CUDA-only figures say "skipped: no CUDA"); CI runs it
#
# Exact steps on the lent GPU machine (the `device` tool's `run`: one H200 with Python 3.12,
# torch and transformers but no megatron-core and no network; 15 minutes of device time in all,
# the machine's start (1-2 min) included; one command at most 10 minutes; only files under
# $OUT come back):
#   1. Here, where PyPI is reachable:  scripts/gpu_wheels.sh
#      It fills .gpu_wheels/ (git-ignored) with megatron-core 0.16.1's cp312 wheel and einops,
#      about 3 MB: with the working tree (~2 MB) far inside the 64 MiB a call carries.
#   2. One call:  run(command="scripts/gpu_check.sh", carry=[".gpu_wheels"], timeout_s=480)
#      The script's own limit (420 s + 15 s to kill) fires before the call's 480 s, so the
#      report is always written and returned: $OUT/gpu_check.json and $OUT/gpu_check.log.
#   3. If a stage failed, rerun just it on the still-warm machine (warm for 30 s after a call):
#      run(command="scripts/gpu_check.sh --only STAGE", carry=[".gpu_wheels"], timeout_s=480)
#      (the stages it needs run with it). Then give_back.
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
for pair in megatron.core:megatron-core einops:einops PIL:pillow; do
  "$PY" -c "import ${pair%%:*}" 2>/dev/null || missing+=("${pair##*:}")
done
if ((${#missing[@]})); then
  if [[ ! -d $WHEELS ]]; then
    echo "gpu_check: missing ${missing[*]} and no wheel folder $WHEELS: run scripts/gpu_wheels.sh where PyPI is reachable and carry the folder along (carry=[\"$WHEELS\"])" >&2
    exit 2
  fi
  echo "gpu_check: installing ${missing[*]} from $WHEELS into $SITE"
  "$PY" -m pip install --quiet --no-index --no-deps --find-links "$WHEELS" --target "$SITE" "${missing[@]}"
fi
exec timeout --kill-after=15 "${GPU_CHECK_LIMIT_S:-420}" "$PY" scripts/gpu_check.py "$@"
