"""The policy side of an RL step: the step's samples as micro-batches, the trainer's logprobs of
them under the weights that sampled them (the old policy), and the policy-gradient update.

The loss of every micro-batch is its share of the step's mean (`algorithms.aggregate` with the
normaliser summed over DP ranks), so micro-batching and data parallelism leave the gradient
unchanged.
"""

from __future__ import annotations

import torch

from models.trainer import MicroBatch, VLMTrainer
from yatt_mm.rl.algorithms import AlgorithmConfig, loss_normalizer, policy_loss
from yatt_mm.rl.distributed import sum_across
from yatt_mm.rl.samples import TrainSample, micro_batches


# The measured trainer/vLLM gap is ~1e-7..1e-6 in fp32 (README); bf16 training against vLLM's own
# precision is far noisier. A gap above these means vLLM sampled with other weights.
DEFAULT_MAX_LOGPROB_DIFF = {"fp32": 1e-3, "bf16": 0.1}


class Actor:
    def __init__(self, trainer: VLMTrainer, algorithm: AlgorithmConfig, micro_batch_tokens: int, pad_id: int,
                 max_logprob_diff: float = 0.0):
        self.trainer = trainer
        self.algorithm = algorithm
        self.micro_batch_tokens = micro_batch_tokens
        self.pad_id = pad_id
        self.max_logprob_diff = max_logprob_diff or DEFAULT_MAX_LOGPROB_DIFF[trainer.cfg.dtype]

    def micro_batches(self, samples: list[TrainSample]) -> list[MicroBatch]:
        if not samples:
            raise RuntimeError("a DP rank ended a step with no training samples: rollout.prompts_per_step must be "
                               ">= 1 and the data must not run dry (see the quarantine log)")
        return micro_batches(samples, self.micro_batch_tokens, self.trainer.spec, self.pad_id)

    def old_logprobs(self, mbs: list[MicroBatch]) -> dict[str, float]:
        """Store the old policy's logprobs in each micro-batch; measure their gap to vLLM's
        (invariant 3) and the policy's entropy on freshly sampled tokens."""
        sums = {"diff": 0.0, "entropy": 0.0, "tokens": 0.0}
        for mb, (lp, ent) in zip(mbs, self.trainer.logprobs(mbs, with_entropy=True)):
            mb.extra["old_logprobs"] = lp
            fresh = mb.extra["fresh_mask"]  # vLLM sampled these with the weights the trainer has now
            sums["diff"] += float(((lp - mb.extra["rollout_logprobs"]).abs() * fresh).sum())
            sums["entropy"] += float((ent * fresh).sum())
            sums["tokens"] += float(fresh.sum())
        sums = sum_across(sums, self.trainer.dp_group)
        gap = sums["diff"] / max(sums["tokens"], 1)
        if gap > self.max_logprob_diff:  # the same sum on every rank: all stop together
            raise RuntimeError(
                f"the trainer's logprobs of vLLM's samples differ from vLLM's by {gap:.2e} per token on average, "
                f"above run.max_logprob_diff={self.max_logprob_diff:g}: vLLM sampled with other weights than the "
                "trainer holds. Likely: a weight sync that did not take effect (an engine asleep or re-created "
                "without the new weights, names that did not match), a resume that did not reload the engine, or "
                "a precision mismatch (policy.trainer.dtype; raise run.max_logprob_diff if that is expected)")
        return {"train/logprob_diff_vs_rollout": gap, "train/entropy": sums["entropy"] / max(sums["tokens"], 1)}

    def update(self, mbs: list[MicroBatch]) -> dict[str, float]:
        """One optimizer step over the step's micro-batches."""
        cfg, n = self.algorithm, len(mbs)
        local = loss_normalizer([mb.extra["loss_mask"] for mb in mbs], [mb.group_ids for mb in mbs], cfg.loss_agg)
        normalizer = max(sum_across({"n": local}, self.trainer.dp_group)["n"], 1.0) / self.trainer.dp_size

        def loss_fn(logprobs: torch.Tensor, mb: MicroBatch):
            out = policy_loss(cfg, logprobs, mb.extra["old_logprobs"], mb.extra["advantages"], mb.extra["loss_mask"],
                              rollout_logprobs=mb.extra["rollout_logprobs"], group_ids=mb.group_ids,
                              normalizer=normalizer)
            return out.loss, {"clip_fraction": out.clip_fraction / n, "is_weight": out.is_weight_mean / n}

        return self.trainer.train_step(mbs, loss_fn)
