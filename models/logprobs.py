"""Per-token log-probabilities and entropy from vocab-parallel logits, without gathering the
full vocabulary: each tensor-parallel rank holds logits for its slice of the vocabulary and only
per-token scalars cross ranks."""

from __future__ import annotations

import torch
import torch.distributed as dist


def token_logprobs(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """log p(labels) for logits [..., vocab / tp] and labels [...]; differentiable."""
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    # vocab_parallel_cross_entropy writes into its logits argument: give it a copy.
    return -vocab_parallel_cross_entropy(logits.float().clone(), labels)


def token_entropy(logits: torch.Tensor, differentiable: bool = False) -> torch.Tensor:
    """Entropy of the full distribution per token, from vocab-parallel logits; with
    `differentiable`, with its gradient (an entropy bonus in the loss)."""
    with torch.set_grad_enabled(differentiable and torch.is_grad_enabled()):
        x = logits.float()
        m, (z, ex) = _vocab_sums(x, with_mean=True, differentiable=differentiable)
        return torch.log(z) + m - ex / z


@torch.no_grad()
def label_is_argmax(logits: torch.Tensor, labels: torch.Tensor, tol: float = 1e-5) -> torch.Tensor:
    """Per token, whether the label is the most likely token (what greedy decoding would pick),
    from vocab-parallel logits: the largest logprob is -log sum exp(x - max x)."""
    _, (z,) = _vocab_sums(logits.float())
    return token_logprobs(logits, labels) >= -torch.log(z) - tol


def _vocab_sums(x: torch.Tensor, with_mean: bool = False, differentiable: bool = False):
    """Over the full vocabulary (the TP ranks' slices together): the max logit m per token, and
    sum exp(x - m) (with `with_mean`, also sum exp(x - m) * x), as [k, ...] scalars per token.
    With `differentiable`, the sums keep their gradient: the all-reduce passes it back unchanged
    to each rank's slice (every rank's loss is the same function of the summed values), and m
    is a constant (the entropy does not depend on it)."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import reduce_from_tensor_model_parallel_region

    group = parallel_state.get_tensor_model_parallel_group()
    tp = parallel_state.get_tensor_model_parallel_world_size()
    m = x.detach().max(-1, keepdim=True).values
    if tp > 1:
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
    e = torch.exp(x - m)
    sums = torch.stack([e.sum(-1), (e * x).sum(-1)] if with_mean else [e.sum(-1)])
    if tp > 1:
        if differentiable:
            sums = reduce_from_tensor_model_parallel_region(sums)
        else:
            dist.all_reduce(sums, group=group)
    return m.squeeze(-1), sums


def next_token_labels(input_ids: torch.Tensor, pad_id: int = 0) -> torch.Tensor:
    """Labels aligned with logits: position t predicts token t + 1 (the last one predicts pad)."""
    labels = torch.full_like(input_ids, pad_id)
    labels[:, :-1] = input_ids[:, 1:]
    return labels
