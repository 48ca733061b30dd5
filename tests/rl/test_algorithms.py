import pytest
import torch

from yatt_mm.rl.algorithms import AlgorithmConfig, advantages, aggregate, group_advantages, policy_loss


def test_group_advantages_grpo_and_dr_grpo():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 5.0, 2.0])
    groups = ["a", "a", "b", "b", "b", "c"]
    adv = group_advantages(rewards, groups, normalize_std=True)
    # +-0.5 / std, std = 2 ** -0.5; measured 1.0e-6 off (the 1e-6 the std is padded with)
    assert adv[0] == pytest.approx(2 ** -0.5, abs=1e-5) and adv[1] == pytest.approx(-(2 ** -0.5), abs=1e-5)
    b = rewards[2:5]
    assert torch.allclose(adv[2:5], (b - b.mean()) / (b.std() + 1e-6))
    assert adv[5] == 0.0  # a group of one
    dr = advantages(AlgorithmConfig(advantage="dr_grpo"), rewards, groups)
    assert torch.allclose(dr[2:5], b - b.mean())
    same = group_advantages(torch.tensor([3.0, 3.0]), [0, 0])
    assert torch.equal(same, torch.zeros(2))


def _batch():
    torch.manual_seed(0)
    lp = torch.randn(4, 6) * 0.1 - 1
    mask = torch.tensor([[1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 1], [1, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0]])
    return lp, mask


def test_on_policy_loss_gradient_is_advantage_weighted_logprob():
    lp, mask = _batch()
    lp = lp.clone().requires_grad_(True)
    adv = torch.tensor([1.0, -1.0, 0.5, 0.0])
    out = policy_loss(AlgorithmConfig(), lp, lp.detach(), adv, mask)
    out.loss.backward()
    expected = -(adv.unsqueeze(1) * mask) / mask.sum()
    assert torch.allclose(lp.grad, expected, rtol=1e-6, atol=0)  # measured bit-equal
    assert out.clip_fraction == 0


def test_clipping_stops_gradient_beyond_the_trust_region():
    lp, mask = _batch()
    old = lp.clone()
    new = (lp + 1.0).requires_grad_(True)  # ratio e >> 1 + clip_high
    out = policy_loss(AlgorithmConfig(is_correction=False), new, old, torch.ones(4), mask)
    out.loss.backward()
    assert torch.count_nonzero(new.grad) == 0  # positive advantage, ratio clipped: no push
    assert out.clip_fraction == 1


def test_importance_correction_is_truncated_and_kl_needs_reference():
    lp, mask = _batch()
    rollout = lp - 5.0  # rollout probability far below the trainer's
    out = policy_loss(AlgorithmConfig(is_cap=2.0), lp, lp, torch.ones(4), mask, rollout_logprobs=rollout)
    assert out.is_weight_mean == pytest.approx(2.0)
    with pytest.raises(ValueError, match="reference"):
        policy_loss(AlgorithmConfig(kl_coef=0.1), lp, lp, torch.ones(4), mask)
    out = policy_loss(AlgorithmConfig(kl_coef=0.1), lp, lp, torch.ones(4), mask, ref_logprobs=lp - 0.5)
    assert out.kl > 0


def test_aggregations_differ_as_documented():
    per_token = torch.tensor([[1.0, 1.0, 1.0, 1.0], [3.0, 0.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 0, 0, 0]])
    assert aggregate(per_token, mask, "token") == pytest.approx(7 / 5)
    assert aggregate(per_token, mask, "sequence") == pytest.approx(2.0)
    assert aggregate(per_token, mask, "group", ["g", "h"]) == pytest.approx(2.0)
    assert aggregate(per_token, mask, "group", ["g", "g"]) == pytest.approx(7 / 5)
    with pytest.raises(ValueError, match="unknown loss aggregation"):
        aggregate(per_token, mask, "tokn")


