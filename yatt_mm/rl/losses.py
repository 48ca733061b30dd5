"""The policy loss of an RL step on padded [batch, tokens] tensors: PPO's clipped surrogate (with
dual-clip), GSPO's sequence-level ratio (and its token form), CISPO's clipped IS weight, SAPO's
soft gate, GMPO's geometric mean, the rollout correction of the trainer/sampler mismatch
(truncated, masked, or IcePop), the KL penalty to a frozen reference, the entropy bonus, and the
aggregations that turn per-token losses into the step's loss.

Everything here is plain torch on already-computed logprobs, so it runs unchanged under tensor
and pipeline parallelism (the vocab-parallel logprob is computed upstream). The definitions
follow the papers and verl's `core_algos` (docs/rl.md has the table); where they differ, the
docstring says so.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import torch

# exp() of a log-ratio beyond this is inf in fp32 and meaningless anyway: one stale or corrupted
# logprob must not blow up a step (verl clamps at the same value).
LOG_RATIO_CLAMP = 20.0
# GSPO's sequence ratio is clamped above at exp(10) before exp, as verl does
GSPO_LOG_RATIO_MAX = 10.0
POLICY_LOSSES = ("ppo", "gspo", "gspo_token", "cispo", "sapo", "gmpo")


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
        neg = (-log_ratio).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        return (torch.exp(neg) - neg - 1).clamp(max=10.0)
    raise ValueError(f"unknown KL estimator {estimator!r}; choose k1, k2 or k3")


def sequence_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, mask: torch.Tensor, estimator: str) -> torch.Tensor:
    """[B] summed per-token KL of each response: what `kl_in: reward` subtracts (times kl_coef)."""
    return (kl_penalty(logprobs, ref_logprobs, estimator) * mask).sum(1)


@dataclass
class LossOutput:
    """The micro-batch's share of the step's loss, and detached per-token sums over its loss
    tokens (`tokens` of them) for the step's metrics: the actor adds them over micro-batches and
    optimizer steps, and divides by the tokens."""

    loss: torch.Tensor
    tokens: torch.Tensor
    sums: dict[str, torch.Tensor] = field(default_factory=dict)

    def mean(self, name: str) -> float:
        return float(self.sums[name] / self.tokens.clamp(min=1))


def ppo_clip(log_ratio: torch.Tensor, adv: torch.Tensor, clip_low: float, clip_high: float,
             clip_ratio_c: float) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO's clipped surrogate per token (a loss: lower is better), with dual-clip for negative
    advantages (Ye et al. 2020): the loss of a token whose ratio ran far above 1 under a negative
    advantage is capped at -A * clip_ratio_c instead of growing with the ratio. Returns the loss
    and where each clip binds: high (A > 0, r > 1 + clip_high), low (A < 0, r < 1 - clip_low),
    dual (A < 0, -A * r > -A * clip_ratio_c)."""
    ratio = torch.exp(log_ratio)
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1 - clip_low, 1 + clip_high)
    per_token = torch.maximum(unclipped, clipped)
    binds = {"clip_high": (adv > 0) & (ratio > 1 + clip_high), "clip_low": (adv < 0) & (ratio < 1 - clip_low)}
    if clip_ratio_c > 0:
        cap = -adv * clip_ratio_c
        binds["clip_dual"] = (adv < 0) & (per_token > cap)
        per_token = torch.where(adv < 0, torch.minimum(per_token, cap), per_token)
    return per_token, binds


def gspo(log_ratio: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor, clip_low: float, clip_high: float,
         token_form: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GSPO (Zheng et al. 2025): one importance ratio per response, s = exp(mean token
    log-ratio), clipped per response to [1 - clip_low, 1 + clip_high] (a narrow range: it is a
    geometric mean). The sequence form puts the response's loss on each of its tokens (a mean
    per response gives it back); the token form (GSPO-token) uses s_t = sg[s] * p_t / sg[p_t],
    equal in value, with a per-token advantage allowed; both have the same gradient when the
    advantage is the response's."""
    lengths = mask.sum(1).clamp(min=1)
    seq_log_ratio = (log_ratio * mask).sum(1) / lengths  # [B]
    if token_form:
        log_s = (log_ratio - log_ratio.detach() + seq_log_ratio.detach().unsqueeze(1)).clamp(max=GSPO_LOG_RATIO_MAX)
        a = adv
    else:
        log_s = seq_log_ratio.clamp(max=GSPO_LOG_RATIO_MAX).unsqueeze(1).expand_as(log_ratio)
        a = ((adv * mask).sum(1) / lengths).unsqueeze(1).expand_as(log_ratio)  # the response's advantage
    s = torch.exp(log_s)
    per_token = torch.maximum(-a * s, -a * torch.clamp(s, 1 - clip_low, 1 + clip_high))
    return per_token, {"clip_high": (a > 0) & (s > 1 + clip_high), "clip_low": (a < 0) & (s < 1 - clip_low)}


