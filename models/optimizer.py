"""The trainer's optimizer: Megatron-Core's (mixed precision, gradient clipping, the distributed
optimizer), with the fast torch kernels where Megatron falls back to per-tensor Python loops.

Without Transformer Engine or Apex (always on CPU; on GPUs where neither is installed) Megatron
steps torch's AdamW with its default per-tensor implementation and computes the gradient norm
and the clipping with a Python loop over every tensor. torch has one-pass kernels for both, on
CPU and CUDA alike: the fused AdamW (the same update; measured here 15 ms -> 10 ms a step on the
tiny model) and `_foreach_norm` / `_foreach_mul_`. With Transformer Engine or Apex present,
Megatron's own fused kernels are used and nothing here changes them.
"""

from __future__ import annotations

import torch


def build_optimizer(cfg, model, dtype: torch.dtype):
    """Megatron's optimizer over the DDP-wrapped `model` for a TrainerConfig `cfg`."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    use_fast_fallbacks()
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=cfg.lr, min_lr=cfg.min_lr, weight_decay=cfg.weight_decay,
                        adam_beta1=cfg.adam_beta1, adam_beta2=cfg.adam_beta2, clip_grad=cfg.clip_grad,
                        bf16=dtype == torch.bfloat16, params_dtype=dtype,
                        use_distributed_optimizer=cfg.distributed_optimizer),
        [model])
    for inner in inner_optimizers(optimizer):
        if isinstance(inner.optimizer, torch.optim.Adam | torch.optim.AdamW):  # torch's: Megatron found no TE/Apex
            for group in inner.optimizer.param_groups:
                group["foreach"], group["fused"] = False, True
    return optimizer


def inner_optimizers(optimizer) -> list:
    """The Megatron optimizers a chained one holds (or itself)."""
    return getattr(optimizer, "chained_optimizers", None) or [optimizer]


def use_fast_fallbacks() -> None:
    """Replace Megatron's per-tensor fallbacks for Apex's multi-tensor norm and scale (used by
    gradient clipping and bf16 weight copies) with torch's foreach ops. Idempotent."""
    import megatron.core.optimizer.clip_grads as clip_grads
    import megatron.core.optimizer.optimizer as optimizer
    from megatron.core.utils import local_multi_tensor_l2_norm, local_multi_tensor_scale

    for module in (clip_grads, optimizer):
        if getattr(module, "l2_norm_impl", None) is local_multi_tensor_l2_norm:
            module.l2_norm_impl = foreach_l2_norm
        if getattr(module, "multi_tensor_scale_impl", None) is local_multi_tensor_scale:
            module.multi_tensor_scale_impl = foreach_scale


def foreach_l2_norm(chunk_size, noop_flag, tensor_lists, per_tensor, *args):
    """Apex's multi_tensor_l2norm: the L2 norm of all tensors of the first list together."""
    norms = torch._foreach_norm(tensor_lists[0])
    return torch.linalg.vector_norm(torch.stack(norms)).reshape(1).float(), None


def foreach_scale(chunk_size, noop_flag, tensor_lists, scale):
    """Apex's multi_tensor_scale: dst = src * scale, list by list."""
    src, dst = tensor_lists
    if all(a is b for a, b in zip(src, dst)):
        torch._foreach_mul_(dst, scale)
        return
    torch._foreach_copy_(dst, src)
    torch._foreach_mul_(dst, scale)
