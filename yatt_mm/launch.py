"""Start a yatt-mm entry point under torchrun, one process per rank on this machine."""

from __future__ import annotations

import os
import subprocess
import sys


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def relaunch(module: str, nproc: int, args: list[str]) -> int:
    """Run `python -m module args` as `nproc` ranks (torchrun --standalone: a free port of its
    own, so several runs can share a machine). Several machines: call torchrun yourself with
    --nnodes/--rdzv-endpoint and the same module."""
    if nproc < 1:
        raise SystemExit(f"--nproc must be >= 1, got {nproc}")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           "-m", module, *args]
    return subprocess.call(cmd)