def test_kl_estimators_match_hand_computed_values():
    from math import log

    from yatt_mm.rl.algorithms import kl_penalty, sequence_kl

    p, p_ref = torch.tensor([[log(0.5)]]), torch.tensor([[log(0.25)]])  # log p/p_ref = log 2
    assert float(kl_penalty(p, p_ref, "k1")) == pytest.approx(log(2))
    assert float(kl_penalty(p, p_ref, "k2")) == pytest.approx(0.5 * log(2) ** 2)
    assert float(kl_penalty(p, p_ref, "k3")) == pytest.approx(0.5 - 1 - log(0.5))  # r - 1 - log r, r = p_ref/p
    assert float(kl_penalty(p_ref, p, "k3")) == pytest.approx(2 - 1 - log(2))
    for k in ("k1", "k2", "k3"):
        assert float(kl_penalty(p, p, k)) == 0.0  # the reference itself: no divergence
    assert float(kl_penalty(torch.tensor([[0.0]]), torch.tensor([[-50.0]]), "k3")) == 10.0  # clamped like verl
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    lp, ref = torch.tensor([[log(0.5), log(0.5), -9.0]]), torch.tensor([[log(0.25), log(0.5), 0.0]])
    assert float(sequence_kl(lp, ref, mask, "k1")[0]) == pytest.approx(log(2))  # masked token left out
    with pytest.raises(ValueError, match="choose k1, k2 or k3"):
        kl_penalty(p, p_ref, "k4")


def test_kl_in_reward_lowers_the_advantage_of_the_response_that_drifted():
    """Equal rewards, but one response far from the reference: with kl_in=reward its advantage
    goes negative and its group mate's positive; rows out of the loss keep theirs."""
    from types import SimpleNamespace

    from models.trainer import MicroBatch
    from gloo_threads import on_ranks
    from yatt_mm.rl.actor import Actor

    mask = torch.tensor([[1.0, 1.0], [1.0, 1.0], [0.0, 0.0]])
    old = torch.tensor([[-1.0, -1.0], [-0.2, -0.2], [-1.0, -1.0]])
    ref = torch.full((3, 2), -1.0)
    mb = MicroBatch(None, {"loss_mask": mask, "old_logprobs": old, "rewards": torch.tensor([1.0, 1.0, 0.0]),
                           "advantages": torch.tensor([0.0, 0.0, 0.7])}, ["g", "g", "g"])
    reference = SimpleNamespace(logprobs=lambda mbs: [ref])
    (one_rank,) = on_ranks(1, lambda rank, group: group)  # the DP group of a one-group run
    trainer = SimpleNamespace(cfg=SimpleNamespace(dtype="fp32"), dp_cpu=one_rank)
    actor = Actor(trainer, AlgorithmConfig(kl_coef=0.1, kl_estimator="k1", kl_in="reward"), 4096, 0,
                  reference=reference)
    metrics = actor._reference_logprobs([mb])
    adv = mb.extra["advantages"]
    assert adv[1] < 0 < adv[0] and float(adv[2]) == pytest.approx(0.7)
    assert metrics["train/kl"] == pytest.approx((0.8 * 2) / 4)  # k1 mean over the 4 loss tokens


def test_mini_batches_keep_groups_whole_balance_tokens_and_fill_empty_ones():
    from yatt_mm.rl.samples import TrainSample, mini_batches

    def sample(group, tokens):
        ids = torch.arange(tokens)
        return TrainSample(ids, torch.ones(tokens), torch.zeros(tokens), 0.5, group)

    samples = [sample("a", 10), sample("a", 12), sample("b", 30), sample("c", 5), sample("c", 6), sample("d", 20)]
    parts = mini_batches(samples, 2)
    assert sorted(len(p) for p in parts) == [3, 3]
    for p in parts:
        groups = {s.group_id for s in p}
        assert all(sum(s.group_id == g for s in samples) == sum(s.group_id == g for s in p) for g in groups)
    assert sorted(sum(s.text_tokens for s in p) for p in parts) == [41, 42]
    parts = mini_batches(samples[:2], 3)  # one group, three mini-batches: two fillers
    assert [len(p) for p in parts] == [2, 1, 1] and parts[1][0].masked and not parts[0][0].masked
    assert parts[1][0].text_tokens == 10
