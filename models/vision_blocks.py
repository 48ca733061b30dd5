"""A vision tower's Megatron blocks run one by one (Qwen2.5-VL's window and frame blocks,
Qwen3-VL's DeepStack taps) instead of through Megatron's TransformerBlock: under
`recompute: full` each block is checkpointed as that block would do it, so only its input is
kept for the backward pass (run plainly, a tower kept every block's activations under full
recompute: the tiny Qwen3-VL's tower 1.07 MB with or without it, 0.42 MB now)."""

from __future__ import annotations

from collections.abc import Callable

import torch


def run_block(config, block: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor) -> torch.Tensor:
    """block(hidden) -> hidden; checkpointed when `config` (the tower's TransformerConfig) asks
    for full recompute and autograd is recording."""
    if config.recompute_granularity == "full" and torch.is_grad_enabled():
        from megatron.core import tensor_parallel

        return tensor_parallel.checkpoint(block, False, hidden)
    return block(hidden)
