"""Training of a Megatron VLM (its model family, models/family.py, builds and converts it): DDP,
Megatron's optimizer, the forward-backward schedule over micro-batches of variable-length
multimodal samples, and HF export.

The trainer knows nothing of RL: it takes micro-batches and a loss function of per-token
logprobs. Call it from every rank after `models.comm.init_parallel()`.

Megatron is imported where it is first used, never at this module's import: the configs import
`TrainerConfig` from here, and `yatt-mm` loading a config (the launcher, `--help-config`, a
config error) would otherwise spend seconds importing megatron.core.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Callable, Literal

import torch

from models.comm import accelerator_device, broadcast_packed, comm
from models.family import family_of, read_spec
from models.inputs import VLMInputs
from models.convert import adapter_buckets
from models.lora import LoRAConfig, adapter_state, adapters_off, add_adapters, peft_config
from models.lora import check_layout as check_lora
from models.offload import HostOffload, optimizer_tensors
from models.optimizer import build_optimizer, inner_optimizers
from models.reshard import reshard, shard_places
from models.logprobs import next_token_labels, token_entropy, token_logprobs


@dataclass
class TrainerConfig:
    tensor_parallel: int = 1  # Megatron tensor-parallel size; the world size must be a multiple of it
    # Megatron pipeline-parallel size: the language model's layers split over this many stages,
    # evenly or as pipeline_layers says (vision tower and embeddings on the first, the output
    # layer and loss on the last)
    pipeline_parallel: int = 1
    # language layers per pipeline stage, e.g. [1, 2] (one entry per stage, each >= 1, adding up
    # to the model's layers): any layer count splits, and fewer layers on the first stage make
    # room for the vision tower's cost. Empty: an even split
    pipeline_layers: list[int] = field(default_factory=list)
    # Megatron expert-parallel size (mixture-of-experts models): each MoE layer's experts split
    # over this many data-parallel ranks (tokens reach them by all-to-all); must divide the
    # experts, and tensor x pipeline x expert parallel must divide the world
    expert_parallel: int = 1
    # context-parallel size (models/context.py): each sequence split over this many ranks in
    # zig-zag chunks (Qwen3.5's DeltaNet layers: heads split by all-to-all, so tensor x context
    # parallel must divide their heads); tensor x context x pipeline parallel must divide the
    # world. Every family
    context_parallel: int = 1
    # how core attention works across the CP ranks (Megatron's cp_comm_type names): all_gather:
    # K and V of the whole rows gathered, kept by every layer; a2a (Ulysses): heads traded for
    # positions by all-to-all, each rank attending over the whole rows for 1/CP of the heads,
    # keeping 1/CP of what all_gather keeps of K/V and no masks (a TP rank's query heads must
    # divide by CP, and its key/value groups divide CP or be divided by it: fewer are copied)
    context_parallel_comm: Literal["all_gather", "a2a"] = "all_gather"
    dtype: Literal["fp32", "bf16"] = "fp32"  # parameter dtype; bf16 uses Megatron's mixed-precision optimizer
    lr: float = 1e-5  # Adam learning rate
    min_lr: float = 0.0  # Megatron OptimizerConfig.min_lr; no decay schedule is run, so no effect yet
    weight_decay: float = 0.0  # Adam(W) weight decay coefficient
    adam_beta1: float = 0.9  # Adam first-moment decay
    adam_beta2: float = 0.999  # Adam second-moment decay
    clip_grad: float = 1.0  # clip the global gradient L2 norm to this; 0 disables
    seed: int = 1234  # Megatron model-parallel RNG seed (SFT; RL seeds it from run.seed)
    # Between its phases (RL: during rollout and judging) the trainer's weights and optimizer state
    # wait in pinned host memory and its gradient buffers are freed. auto: with a GPU, not on CPU
    offload: Literal["auto", "always", "never"] = "auto"
    # activation recompute in the vision tower and the language model (models/qwen2vl/config.py):
    # selective = core attention, full = whole layers; same gradients, less activation memory
    recompute: Literal["none", "selective", "full"] = "none"
    # Megatron's DistributedOptimizer (ZeRO-1): Adam state and fp32 master weights sharded over DP
    distributed_optimizer: bool = True

    # allowed values, checked when a config is loaded (yatt_mm/config.py)
    RANGES = {"tensor_parallel": ">= 1", "pipeline_parallel": ">= 1", "pipeline_layers": ">= 1",
              "expert_parallel": ">= 1", "context_parallel": ">= 1", "lr": "> 0",
              "min_lr": ">= 0", "weight_decay": ">= 0", "adam_beta1": "[0, 1)", "adam_beta2": "[0, 1)", "clip_grad": ">= 0", "seed": ">= 0"}

    def __post_init__(self):
        if self.pipeline_layers and len(self.pipeline_layers) != self.pipeline_parallel:
            raise ValueError(f"pipeline_layers={list(self.pipeline_layers)}: one count per pipeline stage, so "
                             f"{self.pipeline_parallel} entries (pipeline_parallel={self.pipeline_parallel}), "
                             f"not {len(self.pipeline_layers)}")

    @property
    def model_parallel(self) -> int:
        """Ranks one model replica spans: tensor x pipeline parallel."""
        return self.tensor_parallel * self.pipeline_parallel

    def check_world(self, world_size: int, prefix: str) -> None:
        """`prefix`: where these settings live in the config (policy.trainer or trainer)."""
        if world_size < 1 or world_size % self.model_parallel:
            raise ValueError(f"{world_size} ranks: must be a positive multiple of {prefix}.tensor_parallel x "
                             f"{prefix}.pipeline_parallel = {self.tensor_parallel} x {self.pipeline_parallel}")
        if world_size % (self.model_parallel * self.context_parallel):
            raise ValueError(f"{world_size} ranks: must be a multiple of {prefix}.tensor_parallel x "
                             f"{prefix}.pipeline_parallel x {prefix}.context_parallel = {self.tensor_parallel} x "
                             f"{self.pipeline_parallel} x {self.context_parallel}")
        if world_size % (self.model_parallel * self.expert_parallel):
            # the experts spread over DP (x CP) ranks: their number must divide by expert_parallel
            raise ValueError(f"{world_size} ranks: must be a multiple of {prefix}.tensor_parallel x "
                             f"{prefix}.pipeline_parallel x {prefix}.expert_parallel = {self.tensor_parallel} x "
                             f"{self.pipeline_parallel} x {self.expert_parallel}")

    def check_model(self, hf_dir: str, prefix: str) -> None:
        """Whether the model in `hf_dir` splits into this layout (before any rank starts)."""
        spec = read_spec(hf_dir)
        family = family_of(spec)
        self.check_context(spec, prefix)
        if self.expert_parallel > 1 and not getattr(spec, "num_experts", 0):
            raise ValueError(f"{prefix}.expert_parallel={self.expert_parallel}: {hf_dir} has no experts "
                             f"({spec.model_type} is not a mixture-of-experts model)")
        family.check_layout(spec, self.tensor_parallel, self.pipeline_parallel, f"{prefix}.",
                                     tuple(self.pipeline_layers), **self.expert_kwargs)

    def check_context(self, spec, prefix: str) -> None:
        """Whether the model's heads split over this CP layout: the family's own rule (Qwen3.5's
        DeltaNet heads), and a2a's over attention heads."""
        if self.context_parallel == 1:
            return
        from models.context import check_heads

        family = family_of(spec)
        if family.check_context_parallel is not None:
            family.check_context_parallel(spec, self.tensor_parallel, self.context_parallel, f"{prefix}.")
        if self.context_parallel_comm == "a2a":
            check_heads(spec, self.tensor_parallel, self.context_parallel, f"{prefix}.")

    @property
    def expert_kwargs(self) -> dict:
        """What a MoE family's check_layout and build_model take beyond the dense ones'."""
        return {"ep": self.expert_parallel} if self.expert_parallel > 1 else {}

    @property
    def offloads(self) -> bool:
        return self.offload == "always" or (self.offload == "auto" and torch.cuda.is_available())


