"""One RL step, a call per phase, in the order of the diagram in the README:

    controller: rollout + reward + dynamic sampling + advantages   (rl/controller.py)
 -> balance whole groups across DP groups, then to the TP/CP/PP peers (rl/distributed.py)
 -> actor: old (and reference) logprobs, step-wide advantages, updates  (rl/actor.py)
 -> weight sync -> checkpoint snapshot -> probe check -> eval -> metrics

Where the controller's samples come from, generated in the step or by the rollout running a step
ahead, is `rollout` (rl/rollouts.py), chosen once per run.
"""

from __future__ import annotations

import time

from yatt_mm.rl import evaluation
from yatt_mm.rl.distributed import balance_groups, broadcast_samples, sum_across
from yatt_mm.rl.stats import time_metrics


def rl_step(run, step: int, rollout) -> dict[str, float]:
    cfg, ranks, phases = run.cfg, run.ranks, run.phases
    start = time.time()
    metrics: dict[str, float] = {}
    groups = []
    if ranks.leader:  # each DP group on its own, then only metadata and moved groups cross
        groups, rollout_metrics = rollout.take(step)
        metrics |= rollout_metrics
        if cfg.run.balance and ranks.dp_size > 1:
            with phases.phase("balance", step):
                groups, moved = balance_groups(groups, cfg.run.patch_weight, ranks.leaders_cpu)
            metrics |= moved
    else:  # a TP, CP or PP peer; with an engine over the DP group's ranks, it replays the controller's calls
        with phases.phase(phases.plan.phases[0].name, step):
            follow(run)
    samples = broadcast_samples([s for g in groups for s in g], ranks.leader_rank, ranks.mp_cpu)
    with phases.phase("logprobs", step):
        minis = run.actor.prepare(samples)
        metrics |= run.actor.old_logprobs(minis)
        metrics |= run.actor.batch_advantages(minis)
    with phases.phase("train", step):
        metrics |= run.actor.update(minis)
    rollout.before_sync(step)
    with phases.phase("sync", step):
        metrics |= push_weights(run)
        if ranks.leader:
            run.controller.policy_version = step + 1  # what the waves starting from now sample with
        rollout.during_sync(step)
        if ranks.leader:
            rollout.write_lineage(run.run_dir / f"consumed_rank{ranks.rank}.jsonl", step + 1)
        if cfg.run.checkpoint_every and (step + 1) % cfg.run.checkpoint_every == 0:
            # after the weight sync nothing is in flight and the trainer is still on the device:
            # snapshot now, write during the next rollout
            metrics |= run.checkpointer.save(step + 1, run.trainer, run.controller, ranks.dp_rank, rollout.snapshot)
    metrics |= probe_sync(run, step)
    if cfg.eval.every and (step + 1) % cfg.eval.every == 0:
        metrics |= evaluate(run, step)
    return metrics | time_metrics(run.timeline, step, time.time() - start, ranks.world_cpu)


def sync_weights(run, step: int) -> dict[str, float]:
    """The weight sync with its phases (resume uses it; a step runs the two halves itself)."""
    with run.phases.phase("sync", step):
        metrics = push_weights(run)
    return metrics | probe_sync(run, step)


def follow(run) -> None:
    """A peer of the controller replays its generate calls on a multi-rank engine (it holds none
    when the controller's engine is in a worker process: placement disaggregated)."""
    if run.engine is not None:
        run.engine.follow()


def serves_rollout(ranks) -> bool:
    """Whether this rank's engine is (a shard of) its DP group's rollout engine: the ranks of the
    controller's TP group. CP peers and later pipeline stages hold the same weights in their
    training shards but never generate, so they neither join an engine nor receive the sync."""
    return ranks.first_stage and ranks.cp_rank == 0


def push_weights(run) -> dict[str, float]:
    """Megatron weights -> HF names -> this DP group's engine, in place, a bucket of
    sync.bucket_mb at a time (a collective over TP and PP: the pipeline stages hand their
    buckets to the first; an engine over the group's ranks loads its shards on each; CP peers
    take part in the gathers and push nothing). In the
    "sync" phase: the trainer on the device, the engine's weights awake, its KV cache not."""
    ranks = run.ranks
    pushes = serves_rollout(ranks) and (ranks.leader or run.cfg.rollout.engine.tensor_parallel_size > 1)
    if run.cfg.sync.lora == "adapter":
        return push_adapter(run, pushes)
    seconds = nbytes = buckets = 0.0
    for bucket in run.trainer.export_hf_buckets(run.cfg.sync.bucket_mb):
        if pushes:  # TP peers without an engine still take part in the gathers
            info = run.engine.update_weights(bucket.items(), partial=True)
            seconds, nbytes, buckets = seconds + info["seconds"], nbytes + info["bytes"], buckets + 1
        del bucket
    if pushes:
        run.engine.weights_loaded()
    return {"sync/seconds": seconds, "sync/bytes": nbytes, "sync/buckets": buckets} if pushes else {}


def push_adapter(run, pushes: bool) -> dict[str, float]:
    """sync.lora adapter: the LoRA adapter alone, whole (a collective over TP and PP), into this
    DP group's engine, which samples with it from now on; the base weights never move."""
    adapter = run.trainer.export_adapter()
    if not pushes:
        return {}
    info = run.engine.load_adapter(adapter, run.trainer.adapter_config())
    run.engine.weights_loaded()
    return {"sync/seconds": info["seconds"], "sync/bytes": info["bytes"], "sync/buckets": 1.0}


def probe_sync(run, step: int) -> dict[str, float]:
    """With run.check_sync, the engine's greedy answer to a fixed probe prompt is scored by the
    trainer's weights: the two must agree, or the run stops here, before sampling from weights
    the trainer does not have. In the "probe" phase: the whole engine, the trainer's weights."""
    if not run.cfg.run.check_sync:
        return {}
    with run.phases.phase("probe", step):
        probe = []
        if run.ranks.leader:
            with run.engine.lead():
                probe = run.controller.probe()
        else:
            follow(run)
        return run.actor.check_sync(broadcast_samples(probe, run.ranks.leader_rank, run.ranks.mp_cpu))


def evaluate(run, step: int) -> dict[str, float]:
    """Held-out reward over every DP group (a collective over the leaders): over all the
    eval sets' prompts, and each named set's own."""
    if not run.cfg.eval.active():
        return {}
    if not run.ranks.leader:
        follow(run)
        return {}
    counts = {}
    with run.engine.lead():
        for held in run.evals:
            counts |= run.controller.evaluate(held, step, run.cfg.eval.seed)
    return evaluation.metrics(run.evals, sum_across(counts, run.ranks.leaders_cpu))
