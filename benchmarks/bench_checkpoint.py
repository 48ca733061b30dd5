"""What an asynchronous checkpoint costs the training loop, in Megatron-Core's distributed format
(the default, `run.checkpoint_format=torch_dist`) against each rank's own file (`per_rank`, the
format before it), both measured here in the same run of this script.

Runs the demo's config and data (`yatt-mm rl`, 2 ranks, the policy and judge warm starts of the
demo, cached) for a few steps with a checkpoint after every step, once per format, and reads the
run's metrics: `checkpoint/snapshot_seconds` is what the loop waits for (the state copied to host
memory; torch_dist also builds Megatron's sharded state dict and gathers the distributed
optimizer's state onto DP rank 0); `checkpoint/last_write_seconds` is the write, done by a
background thread during the next rollout (so it shares the cores with that step), which a
synchronous checkpoint would make the loop wait for. Both are rank 0's, medians over the steps.

Last line: JSON with snapshot_ms, write_s and bytes (the checkpoint on disk, both ranks) for
torch_dist, the same with `_before` for per_rank, and sync_over_async (how many times longer a
synchronous torch_dist checkpoint would block the loop).
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from _common import full_or_smoke
from _rl import demo_rl_records

STEPS = full_or_smoke(5, 2)  # the first checkpoint's write is reported by the second step


def measure(fmt: str) -> dict:
    sizes = []

    def checkpoint_size(run_dir: Path) -> None:
        # the newest: rank 0 prunes right after its own write, so the checkpoint before the last
        # stays on disk when the other rank finished the last one later (keep_checkpoints counts
        # complete ones only)
        last = max((run_dir / "checkpoints").glob("step_*"), key=lambda d: int(d.name.removeprefix("step_")))
        sizes.append(sum(f.stat().st_size for f in last.rglob("*") if f.is_file()))

    records = demo_rl_records(STEPS, "run.checkpoint_every=1", "run.keep_checkpoints=1",
                              f"run.checkpoint_format={fmt}", inspect=checkpoint_size)
    steps = [r for r in records if "checkpoint/snapshot_seconds" in r]
    # a step reports the write of the previous checkpoint: skip the first (nothing written yet)
    return {"snapshot_ms": round(1000 * statistics.median(r["checkpoint/snapshot_seconds"] for r in steps), 2),
            "write_s": round(statistics.median(r["checkpoint/last_write_seconds"] for r in steps[1:]), 4),
            "bytes": sizes[0],
            "step_s": statistics.median(r["time/step"] for r in records if "time/step" in r)}


def main() -> None:
    after, before = measure("torch_dist"), measure("per_rank")
    for name, m in (("torch_dist (Megatron distributed checkpoint)", after), ("per_rank (each rank's file)", before)):
        print(f"{name}: checkpoint every step of {m['step_s']:.2f}s, {m['bytes'] / 2**20:.1f} MiB on disk (every rank's files)")
        print(f"  loop blocked (snapshot):  {m['snapshot_ms']:.1f} ms")
        print(f"  write, in the background: {m['write_s'] * 1000:.1f} ms  (what a synchronous save would block)")
    print(json.dumps({"snapshot_ms": after["snapshot_ms"], "write_s": after["write_s"], "bytes": after["bytes"],
                      "snapshot_ms_before": before["snapshot_ms"], "write_s_before": before["write_s"],
                      "bytes_before": before["bytes"],
                      "sync_over_async": round(1000 * after["write_s"] / max(after["snapshot_ms"], 1e-6), 2)}))


if __name__ == "__main__":
    main()
