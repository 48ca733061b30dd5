"""GRPO-family advantages, the PPO-clip policy loss and the KL penalty to a frozen reference,
on padded [batch, tokens] tensors.

Chosen by name in config (`algorithm.advantage: grpo | dr_grpo`, `algorithm.loss_agg:
token | sequence | group`, `algorithm.kl_estimator: k1 | k2 | k3`, `algorithm.kl_in: loss | reward`). Everything here is plain torch on already-computed logprobs, so it
runs unchanged under tensor parallelism: the vocab-parallel logprob is computed upstream.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Literal

import torch

EPS = 1e-6


@dataclass
class AlgorithmConfig:
    advantage: Literal["grpo", "dr_grpo"] = "grpo"  # dr_grpo: no division by the group std
    loss_agg: Literal["token", "sequence", "group"] = "token"  # loss mean over all tokens | per response | per group
    clip_low: float = 0.2  # PPO ratio clipped below at 1 - clip_low
    clip_high: float = 0.28  # DAPO's clip-higher: room for low-probability tokens to rise
    kl_coef: float = 0.0  # weight of the KL penalty to the reference policy (the starting weights); 0: no reference
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"  # k1: log-ratio; k2: half its square; k3: verl's low_var_kl
    kl_in: Literal["loss", "reward"] = "loss"  # loss: per-token penalty term; reward: subtracted from the reward
    mini_batches: int = 1  # optimizer steps per pass over the step's samples (PPO mini-batches of whole groups)
    epochs: int = 1  # passes over the step's samples; old logprobs stay the rollout policy's, so ratios move
    is_correction: bool = True  # reweight by trainer/rollout probability ratio (truncated)
    is_cap: float = 2.0  # upper clamp on the trainer/rollout IS weight

    RANGES = {"clip_low": "[0, 1]", "clip_high": ">= 0", "kl_coef": ">= 0", "mini_batches": ">= 1", "epochs": ">= 1",
              "is_cap": "> 0"}


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) from the sampled tokens' logprobs
    (Schulman's k1, k2, k3). k3 = r - 1 - log r with r = p_ref / p: unbiased, never negative,
    low variance; clamped like verl's low_var_kl so one wild token cannot dominate a step."""
    log_ratio = logprobs - ref_logprobs  # log p / p_ref
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio.square()
    if estimator == "k3":
        neg = (-log_ratio).clamp(-20.0, 20.0)
        return (torch.exp(neg) - neg - 1).clamp(max=10.0)
    raise ValueError(f"unknown KL estimator {estimator!r}; choose k1, k2 or k3")


def sequence_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, mask: torch.Tensor, estimator: str) -> torch.Tensor:
    """[B] summed per-token KL of each response: what `kl_in: reward` subtracts (times kl_coef)."""
    return (kl_penalty(logprobs, ref_logprobs, estimator) * mask).sum(1)


def group_advantages(rewards: torch.Tensor, group_ids: list, normalize_std: bool = True) -> torch.Tensor:
    """(reward - group mean) [/ (group std + eps)] per response; a group of one gets 0."""
    groups: dict = defaultdict(list)
    for i, g in enumerate(group_ids):
        groups[g].append(i)
    adv = torch.zeros_like(rewards, dtype=torch.float32)
    for members in groups.values():
        idx = torch.tensor(members)
        r = rewards[idx].float()
        if len(members) == 1:
            continue
        centred = r - r.mean()
        if normalize_std:
            centred = centred / (r.std(unbiased=True) + EPS)
        adv[idx] = centred
    return adv


def advantages(cfg: AlgorithmConfig, rewards: torch.Tensor, group_ids: list) -> torch.Tensor:
    return group_advantages(rewards, group_ids, normalize_std=cfg.advantage == "grpo")


@dataclass
class LossOutput:
    loss: torch.Tensor
    clip_fraction: torch.Tensor
    kl: torch.Tensor
    is_weight_mean: torch.Tensor


