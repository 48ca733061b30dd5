"""Run a test's worker in a fresh process (Megatron must never share the pytest process with
the session's in-process vLLM engine) and return the last JSON line it printed."""

import json
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_json(args: list[str], timeout: int = 300) -> dict:
    proc = subprocess.run(args, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-4000:])
    return json.loads([ln for ln in proc.stdout.splitlines() if ln.startswith("{")][-1])
