"""DP load balance of one RL step: max/mean load across DP groups before and after balancing.

Workload: 4 DP groups x 32 prompt groups each, long-tail costs — response lengths drawn from a
Pareto distribution (a few very long generations), images of varied size (vision patches).
Before: each DP group trains the groups it generated. After: yatt-mm's plan (Karmarkar-Karp on
text tokens + vision patches, whole groups moved). Also shown: the same partition computed on
text tokens only (what verl and slime balance on), evaluated on the true cost.

Last line: JSON with imbalance_before, imbalance_after (target <= 1.05), plus extras.
"""

from __future__ import annotations

import json
import random
import time

from yatt_mm.rl.balance import imbalance, loads_of, plan_moves, sample_cost


def workload(dp: int = 4, groups_per_rank: int = 32, n: int = 8, seed: int = 0):
    rng = random.Random(seed)
    text, patches, owner = [], [], []
    for r in range(dp):
        for _ in range(groups_per_rank):
            prompt = rng.randint(40, 120)
            responses = [min(int(rng.paretovariate(1.3) * 40), 4096) for _ in range(n)]
            side = rng.choice([224, 336, 448, 672, 896])
            text.append(n * prompt + sum(responses))
            patches.append(n * (side // 14) ** 2)  # the ViT runs once per response row
            owner.append(r)
    return text, patches, owner


def main() -> None:
    dp = 4
    text, patches, owner = workload(dp)
    cost = [sample_cost(t, p) for t, p in zip(text, patches)]
    start = time.perf_counter()
    balanced, moves = plan_moves(cost, owner, dp)
    plan_ms = (time.perf_counter() - start) * 1e3
    text_only, _ = plan_moves([float(t) for t in text], owner, dp)
    before = imbalance(loads_of(cost, owner, dp))
    after = imbalance(loads_of(cost, balanced, dp))
    text_only_after = imbalance(loads_of(cost, text_only, dp))
    print(f"{len(cost)} groups on {dp} DP ranks, long-tail response lengths, varied image sizes")
    print(f"max/mean load before balancing:            {before:.3f}")
    print(f"after, text tokens only (verl/slime-like): {text_only_after:.3f}")
    print(f"after, tokens + vision patches (yatt-mm):  {after:.3f}  ({len(moves)} groups moved, plan {plan_ms:.1f} ms)")
    print(json.dumps({"imbalance_before": round(before, 4), "imbalance_after": round(after, 4),
                      "imbalance_text_only": round(text_only_after, 4), "groups_moved": len(moves),
                      "groups": len(cost), "plan_ms": round(plan_ms, 2)}))


if __name__ == "__main__":
    main()