def cispo(log_ratio: torch.Tensor, logprobs: torch.Tensor, adv: torch.Tensor, clip_low: float,
          clip_high: float) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """CISPO (MiniMax-M1, 2025): REINFORCE with the importance weight clipped and detached,
    -sg(clip(r, 1 - clip_low, 1 + clip_high)) * A * log p. Unlike PPO's clip, no token's gradient
    is dropped: a clipped token still moves its logprob, with a bounded weight."""
    ratio = torch.exp(log_ratio)
    weight = torch.clamp(ratio, 1 - clip_low, 1 + clip_high).detach()
    return -weight * adv * logprobs, {"clip_high": ratio > 1 + clip_high, "clip_low": ratio < 1 - clip_low}


def sapo(log_ratio: torch.Tensor, adv: torch.Tensor, tau_pos: float,
         tau_neg: float) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """SAPO (Qwen, 2025): a soft, temperature-controlled gate in place of the hard clip,
    -f(r) * A with f(r) = sigmoid(tau (r - 1)) * 4 / tau, tau_pos for positive advantages and
    tau_neg (larger: a negative update fades faster) otherwise. At r = 1 its gradient equals the
    unclipped surrogate's; far from 1 it decays smoothly instead of stopping."""
    ratio = torch.exp(log_ratio)
    tau = torch.where(adv > 0, torch.as_tensor(tau_pos, dtype=adv.dtype), torch.as_tensor(tau_neg, dtype=adv.dtype))
    gate = torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)
    nothing = torch.zeros_like(ratio, dtype=torch.bool)
    return -gate * adv, {"clip_high": nothing, "clip_low": nothing}


def gmpo(log_ratio: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor, clip_low: float,
         clip_high: float) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GMPO (Zhao et al. 2025): one ratio per response, the geometric mean of its tokens' ratios,
    each token's log-ratio clipped to [-clip_low, clip_high] on the side its advantage would push
    (PPO's pessimism, token by token, in log space); the response's loss -A * ratio on each of
    its tokens (the mean per response gives it back). Less sensitive to one outlier token than
    the arithmetic mean of PPO."""
    sign = torch.sign(adv)
    clipped = log_ratio.clamp(-clip_low, clip_high)
    pessimistic = sign * torch.minimum(sign * log_ratio, sign * clipped)
    lengths = mask.sum(1).clamp(min=1)
    ratio = torch.exp((pessimistic * mask).sum(1) / lengths)  # [B]
    a = (adv * mask).sum(1) / lengths  # the response's advantage
    per_token = (-a * ratio).unsqueeze(1).expand_as(log_ratio)
    moved = log_ratio != clipped
    return per_token, {"clip_high": moved & (adv > 0), "clip_low": moved & (adv < 0)}


def rollout_correction(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor, level: str,
                       mode: str, threshold: float, band: tuple[float, float] = (0.5, 5.0)) -> torch.Tensor:
    """The weight [B, T] (detached) that corrects for the sampler's probabilities differing from
    the trainer's (kernels, precision, or an older policy for dynamic sampling's buffer): the
    trainer/rollout ratio per token, or per response (the product over its tokens). `truncate`
    caps it at `threshold` (TIS); `mask` is 1 where the ratio lies within [1 / threshold,
    threshold] and 0 elsewhere (a rejection: `policy_loss` takes it out of the loss mask);
    `icepop` (token level) keeps the ratio itself inside `band` = [alpha, beta] and 0 outside."""
    log_w = (old_logprobs - rollout_logprobs).detach()
    if level == "sequence":
        if mode == "icepop":
            raise ValueError("rollout_correction.mode icepop is per token: set rollout_correction.level token")
        log_w = (log_w * mask).sum(1, keepdim=True).expand_as(log_w)
    elif level != "token":
        raise ValueError(f"unknown rollout_correction.level {level!r}; choose none, token or sequence")
    w = torch.exp(log_w.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    if mode == "truncate":
        return w.clamp(max=threshold)
    if mode == "mask":
        return ((w <= threshold) & (w >= 1 / threshold)).float()
    if mode == "icepop":
        return w * ((w >= band[0]) & (w <= band[1])).float()
    raise ValueError(f"unknown rollout_correction.mode {mode!r}; choose truncate, mask or icepop")


def mismatch_kl(rollout_logprobs: torch.Tensor, old_logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Summed k3 estimate of KL(rollout || trainer) on the sampler's tokens, r - 1 - log r with
    r = p_trainer / p_rollout: unclamped (in float64), so the large mismatches it is there to
    show are not cut off."""
    log_r = (old_logprobs.detach() - rollout_logprobs).double()
    return ((torch.exp(log_r) - log_r - 1) * mask).sum()


