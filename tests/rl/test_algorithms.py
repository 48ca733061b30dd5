import pytest
import torch

from yatt_mm.rl.algorithms import AlgorithmConfig, advantages, aggregate, group_advantages, policy_loss


def test_group_advantages_grpo_and_dr_grpo():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 5.0, 2.0])
    groups = ["a", "a", "b", "b", "b", "c"]
    adv = group_advantages(rewards, groups, normalize_std=True)
    assert adv[0] == pytest.approx(0.7071, abs=1e-3) and adv[1] == pytest.approx(-0.7071, abs=1e-3)
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
    assert torch.allclose(lp.grad, expected, atol=1e-6)
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
