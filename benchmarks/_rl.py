"""Shared by the RL benchmarks: a short `yatt-mm rl` run of the demo's config on the demo's data."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Callable

from _common import ROOT, SMOKE, full_or_smoke, output_root

# A smoke run's judge: the untrained tiny judge (built offline in seconds) instead of the demo's
# warm start, whose SFT takes minutes. Its verdicts are unparseable and count as fallbacks, but
# it generates and is scored like the real one, so every phase of the step still runs.
SMOKE_JUDGE = "{judge: {name: genrm, model: 'tiny:judge', votes: 2, max_tokens: 6}, weight: 0.5}"
# and a quarter of the demo's step (2 prompts of 8 responses per DP group, 8 held-out prompts):
# every phase still runs, in less time; a benchmark's own settings still win
SMOKE_STEP = [f"reward.judges=[{SMOKE_JUDGE}]", "rollout.prompts_per_step=2", "eval.num_prompts=8"]


def demo_data() -> Path:
    """The demo's shards (`train` and `eval` below it), made once: runs/demo-data when measuring,
    its twin under the smoke output folder in a smoke run (same contents, so the cached warm
    starts are the same)."""
    from yatt_mm.demo import DATA, make_data

    base = full_or_smoke(ROOT, output_root())
    base.mkdir(parents=True, exist_ok=True)
    os.chdir(base)  # make_data writes the demo's relative data directory
    make_data()
    os.chdir(ROOT)
    return base / DATA


def demo_rl_records(steps: int, *settings: str, inspect: Callable[[Path], None] | None = None,
                    nproc: int = full_or_smoke(2, 1)) -> list[dict]:
    """Metrics records of the demo's config run for `steps` steps on `nproc` ranks (the demo's 2;
    a smoke run's 1: half the processes to import and the engines to start, and every phase of
    the step still runs), with the demo's data and cached warm starts, no eval and no final
    save, plus `settings`.
    `inspect(run_dir)` sees the run directory before it is deleted."""
    data = demo_data()
    smoke = SMOKE_STEP if SMOKE else []  # `settings` come after: theirs win
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "yatt_mm.cli", "rl", "--config", "configs/tiny_demo.yaml", "--nproc", str(nproc),
               f"run.run_dir={tmp}/run", f"run.steps={steps}", f"data.shards=[{data / 'train'}]",
               f"eval.shards=[{data / 'eval'}]", "eval.every=0", "run.save_final=false", *smoke, *settings]
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=1200)
        if proc.returncode != 0:
            sys.exit(f"rl run failed:\n{proc.stderr[-3000:]}")
        if inspect is not None:
            inspect(Path(tmp) / "run")
        return [json.loads(x) for x in Path(f"{tmp}/run/metrics.jsonl").read_text().splitlines()]