def policy_loss(
    cfg,  # AlgorithmConfig (yatt_mm/rl/algorithms.py)
    logprobs: torch.Tensor,  # [B, T] trainer, current weights (requires grad)
    old_logprobs: torch.Tensor,  # [B, T] trainer, weights that generated the batch
    advantages: torch.Tensor,  # [B] one scalar per response, or [B, T] per token (REINFORCE++)
    mask: torch.Tensor,  # [B, T] 1 on response tokens in the loss
    rollout_logprobs: torch.Tensor | None = None,  # [B, T] vLLM's, for the rollout correction
    ref_logprobs: torch.Tensor | None = None,  # [B, T] frozen reference, for the KL term
    entropy: torch.Tensor | None = None,  # [B, T] differentiable, for the entropy bonus
    group_ids: list | None = None,
    normalizer: float | None = None,  # see aggregate()
) -> LossOutput:
    mask = mask.float()
    adv = (advantages if advantages.dim() == 2 else advantages.unsqueeze(1)).float().expand_as(logprobs)
    correction = cfg.rollout_correction
    corrected = correction.level != "none" and rollout_logprobs is not None
    weight = None
    if corrected:
        weight = rollout_correction(old_logprobs, rollout_logprobs, mask, correction.level, correction.mode,
                                    correction.threshold, (correction.icepop_low, correction.icepop_high))
        if correction.mode == "mask":  # a rejection replaces the loss mask: rejected tokens leave every count
            mask, weight = mask * weight, None
    raw = logprobs - old_logprobs
    log_ratio = raw.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    if cfg.policy_loss == "ppo":
        per_token, binds = ppo_clip(log_ratio, adv, cfg.clip_low, cfg.clip_high, cfg.clip_ratio_c)
    elif cfg.policy_loss in ("gspo", "gspo_token"):
        # the sequence mean of the unclamped log-ratios, bounded only at the sequence level (as the
        # reference): a per-token clamp would let one wild token change the response's ratio
        log_ratio = raw
        per_token, binds = gspo(raw, adv, mask, cfg.gspo_clip_low, cfg.gspo_clip_high,
                                token_form=cfg.policy_loss == "gspo_token")
    elif cfg.policy_loss == "cispo":
        per_token, binds = cispo(log_ratio, logprobs, adv, cfg.cispo_clip_low, cfg.cispo_clip_high)
    elif cfg.policy_loss == "sapo":
        per_token, binds = sapo(log_ratio, adv, cfg.sapo_tau_pos, cfg.sapo_tau_neg)
    elif cfg.policy_loss == "gmpo":
        log_ratio = raw  # clipped token by token inside, in log space
        per_token, binds = gmpo(raw, adv, mask, cfg.gmpo_clip_low, cfg.gmpo_clip_high)
    else:
        raise ValueError(f"unknown policy_loss {cfg.policy_loss!r}; choose {', '.join(POLICY_LOSSES)}")

    sums = {name: (b.float() * mask).sum() for name, b in binds.items()}
    sums["clip"] = sums["clip_high"] + sums["clip_low"]
    sums["ppo_kl"] = (-log_ratio * mask).sum()  # k1 estimate of KL(old || new) on the old policy's samples
    if weight is not None:
        per_token = per_token * weight
        sums["is_weight"] = (weight * mask).sum()
    if rollout_logprobs is not None:  # KL(rollout || trainer), k3 on the sampler's tokens
        sums["mismatch_kl"] = mismatch_kl(rollout_logprobs, old_logprobs, mask).to(per_token.dtype)

    if cfg.kl_coef > 0 and cfg.kl_in == "loss":
        if ref_logprobs is None:
            raise ValueError("algorithm.kl_coef > 0 needs reference logprobs (a frozen reference model)")
        kl_tok = kl_penalty(logprobs, ref_logprobs, cfg.kl_estimator)
        per_token = per_token + cfg.kl_coef * kl_tok
        sums["kl"] = (kl_tok.detach() * mask).sum()
    if cfg.entropy_coef:
        if entropy is None:
            raise ValueError("algorithm.entropy_coef needs the training forward's entropy (with gradients)")
        per_token = per_token - cfg.entropy_coef * entropy

    loss = aggregate(per_token, mask, cfg.aggregation, group_ids, normalizer, cfg.loss_norm_tokens)
    return LossOutput(loss, mask.sum(), {k: v.detach() for k, v in sums.items()})


