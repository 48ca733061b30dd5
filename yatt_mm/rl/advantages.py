"""From rewards to advantages: the group baselines (GRPO, Dr. GRPO, RLOO), REINFORCE++'s returns
normalised over the whole step, and DAPO's soft penalty on responses that near the length limit.

The group baselines need only a group's own rewards, so the controller of each DP group computes
them before balancing; REINFORCE++'s normalisation needs the step's every response token across
DP groups, so the actor finishes it after balancing (`Actor.batch_advantages`).
"""

from __future__ import annotations

from collections import defaultdict

import torch

EPS = 1e-6
ADVANTAGES = ("grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline")
BATCH_NORMALISED = ("reinforce_pp", "reinforce_pp_baseline")  # whitened over the step's tokens by the actor


def advantages(how: str, rewards: torch.Tensor, group_ids: list) -> torch.Tensor:
    """[B] per response, from the rewards of its group (responses to the same prompt):
    grpo: (r - mean) / (std + eps); dr_grpo: r - mean (no std, which favours easy and hard
    prompts); rloo: r - the mean of the group's other rewards; reinforce_pp_baseline: r - mean
    (then whitened over the step); reinforce_pp: r itself (then whitened over the step).
    A group of one has no baseline and gets 0 where one is needed (verl keeps its raw reward)."""
    if how not in ADVANTAGES:
        raise ValueError(f"unknown advantage {how!r}; choose {', '.join(ADVANTAGES)}")
    rewards = rewards.float()
    if how == "reinforce_pp":
        return rewards.clone()
    groups: dict = defaultdict(list)
    for i, g in enumerate(group_ids):
        groups[g].append(i)
    adv = torch.zeros_like(rewards)
    for members in groups.values():
        if len(members) == 1:
            continue
        idx = torch.tensor(members)
        r = rewards[idx]
        centred = r - r.mean()
        if how == "grpo":
            centred = centred / (r.std(unbiased=True) + EPS)
        elif how == "rloo":  # r_i - (sum - r_i) / (n - 1) = n / (n - 1) (r_i - mean)
            centred = centred * len(members) / (len(members) - 1)
        adv[idx] = centred
    return adv


def token_returns(rewards: torch.Tensor, mask: torch.Tensor, kl: torch.Tensor | None = None,
                  kl_coef: float = 0.0, gamma: float = 1.0) -> torch.Tensor:
    """[B, T] REINFORCE++'s return at each response token: the response's reward (given at its
    last token) minus kl_coef x the KL to the reference of this token and those after it (the KL
    as a per-token reward), each discounted by gamma per response token between them. Tokens
    outside the mask (tool replies inside a conversation, padding) are skipped, not counted.
    Zero outside the mask."""
    mask = mask.float()
    if gamma == 1.0:  # the closed form: the reward, minus the KL still ahead
        returns = rewards.float().unsqueeze(1).expand(mask.shape).clone()
        if kl is not None and kl_coef:
            ahead = torch.flip(torch.cumsum(torch.flip(kl * mask, [1]), 1), [1])
            returns = returns - kl_coef * ahead
        return returns * mask
    per_token = torch.zeros_like(mask)
    last = mask * (torch.flip(torch.cumsum(torch.flip(mask, [1]), 1), [1]) == 1)  # each row's last response token
    per_token += last * rewards.float().unsqueeze(1)
    if kl is not None and kl_coef:
        per_token -= kl_coef * kl * mask
    returns = torch.zeros_like(mask)
    running = torch.zeros(mask.shape[0], dtype=mask.dtype)
    for t in reversed(range(mask.shape[1])):
        inside = mask[:, t] > 0
        running = torch.where(inside, per_token[:, t] + gamma * running, running)
        returns[:, t] = running * mask[:, t]
    return returns


def whiten(values: torch.Tensor, mask: torch.Tensor, total: dict[str, float]) -> torch.Tensor:
    """(values - mean) / sqrt(var + 1e-8) on the mask, with the step's mean and unbiased variance
    from `total`'s sums over every micro-batch and DP rank ("sum", "sum_sq", "count"), as verl's
    masked_whiten over one batch. Zero outside the mask."""
    n = max(total["count"], 1.0)
    mean = total["sum"] / n
    var = max(total["sum_sq"] / n - mean * mean, 0.0) * (n / (n - 1) if n > 1 else 1.0)
    return (values - mean) * (var + 1e-8) ** -0.5 * mask


def whiten_sums(values: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """This micro-batch's part of `whiten`'s sums."""
    v = values.double() * mask
    return {"sum": float(v.sum()), "sum_sq": float((v * v).sum()), "count": float(mask.sum())}


def overlong_penalty(length: int, limit: int, buffer: int, penalty: float) -> float:
    """DAPO's soft overlong punishment: 0 up to `limit - buffer` tokens, then falling linearly to
    -penalty at the limit (a truncated response gets the full penalty). buffer 0: off."""
    if buffer <= 0:
        return 0.0
    return min(-(length - (limit - buffer)) / buffer * penalty, 0.0)


def distill_advantages(advantages: torch.Tensor, student_logprobs: torch.Tensor, teacher_logprobs: torch.Tensor,
                       mask: torch.Tensor, coef: float, with_reward: bool) -> torch.Tensor:
    """[B, T] on-policy distillation's advantage (Thinking Machines' "on-policy distillation";
    verl's OPD with the policy-gradient form and the k1 estimator): each sampled token the teacher
    scored (`mask`) gains -coef x its reverse KL estimate, log p_student - log p_teacher, so a
    token the teacher finds likelier than the student does is pushed up, one it finds less likely
    pushed down; per token, nothing summed over the tokens after it (the reference's discount 0).
    Added to the reward's advantage ([B] per response or [B, T] per token), or alone when
    `with_reward` is false (pure distillation). Tokens the teacher did not score keep the reward's
    advantage only."""
    reverse_kl = (student_logprobs - teacher_logprobs) * mask
    if not with_reward:
        return -coef * reverse_kl
    base = advantages if advantages.dim() == 2 else advantages.unsqueeze(1).expand_as(reverse_kl)
    return base - coef * reverse_kl
