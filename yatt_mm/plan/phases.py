"""Which role holds what on each GPU in each phase of the placement plan (yatt_mm/rl/placement.py),
and what each node's host memory holds for offload: with offload, the trainer waits in host
memory during rollout and vLLM sleeps during training; judge servers stay resident."""

from __future__ import annotations

from dataclasses import dataclass

from yatt_mm.plan.cluster import Cluster
from yatt_mm.plan.constants import ALLOCATOR_SLACK, CUDA_CONTEXT_GIB, GIB, VLLM_ASLEEP_GIB
from yatt_mm.plan.engines import EngineMemory
from yatt_mm.plan.trainer import TrainerMemory


@dataclass(frozen=True)
class Line:
    """One memory line of a phase on one GPU."""

    what: str
    nbytes: int


@dataclass(frozen=True)
class GpuPhase:
    phase: str
    gpus: str  # which GPUs of a node this is
    lines: tuple[Line, ...]
    limit: int

    @property
    def total(self) -> int:
        return sum(line.nbytes for line in self.lines)

    @property
    def fits(self) -> bool:
        return self.total <= self.limit


def scorers(cfg) -> list:
    """The served models that score responses beside the rollout: the judges, and an on-policy
    distillation teacher (algorithm.distill, named "teacher"), each with a judge's settings
    (name, model, backend, devices, server_per, gpu_memory_utilization)."""
    distill = getattr(cfg.algorithm, "distill", None)
    return [wj.judge for wj in cfg.reward.judges] + ([distill] if distill is not None and distill.active else [])


def scorer_label(name: str) -> str:
    return "teacher" if name == "teacher" else f"judge {name}"


