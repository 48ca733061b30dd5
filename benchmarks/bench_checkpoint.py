"""What an asynchronous checkpoint costs the training loop, against writing it synchronously.

Runs the demo's config and data (`yatt-mm rl`, 2 ranks, the policy and judge warm starts of the
demo, cached) for a few steps with a checkpoint after every step, and reads the run's metrics:
`checkpoint/snapshot_seconds` is what the loop waits for (copying the state in memory);
`checkpoint/last_write_seconds` is the write a synchronous checkpoint would have made it wait
for (here done by a background thread during the next rollout, so it shares the cores with
that step: on a quiet machine a synchronous write would be somewhat shorter). Both are rank 0's.

Last line: JSON with blocked_s (median snapshot), write_s (median write), sync_over_async
(how many times longer a synchronous checkpoint would block the loop) and checkpoint_bytes.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from _common import full_or_smoke
from _rl import demo_rl_records

STEPS = full_or_smoke(5, 2)  # the first checkpoint's write is reported by the second step


def main() -> None:
    sizes = []

    def checkpoint_size(run_dir: Path) -> None:
        # the newest: rank 0 prunes right after its own write, so the checkpoint before the last
        # stays on disk when the other rank finished the last one later (keep_checkpoints counts
        # complete ones only)
        last = max((run_dir / "checkpoints").glob("step_*"), key=lambda d: int(d.name.removeprefix("step_")))
        sizes.append(sum(f.stat().st_size for f in last.iterdir()))

    records = demo_rl_records(STEPS, "run.checkpoint_every=1", "run.keep_checkpoints=1", inspect=checkpoint_size)
    size = sizes[0]
    steps = [r for r in records if "checkpoint/snapshot_seconds" in r]
    blocked = statistics.median(r["checkpoint/snapshot_seconds"] for r in steps)
    # a step reports the write of the previous checkpoint: skip the first (nothing written yet)
    write = statistics.median(r["checkpoint/last_write_seconds"] for r in steps[1:])
    step_s = statistics.median(r["time/step"] for r in records if "time/step" in r)
    print(f"checkpoint every step of {step_s:.2f}s, {size / 2**20:.1f} MiB on disk (2 ranks)")
    print(f"  loop blocked (in-memory snapshot): {blocked * 1000:.1f} ms")
    print(f"  write, in the background:          {write * 1000:.1f} ms  (what a synchronous save would block)")
    print(json.dumps({"blocked_s": round(blocked, 4), "write_s": round(write, 4),
                      "sync_over_async": round(write / max(blocked, 1e-9), 2), "checkpoint_bytes": size}))


if __name__ == "__main__":
    main()
