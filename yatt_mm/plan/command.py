"""`yatt-mm plan`: check the inputs, plan, print, advise; the exit code says whether it fits."""

from __future__ import annotations

import sys

from yatt_mm.plan.advice import advise, over_limit
from yatt_mm.plan.cluster import Assumptions, Cluster, cluster_sources, input_problems, plan_cluster
from yatt_mm.plan.constants import PlanError
from yatt_mm.plan.planner import make_plan
from yatt_mm.plan.report import format_plan, gib


def run_plan(config: str | None, overrides: list[str], given: dict[str, float] | None = None,
             assume: Assumptions = Assumptions()) -> int:
    """`yatt-mm plan`: print the plan on the cluster the config states (its `cluster` section),
    each figure in `given` (Cluster's field names: the flags) taking its place; 0 if every phase
    fits, 1 if not, 2 on an impossible figure given or assumption (checked first, before the config
    is read) or a config error."""
    given = dict(given or {})
    problems = input_problems(Cluster(**given), assume)  # the defaults pass: only the given figures can fail
    if problems:
        for problem in problems:
            print(f"yatt-mm plan: {problem}", file=sys.stderr)
        return 2

    from yatt_mm.config import ConfigError, load
    from yatt_mm.rl.config import RLConfig

    try:
        cfg = load(RLConfig, config, overrides)
        cluster = plan_cluster(cfg.cluster.stated(), given)
        plan = make_plan(cfg, cluster, assume)
        plan.notes.insert(0, cluster_sources(cfg.cluster.stated(), given))
    except (ConfigError, PlanError, ValueError) as e:
        print(f"yatt-mm plan: {e}", file=sys.stderr)
        return 2
    print(format_plan(plan))
    print()
    if plan.fits:
        print("verdict: fits")
        return 0
    print("verdict: DOES NOT FIT")
    for problem in plan.problems:
        print(f"  {problem}")
    singles, combined, together = advise(cfg, cluster, assume)
    if singles and singles[0][1].fits:
        print("change one of these settings (each fits alone):")
    elif singles:
        print("no single setting fits alone; each of these helps:")
    for change, p in singles[:6]:
        worst = max(p.phases, key=lambda q: q.total - q.limit)
        print(f"  {change:<56} worst: {worst.phase} on {worst.gpus}, {gib(worst.total)} GiB")
    if combined:
        verdict = "fits" if together.fits else f"still {gib(over_limit(together))} GiB over"
        print(f"together: {' '.join(combined)} ({verdict})")
    if not singles:
        print("no setting helps: more GPUs (--gpus-per-node, --nodes), GPUs with more memory, or a smaller model")
    return 1
