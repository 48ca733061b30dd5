"""make_plan: one config on one cluster, every module's numbers together in a Plan, its problems
(what does not fit) and notes."""

from __future__ import annotations

from dataclasses import dataclass, field

from models.lora import check_layout as check_lora
from yatt_mm.plan.activations import CUDA, Kernels
from yatt_mm.plan.architectures import load_spec
from yatt_mm.plan.batch import MicroBatchShape, rl_micro_batch
from yatt_mm.plan.cluster import Assumptions, Cluster, check_inputs
from yatt_mm.plan.constants import (ALLOCATOR_SLACK, CUDA_CONTEXT_GIB, GIB, JUDGE_SERVER_MAX_MODEL_LEN,
                                    MEASURED_ON, VLLM_RESERVE_GIB, PlanError)
from yatt_mm.plan.engines import EngineMemory, engine_memory
from yatt_mm.plan.phases import GpuPhase, Line, gpu_phases, host_lines, scorer_label, scorers
from yatt_mm.plan.trainer import TrainerMemory, trainer_memory
from yatt_mm.reward.teacher import DistillConfig


@dataclass
class Plan:
    cfg: object
    cluster: Cluster
    spec: object
    shape: MicroBatchShape
    trainer: TrainerMemory
    rollout: EngineMemory
    judges: dict[str, EngineMemory]
    phases: list[GpuPhase]
    host: list[Line]  # per node
    notes: list[str] = field(default_factory=list)

    @property
    def dp(self) -> int:
        """The data-parallel size: world / (TP x PP x CP)."""
        t = self.cfg.policy.trainer
        return self.cluster.world // (t.model_parallel * t.context_parallel)

    @property
    def host_total(self) -> int:
        return sum(line.nbytes for line in self.host)

    @property
    def problems(self) -> list[str]:
        out = [f"phase {p.phase} on {p.gpus}: {p.total / GIB:.1f} GiB > {p.limit / GIB:.1f} GiB"
               for p in self.phases if not p.fits]
        for e in [self.rollout, *self.judges.values()]:
            if not e.starts:
                out.append(f"{e.name}: KV cache of {e.kv_tokens} tokens cannot hold one sequence of "
                           f"{e.max_model_len} (vLLM will not start)")
        if self.cluster.host_memory_gib and self.host_total > self.cluster.host_memory_gib * GIB:
            out.append(f"host memory per node: {self.host_total / GIB:.1f} GiB > {self.cluster.host_memory_gib:.1f} GiB")
        return out

    @property
    def fits(self) -> bool:
        return not self.problems


def make_plan(cfg, cluster: Cluster, assume: Assumptions = Assumptions(), kernels: Kernels = CUDA) -> Plan:
    """The memory plan of an RLConfig on `cluster`. PlanError on an impossible cluster figure or
    assumption, on a model it cannot resolve, or on a layout the model does not split into."""
    check_inputs(cluster, assume)
    cfg.check_world(cluster.world)
    spec = load_spec(cfg.policy.model)
    t = cfg.policy.trainer
    tp, pp = t.tensor_parallel, t.pipeline_parallel
    _check_parallel(spec, t)
    from models.family import family_of

    try:
        family_of(spec).check_layout(spec, tp, pp, "policy.trainer.", tuple(t.pipeline_layers), **t.expert_kwargs)
    except ValueError as e:
        raise PlanError(str(e)) from e
    if cfg.policy.trainer.recompute == "full" and getattr(spec, "num_deepstack", 0) and pp > 1:
        # the trainer refuses it too (models/qwen3vl/config.py): under a pipeline, a recomputed
        # layer would take another micro-batch's DeepStack features
        raise PlanError("policy.trainer.recompute=full with pipeline_parallel > 1 is not implemented for a model "
                        "with DeepStack (Qwen3-VL); use selective, or full without a pipeline")
    shape = rl_micro_batch(cfg, assume.seq_len, assume.media_tokens, assume.frame_tokens,
                           family_of(spec).media_factor(spec))
    policy = cfg.policy
    try:  # LoRA where the trainer would refuse it: refused here too
        check_lora(policy.lora, family_of(spec), t)
    except ValueError as e:
        raise PlanError(str(e)) from e
    trainer = trainer_memory(spec, t, cluster.world // (tp * pp), shape, kernels, policy.lora, policy.freeze_vision)
    engine = cfg.rollout.engine
    rollout = engine_memory("rollout engine", spec, engine.gpu_memory_utilization, cluster.gpu_bytes,
                            engine.tensor_parallel_size, engine.max_model_len)
    judges = {}  # and an on-policy distillation teacher, under "teacher"
    for j in scorers(cfg):
        max_len = JUDGE_SERVER_MAX_MODEL_LEN if j.backend == "server" else 2048  # EngineConfig's default
        if isinstance(j, DistillConfig):  # one token over the rollout's context (rl/train.py teacher_context)
            max_len = engine.max_model_len + 1
        judges[j.name] = engine_memory(scorer_label(j.name), load_spec(j.model or cfg.policy.model),
                                       j.gpu_memory_utilization, cluster.gpu_bytes, 1, max_len)
    plan = Plan(cfg, cluster, spec, shape, trainer, rollout, judges,
                gpu_phases(cfg, cluster, trainer, rollout, judges), host_lines(cfg, cluster, trainer, rollout, judges))
    plan.notes = _notes(plan)
    return plan


def _check_parallel(spec, t) -> None:
    """What the trainer refuses of this model before any rank starts (models/trainer.py
    TrainerConfig.check_model): a CP size the model's heads do not split over (Qwen3.5's DeltaNet
    heads over TP x CP; attention heads under a2a), expert parallelism on a model without experts."""
    try:
        t.check_context(spec, "policy.trainer")
    except ValueError as e:
        raise PlanError(str(e)) from e
    if t.expert_parallel > 1 and not getattr(spec, "num_experts", 0):
        raise PlanError(f"policy.trainer.expert_parallel={t.expert_parallel}: {spec.model_type} is not a "
                        "mixture-of-experts model")


def _notes(plan: Plan) -> list[str]:
    cfg, out = plan.cfg, []
    wanted = cfg.rollout.prompts_per_step * cfg.rollout.sampling.n
    in_flight = plan.rollout.kv_tokens // max(cfg.rollout.engine.max_model_len, 1)
    if plan.rollout.starts and in_flight < wanted:
        out.append(f"the rollout KV cache holds {in_flight} sequences of max_model_len at once, a step samples "
                   f"{wanted} per DP group: it runs in waves (slower, not out of memory)")
    for j in (wj.judge for wj in cfg.reward.judges):
        if j.backend == "server" and j.server_per == "dp_group" and not j.devices:
            out.append(f"judge {j.name}: server_per=dp_group without devices puts every DP group's server on GPU 0")
    out.append(f"CUDA context {CUDA_CONTEXT_GIB:g} GiB a process and allocator slack {ALLOCATOR_SLACK:.0%}: "
               f"measured on {MEASURED_ON}; vLLM's reserve ({VLLM_RESERVE_GIB:g} GiB) and asleep figure estimated")
    return out