def policy_loss(
    cfg: AlgorithmConfig,
    logprobs: torch.Tensor,  # [B, T] trainer, current weights (requires grad)
    old_logprobs: torch.Tensor,  # [B, T] trainer, weights that generated the batch
    advantages: torch.Tensor,  # [B] one scalar per response
    mask: torch.Tensor,  # [B, T] 1 on response tokens
    rollout_logprobs: torch.Tensor | None = None,  # [B, T] vLLM's, for the IS correction
    ref_logprobs: torch.Tensor | None = None,  # [B, T] frozen reference, for the KL term
    group_ids: list | None = None,
    normalizer: float | None = None,  # see aggregate()
) -> LossOutput:
    mask = mask.float()
    ratio = torch.exp(logprobs - old_logprobs)
    adv = advantages.unsqueeze(1).float()
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1 - cfg.clip_low, 1 + cfg.clip_high) * adv
    per_token = -torch.minimum(unclipped, clipped)

    is_weight = torch.ones_like(per_token)
    if cfg.is_correction and rollout_logprobs is not None:
        # Sampler and trainer compute slightly different probabilities (kernels, precision);
        # truncated importance sampling corrects the off-policy gap without exploding variance.
        is_weight = torch.exp(old_logprobs - rollout_logprobs).clamp(max=cfg.is_cap).detach()
        per_token = per_token * is_weight

    kl = torch.zeros((), dtype=per_token.dtype)
    if cfg.kl_coef > 0 and cfg.kl_in == "loss":
        if ref_logprobs is None:
            raise ValueError("algorithm.kl_coef > 0 needs reference logprobs (a frozen reference model)")
        kl_tok = kl_penalty(logprobs, ref_logprobs, cfg.kl_estimator)
        per_token = per_token + cfg.kl_coef * kl_tok
        kl = _masked_mean(kl_tok, mask)

    loss = aggregate(per_token, mask, cfg.loss_agg, group_ids, normalizer)
    clip_fraction = _masked_mean(((ratio - 1).abs() > cfg.clip_low).float(), mask)
    return LossOutput(loss, clip_fraction.detach(), kl.detach(), _masked_mean(is_weight, mask))


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, how: str, group_ids: list | None = None,
              normalizer: float | None = None) -> torch.Tensor:
    """token: mean over all response tokens (long answers weigh more, DAPO); sequence: mean per
    response, then over responses (GRPO paper); group: token mean within a prompt's group, then
    mean over groups.

    With `normalizer`, the final mean divides by it instead of the local count (tokens,
    responses or groups): a step spread over micro-batches and DP ranks passes the global count
    so every micro-batch's share adds up to the step's mean."""
    if how == "token":
        if normalizer is not None:
            return (per_token * mask).sum() / normalizer
        return _masked_mean(per_token, mask)
    per_seq_sum = (per_token * mask).sum(1)
    lengths = mask.sum(1)
    if how == "sequence":
        per_seq = (per_seq_sum / lengths.clamp(min=1))[lengths > 0]
        return per_seq.sum() / normalizer if normalizer is not None else per_seq.mean()
    if how == "group":
        if group_ids is None:
            raise ValueError("loss_agg 'group' needs group ids")
        groups: dict = defaultdict(list)
        for i, g in enumerate(group_ids):
            groups[g].append(i)
        means = [per_seq_sum[idx].sum() / lengths[idx].sum()
                 for idx in (torch.tensor(m) for m in groups.values()) if lengths[idx].sum() > 0]
        if not means:
            return per_token.sum() * 0.0
        total = torch.stack(means)
        return total.sum() / normalizer if normalizer is not None else total.mean()
    raise ValueError(f"unknown loss aggregation {how!r}; choose token, sequence or group")


def loss_normalizer(masks: list[torch.Tensor], group_ids: list[list], how: str) -> float:
    """This rank's count that `aggregate(..., how)` takes the mean over, across all of a step's
    micro-batches: response tokens, responses, or groups (a group may span micro-batches).
    Summed over DP ranks, it is the `normalizer` that makes micro-batching and DP invisible."""
    if how == "token":
        return sum(float(m.sum()) for m in masks)
    if how == "sequence":
        return sum(float((m.sum(1) > 0).sum()) for m in masks)
    return float(len({g for m, ids in zip(masks, group_ids) for g, n in zip(ids, m.sum(1)) if n > 0}))


def _masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (x * mask).sum() / mask.sum().clamp(min=1)
