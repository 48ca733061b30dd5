"""One RL step of the tiny demo under full colocation, split into phases, with the idle share.

Runs `yatt-mm rl` with the demo's config and data (2 ranks, gloo, real vLLM engines for the
policy and the GenRM judge, Megatron trainer; the warm starts are the demo's, cached) for a few
steps and reads its metrics: the step time (median over the steps after the
first, which pays one-time warm-up), each phase's time on the slowest rank, and the idle share
(time a rank spends outside any phase: waiting for the other rank at collectives).

Last line: JSON with step_s and idle_share, plus the phase split.
"""

from __future__ import annotations

import json
import statistics

from _common import full_or_smoke
from _rl import demo_rl_records

STEPS = full_or_smoke(4, 2)  # the first step pays one-time warm-up and is left out


def main() -> None:
    records = demo_rl_records(STEPS)
    steps = [r for r in records if "time/step" in r][1:]
    phases = sorted({k for r in steps for k in r if k.startswith("time/") and k not in ("time/step", "time/idle", "time/idle_share")})
    split = {k[5:]: statistics.median(r.get(k, 0.0) for r in steps) for k in phases}
    step_s = statistics.median(r["time/step"] for r in steps)
    idle = statistics.median(r["time/idle_share"] for r in steps)
    print(f"median step {step_s:.2f}s over steps 2-{STEPS} (2 ranks, full colocation, tiny models)")
    for name, sec in sorted(split.items(), key=lambda kv: -kv[1]):
        print(f"  {name:10s} {sec:6.2f}s  {sec / step_s:6.1%}")
    print(f"  idle       {idle:6.1%} of the step")
    print(json.dumps({"step_s": round(step_s, 3), "idle_share": round(idle, 4),
                      "phases_s": {k: round(v, 3) for k, v in split.items()}}))


if __name__ == "__main__":
    main()
