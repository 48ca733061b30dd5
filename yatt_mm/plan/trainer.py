"""One trainer rank's memory: weights, the fp32 DDP gradient buffer, Adam's state (sharded over
DP by the distributed optimizer) and activations, on the pipeline stage that needs the most."""

from __future__ import annotations

from dataclasses import dataclass, replace

from models.stages import stage_layers
from yatt_mm.plan.activations import CUDA, Activations, Kernels, activation_bytes
from yatt_mm.plan.batch import MicroBatchShape
from yatt_mm.plan.params import (EXPERT_LINEARS, Params, adaptable_linears, adapted_layers, lora_params,
                                 param_counts, targeted_linears)



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
    adapter: int = 0  # LoRA: the adapter's parameters on this rank (beside the frozen `params`)
    trainable: int = 0  # parameters with gradients and optimizer state on this rank

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


def trainer_memory(spec, trainer, dp: int, shape: MicroBatchShape, kernels: Kernels = CUDA, lora=None,
                   freeze_vision: bool = False) -> TrainerMemory:
    """`trainer`: models.trainer.TrainerConfig; `dp`: the ranks that hold the same dense
    parameters, world / (TP x PP): the data-parallel size times the context-parallel size
    (Megatron's DDP and distributed optimizer reduce and shard over the dp_cp group). `lora`
    (policy.lora) and `freeze_vision` (policy.freeze_vision): frozen parameters have neither
    gradients nor optimizer state. Under pipeline parallelism, the stage whose rank needs the most."""
    stages = [stage_memory(spec, trainer, dp, shape, kernels, s, lora, freeze_vision)
              for s in range(trainer.pipeline_parallel)]
    return max(stages, key=lambda t: t.peak)


def stage_memory(spec, trainer, dp: int, shape: MicroBatchShape, kernels: Kernels, stage: int, lora=None,
                 freeze_vision: bool = False) -> TrainerMemory:
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
    adapter = lora_params(spec, lora, tp, pp, stage, layers, ep) if lora is not None else 0
    activations = activation_bytes(spec, shape, tp, e, trainer.recompute, kernels, pp, stage, layers, cp,
                                   getattr(trainer, "context_parallel_comm", "all_gather"),
                                   # a frozen tower keeps nothing; one with adapters what a trained one does
                                   vision_trained=not freeze_vision and (not adapter or lora.vision_tower))
    if adapter:  # the base frozen: the adapter alone has gradients and Adam state
        # the routed experts' adapters: their state sharded over the expert-data-parallel group
        experts = adapter - lora_params(spec, replace(lora, target_modules=[t for t in lora.target_modules
                                                                            if t != "experts"]), tp, pp, stage, layers, ep)
        trainable = adapter
        optimizer = (adapter - experts) * state_per_param // dense_shards + experts * state_per_param // expert_shards
        activations = _with_adapter_activations(activations, spec, shape, lora, e, trainer.recompute, tp, cp,
                                                pp, stage, layers)
    else:
        dense = params.dense - (params.vision if freeze_vision else 0)
        trainable = dense + params.experts
        optimizer = dense * state_per_param // dense_shards + params.experts * state_per_param // expert_shards
    return TrainerMemory(params=params, stage=stage, model_params=param_counts(spec).total,
                         weights=(params.total + adapter) * e, grads=trainable * 4, optimizer=optimizer,
                         activations=activations, adapter=adapter, trainable=trainable)


def _with_adapter_activations(a: Activations, spec, shape: MicroBatchShape, lora, e: int, recompute: str, tp: int,
                              cp: int, pp: int, stage: int, layers: tuple[int, ...]) -> Activations:
    """What LoRA adds to the activations: each adapted linear keeps its r-wide A x for B's
    gradient (its input is kept for the base weight's backward anyway), and with dropout the
    dropped-out input and its mask; for every layer of the micro-batches in flight on the stage
    (1F1B: `layers_held` = its layers x pp - stage). None with full recompute, which keeps only
    the layers' inputs."""
    if recompute == "full":
        return a
    tokens = -(-shape.tokens // cp)
    layers_held = stage_layers(spec.num_layers, pp, layers)[stage] * (pp - stage)
    # the adapted linears' inputs on this rank: whole for column-parallel ones, split for row-parallel
    widths = {linear: n_in // tp if kind == "row" else n_in for linear, (n_in, _, kind) in adaptable_linears(spec).items()}
    # per layer of the stage, on average: a hybrid model's attention adapters are on its softmax layers only
    held, n_layers = adapted_layers(spec, pp, stage, layers), stage_layers(spec.num_layers, pp, layers)[stage]
    # a token passes through num_experts_per_tok routed experts of a MoE layer
    passes = {linear: getattr(spec, "num_experts_per_tok", 1) if linear in EXPERT_LINEARS else 1 for linear in widths}
    per_layer = sum(held[linear] / n_layers * passes[linear]
                    * (lora.rank * e + (widths[linear] * (e + 1) if lora.dropout else 0)) for linear in targeted_linears(lora))
    extra = int(tokens * per_layer * layers_held)
    return replace(a, saved=a.saved + extra, peak=a.peak + extra)
