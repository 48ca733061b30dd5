"""Weights & Biases without the network, for the tests: an offline, quiet environment whose
files stay in a test's tmp dir, and an offline run read back with wandb's own reader of its
.wandb transaction log (`wandb leet inspect`, wandb >= 0.31)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path


def offline_env(tmp: Path) -> dict[str, str]:
    """Environment variables: wandb offline and quiet, its settings, caches and files under tmp."""
    env = {"WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    for var, sub in (("WANDB_DIR", "wandb-dir"), ("WANDB_CONFIG_DIR", "wandb-config"),
                     ("WANDB_CACHE_DIR", "wandb-cache"), ("WANDB_DATA_DIR", "wandb-data")):
        (tmp / sub).mkdir(parents=True, exist_ok=True)
        env[var] = str(tmp / sub)
    return env


def read_offline_run(run_folder: Path) -> tuple[dict[int, dict], dict]:
    """({step: the values logged at it}, the run: config, summary, state, name, tags, run_id) of
    an offline run folder (DIR/wandb/offline-run-*)."""
    def inspect(*flags):
        out = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--json", *flags, str(run_folder)],
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr[-2000:]
        return out.stdout

    by_step: dict[int, dict] = {}
    for line in inspect().splitlines():
        record = json.loads(line) if line.strip() else {}
        if record.get("type") == "history":
            row = record["history"]["item"]
            by_step.setdefault(row["_step"], {}).update(row)
    return by_step, json.loads(inspect("--summary"))


def assert_holds_metrics_jsonl(by_step: dict[int, dict], run_dir: Path) -> None:
    """Every record of RUN_DIR/metrics.jsonl is in the W&B history at its step, under its keys."""
    def same(a, b):  # the reader prints NaN and infinities as strings
        return a == b or (isinstance(a, float) and not math.isfinite(a) and str(b) in ("NaN", "Infinity", "-Infinity")
                          and (math.isnan(a) if b == "NaN" else a == float(b)))

    records = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert records
    for record in records:
        logged = by_step.get(record["step"], {})
        wrong = {k: (v, logged.get(k)) for k, v in record.items() if k not in ("step", "time") and not same(v, logged.get(k))}
        assert not wrong, (record["step"], wrong)