AGGREGATIONS = ("token", "sequence", "group", "token_sum_norm", "token_sum", "sequence_token_sum")


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, how: str, group_ids: list | None = None,
              normalizer: float | None = None, norm_tokens: int = 0) -> torch.Tensor:
    """token: mean over all response tokens (long answers weigh more, DAPO); sequence: mean per
    response, then over responses (GRPO paper); group: token mean within a prompt's group, then
    mean over groups; token_sum_norm: each response's token sum over a constant `norm_tokens`,
    then mean over responses (Dr. GRPO: no length bias either way); token_sum: the sum over every
    response token, no mean at all (verl's token-sum); sequence_token_sum: each response's token
    sum, then mean over responses (verl's seq-mean-token-sum).

    With `normalizer`, the final mean divides by it instead of the local count (tokens,
    responses or groups; for token_sum, DP's share, see `loss_normalizer`): a step spread over
    micro-batches and DP ranks passes the global count so every micro-batch's share adds up to
    the step's value."""
    if how == "token":
        if normalizer is not None:
            return (per_token * mask).sum() / normalizer
        return _masked_mean(per_token, mask)
    if how == "token_sum":
        return (per_token * mask).sum() / (normalizer if normalizer is not None else 1.0)
    per_seq_sum = (per_token * mask).sum(1)
    lengths = mask.sum(1)
    responses = normalizer if normalizer is not None else max(float((lengths > 0).sum()), 1.0)
    if how == "token_sum_norm":
        if norm_tokens <= 0:
            raise ValueError("loss_agg token_sum_norm needs algorithm.loss_norm_tokens > 0 (default: the response limit)")
        return per_seq_sum.sum() / (responses * norm_tokens)
    if how == "sequence_token_sum":
        return per_seq_sum.sum() / responses
    if how == "sequence":
        per_seq = (per_seq_sum / lengths.clamp(min=1))[lengths > 0]
        if normalizer is not None:
            return per_seq.sum() / normalizer
        return per_seq.mean() if per_seq.numel() else per_token.sum() * 0.0
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
    raise ValueError(f"unknown loss aggregation {how!r}; choose {', '.join(AGGREGATIONS)}")


def loss_normalizer(masks: list[torch.Tensor], group_ids: list[list], how: str) -> float:
    """This rank's count that `aggregate(..., how)` takes the mean over, across all of a step's
    micro-batches: response tokens, responses, or groups (a group may span micro-batches).
    Summed over DP ranks, it is the `normalizer` that makes micro-batching and DP invisible.
    token_sum takes no mean: its count is 1 for the whole step (each rank's share 1 / DP, so
    that DP's gradient average gives back the sum)."""
    if how == "token":
        return sum(float(m.sum()) for m in masks)
    if how == "token_sum":
        return 0.0  # see `step_normalizer`
    if how in ("sequence", "token_sum_norm", "sequence_token_sum"):
        return sum(float((m.sum(1) > 0).sum()) for m in masks)
    return float(len({g for m, ids in zip(masks, group_ids) for g, n in zip(ids, m.sum(1)) if n > 0}))


def step_normalizer(how: str, dp_total: float, dp_size: int) -> float:
    """The `normalizer` of one DP rank's micro-batches: the step's count over every rank
    (`loss_normalizer` summed over DP) divided by DP, which DP's gradient average multiplies
    back; token_sum's step count is 1."""
    return (1.0 if how == "token_sum" else max(dp_total, 1.0)) / dp_size


def _masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (x * mask).sum() / mask.sum().clamp(min=1)
