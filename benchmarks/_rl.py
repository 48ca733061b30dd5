"""Shared by the RL benchmarks: a short `yatt-mm rl` run of the demo's config on the demo's data."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]


def demo_rl_records(steps: int, *settings: str, inspect: Callable[[Path], None] | None = None,
                    nproc: int = 2) -> list[dict]:
    """Metrics records of the demo's config run for `steps` steps on `nproc` ranks, with the
    demo's data and cached warm starts, no eval and no final save, plus `settings`.
    `inspect(run_dir)` sees the run directory before it is deleted."""
    from yatt_mm.demo import DATA, make_data

    os.chdir(ROOT)  # the demo's data directory is relative to the repo root
    make_data()
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "yatt_mm.cli", "rl", "--config", "configs/tiny_demo.yaml", "--nproc", str(nproc),
               f"run.run_dir={tmp}/run", f"run.steps={steps}", f"data.shards=[{DATA / 'train'}]", "eval.every=0",
               "run.save_final=false", *settings]
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=1200)
        if proc.returncode != 0:
            sys.exit(f"rl run failed:\n{proc.stderr[-3000:]}")
        if inspect is not None:
            inspect(Path(tmp) / "run")
        return [json.loads(x) for x in Path(f"{tmp}/run/metrics.jsonl").read_text().splitlines()]
