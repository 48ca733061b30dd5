"""Megatron-Core trains on CPU with gloo: two ranks under torchrun run one step of a tiny GPT
(tests/dist/megatron_gpt_step.py) through Megatron's DDP, optimizer and schedule, with the CPU
shims of models/runtime.py."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest


REPO = Path(__file__).resolve().parents[2]
WORKER = REPO / "tests" / "dist" / "megatron_gpt_step.py"
TIMEOUT_S = 240  # one launch takes ~10-25 s, most of it importing megatron twice


@pytest.fixture(scope="module")
def steps() -> dict:
    """One step at TP 1 (DP 2) and one at TP 2, in one launch (Megatron's groups remade between)."""
    # --standalone: a c10d rendezvous on localhost:0, so each launch gets its own free port.
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(WORKER), "--tp", "1", "2"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=TIMEOUT_S)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"worker failed (rc {proc.returncode}):\n{output[-6000:]}"
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(lines) == 1, f"expected one JSON line from rank 0:\n{output[-6000:]}"
    return json.loads(lines[0])


def test_megatron_step_dp2(steps):
    result = steps["1"]
    assert (result["tp"], result["dp"]) == (1, 2)
    # one step on uniform random tokens from a fresh model: cross-entropy at chance, ln(64) = 4.159
    # (measured 4.204 at TP 1); a broken forward or loss lands far from it
    assert abs(result["loss"] - math.log(64)) < 0.2 and result["grad_norm"] > 0, result
    assert result["params_changed"] is True
    assert result["params_identical"] is True  # the DP gradient all-reduce worked


def test_megatron_step_tp2(steps):
    result = steps["2"]
    assert (result["tp"], result["dp"]) == (2, 1)
    # one step on uniform random tokens from a fresh model: cross-entropy at chance, ln(64) = 4.159
    # (measured 4.204 at TP 1); a broken forward or loss lands far from it
    assert abs(result["loss"] - math.log(64)) < 0.2 and result["grad_norm"] > 0, result
    assert result["params_changed"] is True
    assert result["params_identical"] is True  # TP ranks agree on the parameters they replicate