@dataclass
class MicroBatch:
    """Right-padded samples plus whatever tensors the loss needs (masks, advantages, ...)."""

    inputs: VLMInputs
    extra: dict[str, torch.Tensor] = field(default_factory=dict)
    group_ids: list = field(default_factory=list)  # per row, for group-level loss aggregation
    # [b, s] bool: the positions whose next-token logprob is needed (RL: the response tokens);
    # logprobs (and entropy) elsewhere are 0 and cost nothing. None: every position.
    score_mask: torch.Tensor | None = None
    # run the samples as one packed row (models/packing.py); scores come back in the padded layout
    packed: bool = False

    @property
    def labels(self) -> torch.Tensor:
        return next_token_labels(self.inputs.input_ids)


LossFn = Callable[[torch.Tensor, MicroBatch], tuple[torch.Tensor, dict[str, torch.Tensor]]]


class VLMTrainer:
    """`lora` (models/lora.py, rank > 0): the base frozen, adapters on the language model's
    linears trained (seeded by cfg.seed); `freeze_vision`: the vision tower (and its merger)
    frozen. Frozen parameters get no gradient buffer and no optimizer state."""

    def __init__(self, hf_dir: str, cfg: TrainerConfig, lora: LoRAConfig | None = None, freeze_vision: bool = False):
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads

        self.cfg = cfg
        self.lora = lora if lora is not None and lora.enabled else None
        self.hf_dir = hf_dir
        self.spec = read_spec(hf_dir)
        dtype = torch.bfloat16 if cfg.dtype == "bf16" else torch.float32
        groups = comm()
        self.tp_rank, self.tp_group = groups.tp_rank, groups.tp  # accelerator: the weight gather
        self.dp_cpu, self.dp_size = groups.dp_cpu, groups.dp_size  # CPU: the loss's token counts
        self.pipeline = Pipeline.of(groups)
        if groups.cp_size != cfg.context_parallel:
            raise ValueError(f"context_parallel={cfg.context_parallel} but init_parallel made CP groups of "
                             f"{groups.cp_size} ranks")
        module = build_module(hf_dir, self.spec, cfg)
        if freeze_vision and getattr(module, "vision", None) is not None:  # the first pipeline stage's
            module.vision.requires_grad_(False)
        if self.lora is not None:
            check_lora(self.lora, family_of(self.spec), cfg)
            add_adapters(module, self.lora, cfg.seed)
        self.module = module
        self.config = module.config
        self.model = DistributedDataParallel(
            config=self.config, module=module,
            ddp_config=DistributedDataParallelConfig(grad_reduce_in_fp32=True,
                                                     use_distributed_optimizer=cfg.distributed_optimizer))
        self.config.finalize_model_grads_func = finalize_model_grads  # the DP grad all-reduce
        self.optimizer = build_optimizer(cfg, self.model, dtype)
        self._places: list | None = None  # models/reshard.py: each optimizer shard's place in its parameter
        self.device = accelerator_device()
        self._weights, self._state = HostOffload(), HostOffload()  # what release() moved to the host

    # -- placement ---------------------------------------------------------------------------
    # The trainer is a resource of the RL loop's PhaseRunner like the engines: released while
    # rollout and judging run, acquired for logprobs, training and the weight sync.
    def release(self, keep: str = "none") -> float:
        """With cfg.offload: optimizer state (and fp32 master weights) to host memory and the
        gradient buffers freed; with keep="none" the weights too. Returns seconds."""
        if not self.cfg.offloads:
            return 0.0
        start = time.perf_counter()
        weights = list(self.module.parameters())
        if not self._state.offloaded:
            ours = {t.untyped_storage().data_ptr() for t in weights}  # fp32: the optimizer steps the weights
            state = [t for t in optimizer_tensors(self.optimizer) if t.untyped_storage().data_ptr() not in ours]
            self._state.offload(state, drop=self._grad_buffers())
        if keep == "none" and not self._weights.offloaded:
            self._weights.offload(weights)
        return time.perf_counter() - start

    @property
    def offloaded(self) -> bool:
        """Whether `release()` moved anything to the host that `acquire()` has not brought back."""
        return self._weights.offloaded or self._state.offloaded

    def acquire(self, part: str = "all") -> float:
        """Back on the device after `release()`: the weights, and with part="all" the rest."""
        start = time.perf_counter()
        if self._weights.offloaded:
            self._weights.reload()
        if part == "all" and self._state.offloaded:
            self._state.reload()
        return time.perf_counter() - start

    def device_bytes(self) -> int:
        """Bytes of this rank's weights, gradient buffers and optimizer state now on the device."""
        tensors = list(self.module.parameters()) + optimizer_tensors(self.optimizer) + self._grad_buffers()
        return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())

    def _grad_buffers(self) -> list[torch.Tensor]:
        return [buf.grad_data for buf in self.model.buffers + self.model.expert_parallel_buffers]

    # -- inference ---------------------------------------------------------------------------
    def logprobs(self, micro_batches: list[MicroBatch], with_entropy: bool = False):
        """Per-token logprobs [b, s] of each micro-batch's next tokens (and entropy), on every rank."""
        self.model.eval()
        out = _logprobs(self.model, micro_batches, self.device, with_entropy, self.pipeline, self.cfg.context_parallel_comm)
        self.model.train()
        return out

    def score(self, micro_batches: list[MicroBatch], fn) -> list[dict[str, torch.Tensor]]:
        """`fn(logits, mb)` -> {name: tensor} for each micro-batch, computed without gradients
        where the logits are (the last pipeline stage) and returned on every rank."""
        self.model.eval()
        device = self.device

        from models.context import plan as context_plan

        def compute(model, mb):
            cp = context_plan(mb.inputs.input_ids.shape[1], cp_comm=self.cfg.context_parallel_comm)
            out = _stage_forward(model, mb, device, None, cp)
            if not _module(model).post_process:
                return out
            # context parallelism: `fn` gets the whole sequence's logits (gathered over CP)
            return fn(out if cp is None else cp.gather_sequence(out), mb)

        try:
            return forward_only(self.model, micro_batches, compute, self.pipeline)
        finally:
            self.model.train()

    def checksum(self) -> float:
        """Sum of this rank's parameters in float64: cheap, and changed by any update or load."""
        return float(sum(p.detach().double().sum() for p in self.module.parameters()))

    # -- training ----------------------------------------------------------------------------
    def train_step(self, micro_batches: list[MicroBatch], loss_fn: LossFn, with_entropy: bool = False,
                   entropy_grad: bool = False,
                   before_update: Callable[[dict[str, float]], None] | None = None) -> dict[str, float]:
        """One optimizer step over the micro-batches. `loss_fn(logprobs, mb)` returns this
        micro-batch's share of the loss (already normalised over the whole step, see README).
        With `with_entropy`, the forward's per-token entropy is in `mb.extra["entropy"]` first
        (with `entropy_grad`, with its gradient: an entropy bonus). `before_update(metrics)`, on
        every rank, gets the step's summed loss metrics after the backward pass and before the
        optimizer step: raising there leaves the weights and the optimizer state as they were."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        self.model.train()
        n = len(micro_batches)

        def forward_step(data_iterator, model):
            mb = next(data_iterator)
            out = _forward_scores(model, mb, self.device, with_entropy, entropy_grad, self.cfg.context_parallel_comm)
            if not self.pipeline.last:
                return out, None  # hidden states: the schedule sends them to the next stage
            lp, entropy = out
            if with_entropy:
                mb.extra["entropy"] = entropy
            mb.extra = {k: v.to(lp.device) for k, v in mb.extra.items()}  # the loss's tensors beside the logprobs

            def loss_func(_output):
                loss, metrics = loss_fn(lp, mb)
                # the schedule divides by the number of micro-batches; our loss_fn already
                # normalises over the step, so undo it
                return loss * n, {k: v.detach() for k, v in {"loss": loss, **metrics}.items()}

            return lp, loss_func

        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        _fresh_moe_aux_loss_scale(self.config)
        reduced = get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter(micro_batches), model=[self.model],
            num_microbatches=n, seq_length=max(_tokens(mb) for mb in micro_batches),
            micro_batch_size=1 if micro_batches[0].packed else micro_batches[0].inputs.input_ids.shape[0],
            forward_only=False)
        losses = {f"train/{key}": float(sum(float(r[key]) for r in reduced)) for key in (reduced[0] if reduced else [])}
        losses = self.pipeline.from_last(losses)  # the loss lives on the last stage
        if before_update is not None:
            before_update(losses)
        ok, grad_norm, _ = self.optimizer.step()
        return {"train/grad_norm": float(grad_norm or 0.0), "train/update_skipped": float(not ok)} | losses

    # -- checkpoint state ----------------------------------------------------------------------
    def optimizer_state(self) -> dict:
        """What a checkpoint keeps of this rank's optimizer. The distributed optimizer's own
        state_dict() leaves out the rank's shard (Adam moments, fp32 master weights, which it
        saves through its sharded path): added here, so a rank's file restores it bit for bit."""
        state = {"megatron": self.optimizer.state_dict()}
        if self.cfg.distributed_optimizer:
            if self._places is None:  # fixed for the run: which parameter slice each shard is
                self._places = [shard_places(opt, self.module) for opt in inner_optimizers(self.optimizer)]
            state["shards"] = [{"state": opt.optimizer.state_dict(),
                                "params": [p.detach() for g in opt.optimizer.param_groups for p in g["params"]],
                                "places": places}
                               for opt, places in zip(inner_optimizers(self.optimizer), self._places)]
        return state

    def reshard_optimizer_state(self, saved: list[dict]) -> dict:
        """This rank's optimizer state from the states ranks of another DP size wrote (every old DP
        rank at this rank's TP/PP position, in DP order): with the distributed optimizer each
        parameter's shards put together and cut as this rank owns them (models/reshard.py);
        without it every DP rank held the whole state, and the first one's is it."""
        if not self.cfg.distributed_optimizer:
            return saved[0]
        return reshard(saved, self.optimizer, self.module, inner_optimizers(self.optimizer))

    def load_optimizer_state(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["megatron"])
        for opt, shard in zip(inner_optimizers(self.optimizer), state.get("shards", [])):
            opt.optimizer.load_state_dict(shard["state"])
            with torch.no_grad():
                for p, saved in zip([p for g in opt.optimizer.param_groups for p in g["params"]], shard["params"]):
                    p.copy_(saved)

    def checkpoint_weights(self) -> dict[str, torch.Tensor]:
        """What a checkpoint keeps of this rank's weights: all of them, or with LoRA the adapter
        alone (the frozen base is the policy's HF checkpoint, named by path and hash)."""
        return adapter_state(self.module) if self.lora is not None else self.module.state_dict()

    def load_checkpoint_weights(self, state: dict[str, torch.Tensor]) -> None:
        if self.lora is None:
            self.module.load_state_dict(state)
            return
        live = adapter_state(self.module)
        if set(state) != set(live):
            raise RuntimeError(f"the checkpoint's adapter has {len(state)} tensors, this run's {len(live)} "
                               f"(e.g. {sorted(set(state) ^ set(live))[:3]}): set policy.lora as the run that "
                               "wrote it had it")
        with torch.no_grad():
            for name, p in live.items():
                p.copy_(state[name])

    # -- weights -----------------------------------------------------------------------------
    def export_adapter(self, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        """The LoRA adapter as PEFT names it, whole (gathered over TP and PP), on every rank."""
        return {k: t for bucket in adapter_buckets(self.module, family_of(self.spec), self.tp_group, dtype)
                for k, t in bucket.items()}

    def adapter_config(self) -> dict:
        """adapter_config.json of the adapter (PEFT's), naming the base checkpoint."""
        return peft_config(self.lora, self.hf_dir)

    def export_hf(self, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        """HF-named full tensors of the whole model (gathered over TP and PP), on every rank."""
        return {k: t for bucket in family_of(self.spec).export_hf_buckets(self.module, self.tp_group, dtype, None)
                for k, t in bucket.items()}

    def export_hf_buckets(self, bucket_mb: float, dtype: torch.dtype | None = None):
        """The same tensors as `export_hf`, built and handed out a bucket of ~bucket_mb at a time
        (a collective over TP: every TP rank iterates to the end)."""
        return family_of(self.spec).export_hf_buckets(self.module, self.tp_group, dtype, int(bucket_mb * 2**20))


def _fresh_moe_aux_loss_scale(config) -> None:
    """Megatron (0.16.1) keeps the MoE load-balancing loss's backward scale in a class attribute,
    made by whichever comes first: the schedule's set_loss_scale (a [1] tensor, later updated in
    place) or an aux-loss backward outside the schedule (a 0-d 1.0). After the latter, the next
    training step's in-place update fails ("output with shape [] doesn't match the broadcast shape
    [1]"). Cleared before each step, so the schedule makes its own."""
    if getattr(config, "num_moe_experts", None):
        from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

        MoEAuxLossAutoScaler.main_loss_backward_scale = None


class ReferencePolicy:
    """The frozen starting weights, for the KL penalty: the same Megatron model and parallel
    layout as the trainer's, no gradients, no optimizer. On GPUs it waits in host memory between
    uses, so it costs device memory only while the step's reference logprobs are computed."""

    def __init__(self, hf_dir: str, cfg: TrainerConfig):
        self.device = accelerator_device()
        self.module = build_module(hf_dir, read_spec(hf_dir), cfg).eval().requires_grad_(False)
        self.pipeline = Pipeline.of(comm())
        self.cp_comm = cfg.context_parallel_comm
        self._offload()

    def logprobs(self, micro_batches: list[MicroBatch]) -> list[torch.Tensor]:
        self.module.to(self.device)
        try:
            return _logprobs(self.module, micro_batches, self.device, False, self.pipeline, self.cp_comm)
        finally:
            self._offload()

    def _offload(self) -> None:
        if self.device.type == "cuda":
            self.module.to("cpu")
            torch.cuda.empty_cache()


class BaseWithoutAdapter:
    """The reference policy of a LoRA run: the trainer's own model with its adapters off, so the
    KL penalty needs no second copy of the weights."""

    def __init__(self, trainer: VLMTrainer):
        self.trainer = trainer

    def logprobs(self, micro_batches: list[MicroBatch]) -> list[torch.Tensor]:
        with adapters_off(self.trainer.module):
            return self.trainer.logprobs(micro_batches)


def build_module(hf_dir: str, spec, cfg: TrainerConfig, device: str | torch.device | None = None) -> torch.nn.Module:
    """The Megatron model of `hf_dir` (`spec` read by its family), this rank's TP shard of its
    pipeline stage, on the training device (or `device`)."""
    from megatron.core import parallel_state

    cfg.check_context(spec, "TrainerConfig")  # the launchers check first, naming the config's section
    family = family_of(spec)
    module = family.build_model(spec, torch.bfloat16 if cfg.dtype == "bf16" else torch.float32, cfg.tensor_parallel,
                                cfg.recompute, cfg.pipeline_parallel, tuple(cfg.pipeline_layers), **cfg.expert_kwargs)
    module = module.to(device or accelerator_device())
    family.load_hf_into(module, hf_dir, parallel_state.get_tensor_model_parallel_rank(), cfg.tensor_parallel)
    return module


@dataclass(frozen=True)
class Pipeline:
    """This rank's place in the pipeline (one stage when pipeline_parallel is 1): which stage
    holds the loss, and the CPU group over which its results reach the other stages."""

    size: int
    last: bool
    last_rank: int  # global rank of this rank's counterpart on the last stage
    group: object  # CPU group (models.comm pp_cpu)

    @classmethod
    def of(cls, groups) -> "Pipeline":
        return cls(groups.pp_size, groups.last_stage, groups.pp_peer(groups.pp_size - 1), groups.pp_cpu)

    def from_last(self, values: dict[str, float]) -> dict[str, float]:
        """Floats the last stage computed (the loss and its metrics), on every stage."""
        if self.size == 1:
            return values
        _, meta = broadcast_packed(({}, {"values": json.dumps(values)}) if self.last else None, self.last_rank,
                                   self.group)
        return json.loads(meta["values"])


@torch.no_grad()
def forward_only(model, micro_batches: list[MicroBatch], compute, pipeline: Pipeline) -> list[dict[str, torch.Tensor]]:
    """`compute(model, mb)` for each micro-batch without gradients: on the last pipeline stage it
    returns {name: tensor} (moved to the CPU here), on the others the hidden states to hand on
    (Megatron's schedule runs the stages, forward only). The results reach every rank."""
    if pipeline.size == 1:
        return [{k: v.cpu() for k, v in compute(model, mb).items()} for mb in micro_batches]
    from megatron.core.pipeline_parallel import get_forward_backward_func

    results = []

    def forward_step(data_iterator, model):
        out = compute(model, next(data_iterator))
        if not pipeline.last:
            return out, None
        results.append({k: v.cpu() for k, v in out.items()})
        done = torch.zeros((), device=next(iter(out.values())).device)
        return done, lambda output: (output, {})  # no loss: the schedule only runs the stages

    get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iter(micro_batches), model=[model],
        num_microbatches=len(micro_batches), seq_length=max(_tokens(mb) for mb in micro_batches),
        micro_batch_size=1, forward_only=True)
    flat = {f"{i}/{k}": v for i, r in enumerate(results) for k, v in r.items()}
    flat, _ = broadcast_packed((flat, {}) if pipeline.last else None, pipeline.last_rank, pipeline.group)
    out = [{} for _ in micro_batches]
    for key, value in flat.items():
        i, name = key.split("/", 1)
        out[int(i)][name] = value
    return out


def _logprobs(model, micro_batches: list[MicroBatch], device: torch.device, with_entropy: bool, pipeline: Pipeline,
              cp_comm: str = "all_gather"):
    def compute(model, mb):
        out = _forward_scores(model, mb, device, with_entropy, cp_comm=cp_comm)
        if not _module(model).post_process:
            return out
        lp, entropy = out
        return {"lp": lp} | ({"entropy": entropy} if with_entropy else {})

    scores = forward_only(model, micro_batches, compute, pipeline)
    return [(s["lp"], s["entropy"]) if with_entropy else s["lp"] for s in scores]


def _module(model) -> torch.nn.Module:
    """The family's model inside Megatron's DDP wrapper."""
    return getattr(model, "module", model)


def _stage_forward(model, mb: MicroBatch, device: torch.device, packed=None, cp=None):
    """One pipeline stage's forward of a micro-batch (the whole model without PP): logits on the
    last stage, hidden states elsewhere. Stages after the first take no media. With a
    context-parallel plan `cp`, this rank's chunks of the sequence."""
    inputs = (packed.inputs if packed else mb.inputs)
    if not _module(model).pre_process:
        inputs = inputs.text_only()
    if cp is not None:
        return model(inputs.to(device), cp)
    return model(inputs.to(device), packed.params) if packed else model(inputs.to(device))


def _forward_scores(model, mb: MicroBatch, device: torch.device, with_entropy: bool, entropy_grad: bool = False,
                    cp_comm: str = "all_gather"):
    """The forward pass and its per-token scores [b, s], padded or packed (then scattered back);
    before the last pipeline stage, the hidden states. `cp_comm`: core attention's exchange
    under context parallelism (TrainerConfig.context_parallel_comm)."""
    from models.context import plan as context_plan
    from models.packing import pack

    labels, where = mb.labels, mb.score_mask
    row = pack(mb.inputs) if mb.packed else None
    cp = context_plan((row or mb).inputs.input_ids.shape[1], row.params.cu_seqlens_q if row else None, cp_comm)
    out = _stage_forward(model, mb, device, row, cp)
    if not _module(model).post_process:
        return out
    if cp is not None:  # this rank's chunks scored, then every CP rank gets the whole sequence's scores
        if mb.packed:
            labels, where = labels[row.rows, row.cols][None], None if where is None else where[row.rows, row.cols][None]
        lp, entropy = _token_scores(out, cp.local(labels), cp.local(where, pad_value=False), device, with_entropy,
                                    entropy_grad)
        lp, entropy = cp.gather(lp), cp.gather(entropy) if with_entropy else None
        if not mb.packed:
            return lp, entropy
    elif not mb.packed:
        return _token_scores(out, labels, where, device, with_entropy, entropy_grad)
    else:
        lp, entropy = _token_scores(out, labels[row.rows, row.cols][None],
                                    None if where is None else where[row.rows, row.cols][None], device, with_entropy,
                                    entropy_grad)
    shape = mb.inputs.input_ids.shape
    return row.unpack(lp, shape), row.unpack(entropy, shape) if with_entropy else None


def _token_scores(logits: torch.Tensor, labels: torch.Tensor, where: torch.Tensor | None, device: torch.device,
                  with_entropy: bool, entropy_grad: bool = False):
    """Logprobs of the next tokens `labels` (differentiable) and, optionally, the entropy,
    computed over the vocabulary only where `where` says (the softmax over the vocabulary of
    every prompt token would be most of the work for short RL answers)."""
    labels = labels.to(device)
    if where is None:
        return token_logprobs(logits, labels), token_entropy(logits, entropy_grad) if with_entropy else None
    where = where.to(device)
    picked = logits[where]  # [n, vocab / tp]
    zeros = torch.zeros(labels.shape, dtype=torch.float32, device=device)
    lp = zeros.masked_scatter(where, token_logprobs(picked, labels[where]))
    entropy = zeros.masked_scatter(where, token_entropy(picked, entropy_grad)) if with_entropy else None
    return lp, entropy


def _tokens(mb: MicroBatch) -> int:
    """The sequence length the model sees: the padded width, or a packed row's real tokens (with
    context parallelism, padded to a multiple of 2 x CP; Megatron's schedule divides it by CP)."""
    from models.context import padded_length

    length = int(mb.inputs.attention_mask.sum()) if mb.packed and mb.inputs.attention_mask is not None \
        else mb.inputs.input_ids.shape[1]
    return padded_length(length, comm().cp_size)

