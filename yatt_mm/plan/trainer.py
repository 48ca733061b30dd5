"""One trainer rank's memory: weights, the fp32 DDP gradient buffer, Adam's state (sharded over
DP by the distributed optimizer) and activations, on the pipeline stage that needs the most."""

from __future__ import annotations

from dataclasses import dataclass

from yatt_mm.plan.activations import CUDA, Activations, Kernels, activation_bytes
from yatt_mm.plan.batch import MicroBatchShape
from yatt_mm.plan.params import Params, param_counts



@dataclass(frozen=True)
class TrainerMemory:
    """One rank's trainer, in bytes."""

    params: Params  # on this TP rank of its pipeline stage
    stage: int  # the pipeline stage (the one with the largest peak; 0 without PP)
    model_params: int  # of the whole model
    weights: int
    grads: int
    optimizer: int
    activations: Activations

    @property
    def persistent(self) -> int:
        return self.weights + self.grads + self.optimizer

    @property
    def step_extra(self) -> int:
        """What the train phase adds to the persistent state at its peak: the forward and
        backward's activations (fused Adam, models/optimizer.py, updates in place)."""
        return self.activations.peak

    @property
    def peak(self) -> int:
        return self.persistent + self.step_extra

    @property
    def host_offload(self) -> int:
        """What release() moves to host memory: weights and optimizer state (gradients are dropped)."""
        return self.weights + self.optimizer


def trainer_memory(spec, trainer, dp: int, shape: MicroBatchShape, kernels: Kernels = CUDA) -> TrainerMemory:
    """`trainer`: models.trainer.TrainerConfig; `dp`: the ranks that hold the same dense
    parameters, world / (TP x PP): the data-parallel size times the context-parallel size
    (Megatron's DDP and distributed optimizer reduce and shard over the dp_cp group). Under
    pipeline parallelism, the stage whose rank needs the most."""
    stages = [stage_memory(spec, trainer, dp, shape, kernels, s) for s in range(trainer.pipeline_parallel)]
    return max(stages, key=lambda t: t.peak)


def stage_memory(spec, trainer, dp: int, shape: MicroBatchShape, kernels: Kernels, stage: int) -> TrainerMemory:
    tp, pp = trainer.tensor_parallel, trainer.pipeline_parallel
    ep, cp = getattr(trainer, "expert_parallel", 1), getattr(trainer, "context_parallel", 1)
    layers = tuple(getattr(trainer, "pipeline_layers", ()))  # language layers per stage (empty: even)
    params = param_counts(spec, tp, pp, stage, layers, ep)
    e = 2 if trainer.dtype == "bf16" else 4
    # Adam's m and v in fp32; bf16 adds fp32 master weights (fp32 steps the weights themselves)
    state_per_param = 8 + (4 if e == 2 else 0)
    # ZeRO-1: dense parameters' state sharded over the DP (x CP) group; a MoE layer's experts,
    # which only the dp / ep ranks of their expert-data-parallel group share, over that group
    dense_shards, expert_shards = (dp, max(1, dp // ep)) if trainer.distributed_optimizer else (1, 1)
    optimizer = params.dense * state_per_param // dense_shards + params.experts * state_per_param // expert_shards
    return TrainerMemory(params=params, stage=stage, model_params=param_counts(spec).total, weights=params.total * e,
                         grads=params.total * 4, optimizer=optimizer,
                         activations=activation_bytes(spec, shape, tp, e, trainer.recompute, kernels, pp, stage,
                                                      layers, cp, getattr(trainer, "context_parallel_comm", "all_gather")))