def _server_gpus(cfg, cluster: Cluster, tp: int) -> dict[int, list[tuple[str, int]]]:
    """Local GPU -> (judge name, servers) of the judge (and teacher) servers resident on it. A
    server runs on the first of its devices, or without devices on the GPU a process without
    CUDA_VISIBLE_DEVICES uses (the node's first); one per node, or one per DP group."""
    out: dict[int, list[tuple[str, int]]] = {}
    for j in scorers(cfg):
        if j.backend != "server":
            continue
        first = j.devices.split(",")[0].strip()
        gpu = int(first) if first.isdigit() else 0  # a GPU named by UUID: counted as the first
        count = max(1, cluster.gpus_per_node // tp) if j.server_per == "dp_group" else 1
        out.setdefault(gpu, []).append((j.name, count))
    return out


def _trainer_lines(phase: str, level: str, t: TrainerMemory, cfg, offloads: bool) -> list[Line]:
    if level == "none" and offloads:
        return []
    if level == "weights" and offloads:
        return [Line("trainer weights", t.weights)]
    lines = [Line("trainer weights", t.weights), Line("gradients (fp32 DDP buffer)", t.grads),
             Line("optimizer state", t.optimizer)]
    if phase == "train":
        lines.append(Line("activations (peak)", t.step_extra))
    elif phase == "logprobs":
        lines.append(Line("forward-only logits", t.activations.forward_only))
        if cfg.algorithm.kl_coef > 0 and not t.adapter:  # LoRA: the reference is the base, adapters off
            lines.append(Line("reference policy weights", t.weights))
    elif phase == "sync":
        lines.append(Line("weight export (one bucket / gathered copy)", _export_bytes(cfg, t)))
    lines.append(Line("allocator slack", int(ALLOCATOR_SLACK * sum(line.nbytes for line in lines))))
    return lines


def _export_bytes(cfg, t: TrainerMemory) -> int:
    """The HF-named copy the weight sync builds: one sync.bucket_mb bucket at a time where the
    config has buckets (at least the largest tensor, gathered over TP), else the whole model
    (every pipeline stage's part reaches the first stage)."""
    e = t.weights // max(t.params.total + t.adapter, 1)
    tp = cfg.policy.trainer.tensor_parallel
    if t.adapter and cfg.sync.lora == "adapter":  # the adapter alone, whole (at most TP x this rank's part)
        return t.adapter * tp * e
    bucket_mb = getattr(getattr(cfg, "sync", None), "bucket_mb", None)
    whole = t.model_params * e
    if bucket_mb is None:
        return whole
    return min(whole, max(int(bucket_mb * 2**20), t.params.largest * tp * e))


def _engine_lines(label: str, level: str, release: str, engine: EngineMemory) -> list[Line]:
    if release == "keep" or level == "all" or (release == "shutdown" and level == "weights"):
        return [Line(f"{label} weights", engine.weights), Line(f"{label} KV cache", engine.kv_cache),
                Line(f"{label} reserve", engine.total - engine.weights - engine.kv_cache)]
    if level == "weights":
        return [Line(f"{label} weights (KV cache asleep)", engine.weights)]
    return [] if release == "shutdown" else [Line(f"{label} asleep", int(VLLM_ASLEEP_GIB * GIB))]


def _release_mode(release: str) -> str:
    return "sleep" if release == "auto" else release  # on GPUs (engines/engine.py release_mode)


def gpu_phases(cfg, cluster: Cluster, t: TrainerMemory, rollout: EngineMemory,
               judges: dict[str, EngineMemory]) -> list[GpuPhase]:
    """Per phase of the placement plan (rl/placement.py), the memory of each kind of GPU: those
    with judge servers on them, and the others."""
    from yatt_mm.rl.placement import PLANS

    tp = cfg.policy.trainer.tensor_parallel
    servers = _server_gpus(cfg, cluster, tp)
    kinds = sorted(g for g in servers if g < cluster.gpus_per_node)
    others = [g for g in range(cluster.gpus_per_node) if g not in servers]
    groups = [(f"GPU {g} (+ {', '.join(scorer_label(n) + ' server' for n, _ in servers[g])})", servers[g])
              for g in kinds]
    if others:
        groups.append((_gpu_range(others), []))
    offloads = cfg.policy.trainer.offload != "never"
    release = _release_mode(cfg.rollout.engine.release)
    inprocess = [j for j in scorers(cfg) if j.backend == "inprocess"]
    out = []
    for phase in PLANS[cfg.run.placement]("teacher" in judges).phases:
        levels = phase.levels()
        if not levels:
            continue  # prepare, balance: no devices
        for label, resident in groups:
            lines = _trainer_lines(phase.name, levels.get("train", "none"), t, cfg, offloads)
            lines += _engine_lines("vLLM rollout", levels.get("rollout", "none"), release, rollout)
            for j in inprocess:  # the teacher's engine wakes in its own phase, the judges' in theirs
                role = "teacher" if j.name == "teacher" else "judge"
                lines += _engine_lines(scorer_label(j.name), levels.get(role, "none"), "sleep", judges[j.name])
            for name, count in resident:
                lines.append(Line(f"{scorer_label(name)} server (x{count}, resident)",
                                  count * (judges[name].total + int(CUDA_CONTEXT_GIB * GIB))))
            lines.append(Line("CUDA context", int(CUDA_CONTEXT_GIB * GIB)))
            out.append(GpuPhase(phase.name, label, tuple(ln for ln in lines if ln.nbytes), cluster.gpu_bytes))
    return out


def _gpu_range(gpus: list[int]) -> str:
    if len(gpus) == 1:
        return f"GPU {gpus[0]}"
    if gpus == list(range(gpus[0], gpus[-1] + 1)):
        return f"GPUs {gpus[0]}-{gpus[-1]}"
    return "GPUs " + ",".join(map(str, gpus))


def host_lines(cfg, cluster: Cluster, t: TrainerMemory, rollout: EngineMemory,
               judges: dict[str, EngineMemory]) -> list[Line]:
    """Host memory per node held for offload (pinned): what each rank moves off its GPU."""
    g = cluster.gpus_per_node
    lines = []
    if cfg.policy.trainer.offload != "never":
        lines.append(Line(f"trainer weights + optimizer state, {g} ranks", g * t.host_offload))
    if _release_mode(cfg.rollout.engine.release) == "sleep":
        lines.append(Line(f"vLLM rollout weights asleep, {g} engines", g * rollout.weights))
    for j in scorers(cfg):
        if j.backend == "inprocess":
            lines.append(Line(f"{scorer_label(j.name)} weights asleep, {g} engines", g * judges[j.name].weights))
    if cfg.algorithm.kl_coef > 0 and not t.adapter:  # LoRA: the reference is the trainer's base, adapters off
        lines.append(Line(f"reference policy (kl_coef > 0), {g} ranks", g * t.weights))
    return lines
