"""What to change when a plan does not fit: the settings that lower memory, each tried alone,
then a greedy combination."""

from __future__ import annotations

import json

from yatt_mm.plan.cluster import Assumptions, Cluster
from yatt_mm.plan.planner import Plan, make_plan


def candidate_changes(cfg, cluster: Cluster) -> list[list[str]]:
    """Settings that lower memory, each as the key=value overrides that make it one change."""
    t, e = cfg.policy.trainer, cfg.rollout.engine
    out = []
    if not t.distributed_optimizer and cluster.world // t.model_parallel > 1:
        out.append(["policy.trainer.distributed_optimizer=true"])
    modes = ("none", "selective", "full")
    out += [[f"policy.trainer.recompute={r}"] for r in modes if modes.index(r) > modes.index(t.recompute)]
    if cluster.world % (2 * t.model_parallel) == 0:
        out.append([f"policy.trainer.pipeline_parallel={2 * t.pipeline_parallel}"])
    # a MoE's experts over twice the ranks; each sequence over twice the ranks (the plan refuses
    # either where the model has no experts / no CP path, and the change is then dropped)
    if cluster.world % (2 * t.model_parallel * t.expert_parallel) == 0:
        out.append([f"policy.trainer.expert_parallel={2 * t.expert_parallel}"])
    if cluster.world % (2 * t.model_parallel * t.context_parallel) == 0:
        out.append([f"policy.trainer.context_parallel={2 * t.context_parallel}"])
    if cluster.world % (2 * t.model_parallel) == 0:  # an engine spans 1 rank or the trainer's TP group
        out.append([f"policy.trainer.tensor_parallel={2 * t.tensor_parallel}"]
                   + ([f"rollout.engine.tensor_parallel_size={2 * t.tensor_parallel}"] if e.tensor_parallel_size > 1
                      else []))
    if t.dtype == "fp32":
        out.append(["policy.trainer.dtype=bf16"])
    if t.offload == "never":
        out.append(["policy.trainer.offload=auto"])
    if cfg.run.micro_batch_tokens > e.max_model_len:
        out.append([f"run.micro_batch_tokens={max(e.max_model_len, cfg.run.micro_batch_tokens // 2)}"])
    if e.release == "keep":
        out.append(["rollout.engine.release=auto"])
    if e.gpu_memory_utilization > 0.3:
        out.append([f"rollout.engine.gpu_memory_utilization={round(e.gpu_memory_utilization - 0.1, 2)}"])
    if e.tensor_parallel_size == 1 and t.tensor_parallel > 1:
        out.append([f"rollout.engine.tensor_parallel_size={t.tensor_parallel}"])
    if not cfg.policy.lora.rank:  # frozen base: no gradients or Adam state but the adapter's; the plan
        # refuses it where the family or layout has no LoRA, and the change is then dropped
        out.append(["policy.lora.rank=64", "sync.lora=adapter", *_lora_targets(cfg)])
        if not cfg.policy.freeze_vision:
            out.append(["policy.freeze_vision=true"])
    return out


def _lora_targets(cfg) -> list[str]:
    """The target_modules override a family whose adapters reach other projections needs (an
    MoE's: the attention's, and Qwen3.5-MoE's DeltaNet and shared expert; the routed experts'
    adapters are opt-in: one pair per expert, E times a dense MLP's); none when they reach the
    default ones, or the model cannot be read."""
    from models.family import family_of
    from yatt_mm.plan.architectures import load_spec

    try:
        targets = family_of(load_spec(cfg.policy.model)).lora_targets
    except ValueError:  # the plan names what it cannot read
        return []
    targets = [t for t in targets if t != "experts"]
    return [f"policy.lora.target_modules=[{', '.join(targets)}]"] if targets else []


def over_limit(plan: Plan) -> int:
    """How far the worst GPU phase is over its limit (negative: under)."""
    return max(p.total - p.limit for p in plan.phases)


def _changed(cfg, overrides: list[str], cluster: Cluster, assume: Assumptions) -> Plan | None:
    """The plan of `cfg` with `overrides`; None when they break the config or the model's layout."""
    from yatt_mm.config import ConfigError, apply_override, build, validate
    from yatt_mm.rl.config import RLConfig

    data = json.loads(json.dumps(_as_dict(cfg), default=str))
    try:
        for override in overrides:
            apply_override(data, override)
        changed = build(RLConfig, data)
        validate(changed)
        return make_plan(changed, cluster, assume)
    except (ConfigError, ValueError):
        return None


def advise(cfg, cluster: Cluster, assume: Assumptions) -> tuple[list[tuple[str, Plan]], list[str], Plan | None]:
    """(single changes that each make the plan fit, or else those that lower the worst phase,
    best first; a greedy combination of changes, best first each time; the plan with it)."""
    before = make_plan(cfg, cluster, assume)
    tried = [(" ".join(c), p) for c in candidate_changes(cfg, cluster) if (p := _changed(cfg, c, cluster, assume))]
    fixes = [(c, p) for c, p in tried if p.fits]
    singles = fixes or sorted([(c, p) for c, p in tried if over_limit(p) < over_limit(before)],
                              key=lambda cp: over_limit(cp[1]))
    combined, plan, current = [], None, cfg
    while not fixes and len(combined) < 6:
        options = [(c, p) for c in candidate_changes(current, cluster)
                   if (p := _changed(cfg, combined + c, cluster, assume))]
        options = [(c, p) for c, p in options if over_limit(p) < over_limit(plan or before)]
        if not options:
            break
        change, plan = min(options, key=lambda cp: over_limit(cp[1]))
        combined += change
        current = plan.cfg
        if plan.fits:
            break
    return singles, combined, plan


def _as_dict(cfg) -> dict:
    from yatt_mm.config import to_dict

    return to_dict(cfg)
