"""The RL algorithms against hand computations on fixed tensors: advantages (GRPO, Dr. GRPO,
RLOO, REINFORCE++), the PPO clip where it binds, dual-clip and the log-ratio clamp, GSPO in its
two forms, the aggregations, the rollout correction, the entropy bonus and DAPO's overlong
penalty; with the edge cases (a group of one, equal rewards, every token masked, a wild token)."""

from math import exp, log

import pytest
import torch

from yatt_mm.rl.advantages import advantages, overlong_penalty, token_returns, whiten, whiten_sums
from yatt_mm.rl.algorithms import AlgorithmConfig
from yatt_mm.rl.losses import aggregate, kl_penalty, loss_normalizer, policy_loss, sequence_kl, step_normalizer


def _cfg(**kw) -> AlgorithmConfig:
    correction = kw.pop("correction", None)
    cfg = AlgorithmConfig(**kw)
    if correction is not None:
        level, mode, threshold = correction
        cfg.rollout_correction.level, cfg.rollout_correction.mode, cfg.rollout_correction.threshold = \
            level, mode, threshold
    return cfg


def test_group_advantages_by_hand():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 5.0, 2.0, 3.0, 3.0])
    groups = ["a", "a", "b", "b", "b", "c", "d", "d"]
    grpo = advantages("grpo", rewards, groups)
    # +-0.5 / std, std = 2 ** -0.5; measured 1.0e-6 off (the 1e-6 the std is padded with)
    assert grpo[0] == pytest.approx(2 ** -0.5, abs=1e-5) and grpo[1] == pytest.approx(-(2 ** -0.5), abs=1e-5)
    b = rewards[2:5]
    assert torch.allclose(grpo[2:5], (b - b.mean()) / (b.std() + 1e-6))
    assert torch.allclose(advantages("dr_grpo", rewards, groups)[2:5], b - b.mean())
    # RLOO: r_i minus the mean of the others; group b = (0, 1, 5)
    assert advantages("rloo", rewards, groups)[2:5].tolist() == pytest.approx([0 - 3.0, 1 - 2.5, 5 - 0.5])
    assert advantages("reinforce_pp_baseline", rewards, groups)[2:5].tolist() == pytest.approx((b - 2).tolist())
    assert torch.equal(advantages("reinforce_pp", rewards, groups), rewards)  # whitened later, over the step
    for how in ("grpo", "dr_grpo", "rloo", "reinforce_pp_baseline"):
        adv = advantages(how, rewards, groups)
        assert adv[5] == 0.0 and torch.equal(adv[6:], torch.zeros(2)), how  # a group of one; equal rewards
    with pytest.raises(ValueError, match="choose grpo, dr_grpo, rloo"):
        advantages("ppo", rewards, groups)


def test_reinforce_pp_returns_take_the_kl_ahead_and_whiten_over_the_step():
    rewards = torch.tensor([1.0, 0.0])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    kl = torch.tensor([[0.1, 0.2, 9.0], [0.0, 0.3, 0.1]])  # the 9 is outside the response
    ret = token_returns(rewards, mask, kl, kl_coef=0.5)
    assert torch.allclose(ret, torch.tensor([[1 - 0.5 * 0.3, 1 - 0.5 * 0.2, 0.0], [-0.5 * 0.4, -0.5 * 0.4, -0.5 * 0.1]]))
    assert token_returns(rewards, mask).tolist() == [[1, 1, 0], [0, 0, 0]]
    # over two micro-batches (or DP ranks): their sums give the whole step's mean and variance
    total = {k: a + b for (k, a), b in zip(whiten_sums(ret[:1], mask[:1]).items(),
                                            whiten_sums(ret[1:], mask[1:]).values())}
    out = torch.cat([whiten(ret[:1], mask[:1], total), whiten(ret[1:], mask[1:], total)])
    values = ret[mask > 0]
    assert out[mask > 0].tolist() == pytest.approx(((values - values.mean()) / values.std()).tolist(), abs=1e-5)
    assert out[0, 2] == 0.0
    one = {"sum": 2.0, "sum_sq": 4.0, "count": 1.0}  # one token: no spread, advantage 0
    assert float(whiten(torch.tensor([[2.0]]), torch.ones(1, 1), one)) == 0.0


def test_reinforce_pp_discounts_the_reward_and_the_kl_ahead_per_response_token():
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    kl = torch.tensor([[0.1, 0.2, 0.3, 5.0]])
    got = token_returns(torch.tensor([1.0]), mask, kl, kl_coef=0.5, gamma=0.9)
    # per-token rewards -0.05, -0.1, 1 - 0.15 (the reward at the last token), discounted back
    t2 = 0.85
    t1 = -0.1 + 0.9 * t2
    t0 = -0.05 + 0.9 * t1
    assert got.tolist()[0] == pytest.approx([t0, t1, t2, 0.0])
    # gamma 1 is the closed form; tokens outside the mask (a tool's reply) are skipped, not counted
    assert torch.allclose(token_returns(torch.tensor([1.0]), mask, kl, 0.5, gamma=1.0), token_returns(
        torch.tensor([1.0]), mask, kl, 0.5))
    gap = token_returns(torch.tensor([2.0]), torch.tensor([[1.0, 0.0, 1.0]]), gamma=0.5)
    assert gap.tolist() == [[1.0, 0.0, 2.0]]
    with pytest.raises(ValueError, match="discounts REINFORCE"):
        _cfg(gamma=0.9).validate()
    _cfg(gamma=0.9, advantage="reinforce_pp").validate()


def test_overlong_soft_penalty_is_linear_over_the_buffer():
    assert [overlong_penalty(n, 16, 4, 1.0) for n in (10, 12, 14, 16)] == [0.0, 0.0, -0.5, -1.0]
    assert overlong_penalty(16, 16, 0, 1.0) == 0.0  # buffer 0: off
    assert overlong_penalty(15, 16, 4, 0.5) == pytest.approx(-0.375)


def _ratios(*rows):
    """log-ratio rows [B, T] for chosen ratios, with old logprobs at -1."""
    new = torch.log(torch.tensor(rows)) - 1.0
    return new.requires_grad_(True), torch.full_like(new, -1.0)


def test_clip_fraction_counts_where_the_clip_binds_low_and_high_apart():
    new, old = _ratios([1.5, 0.5, 1.1], [1.5, 0.5, 1.1])
    mask, adv = torch.ones(2, 3), torch.tensor([1.0, -1.0])
    out = policy_loss(_cfg(correction=("none", "truncate", 2.0)), new, old, adv, mask)
    # A > 0: only r = 1.5 > 1.28 binds (r = 0.5 would raise the loss, so it is not clipped);
    # A < 0: only r = 0.5 < 0.8 binds. The old count (|r - 1| > clip_low) said 4 of 6.
    assert out.mean("clip_high") == pytest.approx(1 / 6) and out.mean("clip_low") == pytest.approx(1 / 6)
    assert out.mean("clip") == pytest.approx(2 / 6)
    assert policy_loss(_cfg(clip_high=0.6), new, old, adv, mask).mean("clip_high") == 0.0  # reads clip_high
    # ppo_kl: the mean of log(old / new)
    assert out.mean("ppo_kl") == pytest.approx(-sum(log(r) for r in (1.5, 0.5, 1.1)) / 3, abs=1e-6)
    # the loss by hand (token mean): A = +1: -1.28, -0.5, -1.1; A = -1: 1.5, 0.8, 1.1
    assert float(out.loss.detach()) == pytest.approx((-1.28 - 0.5 - 1.1 + 1.5 + 0.8 + 1.1) / 6, abs=1e-6)


def test_dual_clip_and_the_log_ratio_clamp_keep_a_wild_token_finite():
    new = torch.tensor([[24.0, -1.0]], requires_grad=True)  # log-ratio +25 on the first token
    old = torch.full((1, 2), -1.0)
    mask, adv = torch.tensor([[1.0, 0.0]]), torch.tensor([-1.0])
    out = policy_loss(_cfg(), new, old, adv, mask)
    out.loss.backward()
    assert float(out.loss.detach()) == 3.0  # capped at -A x clip_ratio_c
    assert torch.count_nonzero(new.grad) == 0 and out.mean("clip_dual") == 1.0
    off = policy_loss(_cfg(clip_ratio_c=0.0), new, old, adv, mask)
    assert float(off.loss.detach()) == pytest.approx(exp(20.0), rel=1e-5)  # clamped at 20: large but finite
    assert "clip_dual" not in off.sums
    with pytest.raises(ValueError, match="dual-clip bound must be > 1"):
        _cfg(clip_ratio_c=0.9).validate()


def test_on_policy_gradient_is_the_advantage_weighted_logprob():
    torch.manual_seed(0)
    lp = (torch.randn(4, 6) * 0.1 - 1).requires_grad_(True)
    mask = torch.tensor([[1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 1], [1, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0]]).float()
    adv = torch.tensor([1.0, -1.0, 0.5, 0.0])
    out = policy_loss(_cfg(), lp, lp.detach(), adv, mask)
    out.loss.backward()
    assert torch.allclose(lp.grad, -(adv.unsqueeze(1) * mask) / mask.sum(), rtol=1e-6, atol=0)  # measured bit-equal
    assert out.mean("clip") == 0 and out.mean("ppo_kl") == 0


def test_gspo_by_hand_and_its_token_form_has_the_same_gradient():
    new = torch.tensor([[0.001, -0.001, 0.0], [0.02, 0.0, 0.0]]) - 1.0
    old = torch.full((2, 3), -1.0)
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    adv = torch.tensor([1.0, 2.0])
    grads, losses = [], []
    for form in ("gspo", "gspo_token"):
        lp = new.clone().requires_grad_(True)
        out = policy_loss(_cfg(policy_loss=form), lp, old, adv, mask)
        out.loss.backward()
        grads.append(lp.grad)
        losses.append(float(out.loss.detach()))
        # row 0: s = exp(mean(0.001, -0.001, 0)) = 1, loss -1; row 1: s = exp(0.01) > 1 + 4e-4 with A = 2: clipped,
        # loss -2 x 1.0004, no gradient; the mean over responses
        assert losses[-1] == pytest.approx((-1.0 - 2 * 1.0004) / 2, abs=1e-6), form
        assert out.mean("clip_high") == pytest.approx(2 / 5) and out.mean("clip_low") == 0, form
    # d/dlp_t of -A exp(mean log-ratio) / 2 responses, at s = 1: -1/3 / 2 on row 0's tokens
    expected = torch.tensor([[-1 / 6, -1 / 6, -1 / 6], [0.0, 0.0, 0.0]])
    assert torch.allclose(grads[0], expected, atol=1e-6) and torch.allclose(grads[1], expected, atol=1e-6)
    with pytest.raises(ValueError, match="averages its loss per response"):
        _cfg(policy_loss="gspo", loss_agg="group").validate()
    assert _cfg(policy_loss="gspo").aggregation == "sequence" and _cfg().aggregation == "token"


def test_cispo_keeps_every_tokens_gradient_with_a_clipped_detached_weight():
    old = torch.zeros(1, 3)
    new = torch.tensor([[log(2.0), 0.0, log(0.5)]]) - 1.0  # ratios 2, 1, 0.5 against old = -1
    old = old - 1.0
    lp = new.clone().requires_grad_(True)
    out = policy_loss(_cfg(policy_loss="cispo", cispo_clip_high=0.28), lp, old, torch.tensor([1.0]), torch.ones(1, 3))
    out.loss.backward()
    w = [1.28, 1.0, 0.5]  # 2 clipped at 1.28; no lower bound by default
    assert float(out.loss.detach()) == pytest.approx(-sum(wi * li for wi, li in zip(w, new[0].tolist())) / 3)
    # the clipped token still gets a gradient (PPO's clip would give it none), weighted by its clip
    assert lp.grad.tolist()[0] == pytest.approx([-wi / 3 for wi in w])
    assert out.mean("clip_high") == pytest.approx(1 / 3) and out.mean("clip_low") == 0


def test_sapo_gate_is_the_surrogate_at_ratio_one_and_fades_smoothly():
    old = torch.full((2, 1), -1.0)
    lp = (old + torch.tensor([[0.0], [log(3.0)]])).requires_grad_(True)
    adv = torch.tensor([1.0, -1.0])
    out = policy_loss(_cfg(policy_loss="sapo"), lp, old, adv, torch.ones(2, 1))
    out.loss.backward()

    def gate(r, tau):
        return 4 / tau / (1 + exp(-tau * (r - 1)))

    # row 0: r = 1, A = 1, tau_pos = 1: loss -2, gradient -A (the plain surrogate's); row 1: r = 3,
    # A = -1, tau_neg = 1.05: loss +gate(3), gradient A * f'(r) * r
    assert float(out.loss.detach()) == pytest.approx((-gate(1, 1.0) + gate(3, 1.05)) / 2)
    s = 1 / (1 + exp(-1.05 * 2))
    assert lp.grad.flatten().tolist() == pytest.approx([-1 / 2, 4 * s * (1 - s) * 3 / 2])


def test_gmpo_takes_the_geometric_mean_of_pessimistically_clipped_ratios():
    old = torch.zeros(2, 2)
    new = torch.tensor([[0.5, -0.1], [0.5, -0.1]])
    out = policy_loss(_cfg(policy_loss="gmpo"), new, old, torch.tensor([1.0, -1.0]), torch.ones(2, 2))
    # A > 0: min(lr, clip(lr, -0.4, 0.4)) = (0.4, -0.1), mean 0.15; A < 0: max = (0.5, -0.1), mean 0.2
    assert float(out.loss.detach()) == pytest.approx((-exp(0.15) + exp(0.2)) / 2)
    assert out.mean("clip_high") == pytest.approx(1 / 4) and out.mean("clip_low") == pytest.approx(1 / 4)
    assert _cfg(policy_loss="gmpo").aggregation == "sequence" and _cfg(policy_loss="cispo").aggregation == "token"


def test_aggregations_differ_as_documented():
    per_token = torch.tensor([[1.0, 1.0, 1.0, 1.0], [3.0, 0.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 0, 0, 0]])
    assert aggregate(per_token, mask, "token") == pytest.approx(7 / 5)
    assert aggregate(per_token, mask, "sequence") == pytest.approx(2.0)
    assert aggregate(per_token, mask, "group", ["g", "h"]) == pytest.approx(2.0)
    assert aggregate(per_token, mask, "group", ["g", "g"]) == pytest.approx(7 / 5)
    # Dr. GRPO: token sums over 2 responses x a constant 8 tokens, whatever their lengths
    assert aggregate(per_token, mask, "token_sum_norm", norm_tokens=8) == pytest.approx(7 / 16)
    assert aggregate(per_token, mask, "token_sum_norm", normalizer=4.0, norm_tokens=8) == pytest.approx(7 / 32)
    # verl's token-sum and seq-mean-token-sum
    assert aggregate(per_token, mask, "token_sum") == pytest.approx(7.0)
    assert aggregate(per_token, mask, "sequence_token_sum") == pytest.approx((4 + 3) / 2)
    # over DP: token_sum's step count is 1, so each of 2 ranks scales its sum by 2 and DP's mean
    # of the gradients gives the sum back; the counting modes divide by the step's count over 2
    assert step_normalizer("token_sum", 0.0, 2) == 0.5 and step_normalizer("sequence_token_sum", 8.0, 2) == 4.0
    masks = [mask, torch.tensor([[1, 1, 0, 0]])]
    assert loss_normalizer(masks, [["g", "h"], ["g"]], "sequence_token_sum") == 3.0
    assert loss_normalizer(masks, [["g", "h"], ["g"]], "token_sum") == 0.0
    with pytest.raises(ValueError, match="loss_norm_tokens > 0"):
        aggregate(per_token, mask, "token_sum_norm")
    with pytest.raises(ValueError, match="unknown loss aggregation"):
        aggregate(per_token, mask, "tokn")


@pytest.mark.parametrize("how", ["token", "sequence", "group", "token_sum_norm"])
@pytest.mark.parametrize("form", ["ppo", "gspo"])
def test_every_token_masked_gives_a_zero_loss_and_gradient(how, form):
    if form == "gspo" and how in ("group", "token_sum_norm"):
        return
    lp = torch.randn(2, 3).requires_grad_(True)
    out = policy_loss(_cfg(loss_agg=how, loss_norm_tokens=4, policy_loss=form), lp, lp.detach() + 0.1,
                      torch.tensor([1.0, -1.0]), torch.zeros(2, 3), rollout_logprobs=lp.detach(),
                      group_ids=["a", "a"])
    out.loss.backward()
    assert float(out.loss.detach()) == 0.0 and torch.count_nonzero(lp.grad) == 0
    assert out.mean("clip") == 0.0 and out.tokens == 0


def test_rollout_correction_truncates_rejects_or_icepops_per_token_or_per_response():
    lp = torch.full((2, 3), -1.0)
    # trainer/rollout ratios: row 0 (e, 1, e^-1.5) -> product e^-0.5; row 1 (1.5, 1.5, 1.5) -> product 3.375
    rollout = lp - torch.tensor([[1.0, 0.0, -1.5], [log(1.5)] * 3])
    mask, adv = torch.ones(2, 3), torch.ones(2)

    def loss(level, mode, **kw):
        return policy_loss(_cfg(correction=(level, mode, 2.0), **kw), lp, lp, adv, mask, rollout_logprobs=rollout)

    out = loss("token", "truncate")  # min(ratio, 2) per token
    assert out.mean("is_weight") * 6 == pytest.approx(2 + 1 + exp(-1.5) + 3 * 1.5)
    out = loss("sequence", "truncate")  # min(product, 2) on each of the response's tokens
    assert out.mean("is_weight") * 6 == pytest.approx(3 * exp(-0.5) + 3 * 2)
    # mask: a rejection replaces the loss mask (the reference's semantics): the ratios outside
    # [1/2, 2] (e and e^-1.5) leave the loss and its token count; the mean is over what is kept
    out = loss("token", "mask")
    assert float(out.tokens) == 4 and float(out.loss.detach()) == pytest.approx(-1.0) and "is_weight" not in out.sums
    out = loss("sequence", "mask", loss_agg="sequence")  # row 1's 3.375 is outside: one response left
    assert float(out.tokens) == 3 and float(out.loss.detach()) == pytest.approx(-1.0)
    # IcePop: the ratio itself inside [0.5, 5], 0 outside (e^-1.5); the denominators stay
    out = loss("token", "icepop")
    weights = [exp(1), 1, 0.0] + [1.5] * 3
    assert float(out.tokens) == 6 and out.mean("is_weight") * 6 == pytest.approx(sum(weights))
    assert float(out.loss.detach()) == pytest.approx(-sum(weights) / 6)
    with pytest.raises(ValueError, match="token by token"):
        _cfg(correction=("sequence", "icepop", 2.0)).validate()
    # mismatch: k3 of the trainer/rollout ratio r per token, r - 1 - log r
    r = [exp(1), 1, exp(-1.5)] + [1.5] * 3
    assert out.mean("mismatch_kl") == pytest.approx(sum(x - 1 - log(x) for x in r) / 6, rel=1e-5)
    off = policy_loss(_cfg(correction=("none", "truncate", 2.0)), lp, lp, adv, mask, rollout_logprobs=rollout)
    assert "is_weight" not in off.sums and float(off.loss.detach()) == pytest.approx(-1.0)


def test_mismatch_kl_is_not_clamped():
    """A token the sampler all but ruled out (log r = 30): the metric shows its k3 whole (the
    reference's), not a clamp at 10."""
    lp = torch.tensor([[-1.0, -1.0]])
    rollout = lp - torch.tensor([[30.0, 0.0]])
    out = policy_loss(_cfg(), lp, lp, torch.ones(1), torch.ones(1, 2), rollout_logprobs=rollout)
    assert out.mean("mismatch_kl") * 2 == pytest.approx(exp(30) - 31, rel=1e-5)


def test_gspo_averages_unclamped_log_ratios_and_bounds_only_the_sequence():
    """One wild token (log-ratio 50) among four: the reference averages the raw log-ratios
    (12.5), then bounds the sequence's at 10; a per-token clamp at 20 would give 5."""
    old = torch.zeros(1, 4)
    new = torch.tensor([[50.0, 0.0, 0.0, 0.0]])
    out = policy_loss(_cfg(policy_loss="gspo"), new, old, torch.tensor([-1.0]), torch.ones(1, 4))
    assert float(out.loss.detach()) == pytest.approx(exp(10), rel=1e-6)  # -A * s with s = e^10
    assert out.mean("ppo_kl") == pytest.approx(-12.5)


def test_entropy_bonus_and_kl_term_need_their_inputs():
    lp = torch.full((1, 2), -1.0)
    entropy = torch.tensor([[2.0, 4.0]], requires_grad=True)
    mask, adv = torch.ones(1, 2), torch.zeros(1)
    out = policy_loss(_cfg(entropy_coef=0.1), lp, lp, adv, mask, entropy=entropy)
    out.loss.backward()
    assert float(out.loss.detach()) == pytest.approx(-0.1 * 3.0)
    assert torch.allclose(entropy.grad, torch.tensor([[-0.05, -0.05]]))  # the bonus raises entropy
    with pytest.raises(ValueError, match="entropy"):
        policy_loss(_cfg(entropy_coef=0.1), lp, lp, adv, mask)
    with pytest.raises(ValueError, match="reference"):
        policy_loss(_cfg(kl_coef=0.1), lp, lp, adv, mask)
    out = policy_loss(_cfg(kl_coef=0.1, kl_estimator="k1"), lp, lp, adv, mask, ref_logprobs=lp - 0.5)
    assert out.mean("kl") == pytest.approx(0.5) and float(out.loss.detach()) == pytest.approx(0.05)


def test_kl_estimators_match_hand_computed_values():
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


def _actor(cfg, dp_group):
    from types import SimpleNamespace

    from yatt_mm.rl.actor import Actor

    trainer = SimpleNamespace(cfg=SimpleNamespace(dtype="fp32"), dp_cpu=dp_group)
    return Actor(trainer, cfg, 4096, 0, reference=SimpleNamespace(logprobs=lambda mbs: [mb.extra["ref"] for mb in mbs]))


def test_kl_in_reward_lowers_the_advantage_of_the_response_that_drifted():
    """Equal rewards, but one response far from the reference: with kl_in=reward its advantage
    goes negative and its group mate's positive; a response out of the loss but in its group
    (overlong.filter) stays in the baseline; a padding row keeps its advantage. Under REINFORCE++
    the KL enters each token's return instead."""
    from gloo_threads import on_ranks
    from models.trainer import MicroBatch

    from yatt_mm.rl.advantages import advantages

    response = torch.ones(4, 2)
    loss_mask = torch.tensor([[1.0, 1.0], [1.0, 1.0], [0.0, 0.0], [0.0, 0.0]])  # row 2 padding, row 3 filtered
    old = torch.tensor([[-1.0, -1.0], [-0.2, -0.2], [-1.0, -1.0], [-1.0, -1.0]])
    (one_rank,) = on_ranks(1, lambda rank, group: group)  # the DP group of a one-group run

    def batch():
        return MicroBatch(None, {"loss_mask": loss_mask, "response_mask": response,
                                 "in_group": torch.tensor([1.0, 1.0, 0.0, 1.0]), "old_logprobs": old,
                                 "ref": torch.full((4, 2), -1.0), "rewards": torch.tensor([1.0, 1.0, 0.0, 0.0]),
                                 "advantages": torch.tensor([0.0, 0.0, 0.7, 0.0])}, ["g", "g", "g", "g"])

    mb = batch()
    actor = _actor(AlgorithmConfig(kl_coef=0.1, kl_estimator="k1", kl_in="reward"), one_rank)
    metrics = actor._reference_logprobs([mb])
    assert metrics["train/kl"] == pytest.approx((0.8 * 2) / 4)  # k1 mean over the 4 loss tokens
    assert actor.batch_advantages([[mb]]) == {}
    adv = mb.extra["advantages"]
    # the group's baseline over rows 0, 1 and the filtered row 3: rewards 1, 1 - 0.1 x 1.6, 0
    expected = advantages("grpo", torch.tensor([1.0, 1 - 0.1 * 1.6, 0.0]), ["g"] * 3)
    assert [float(adv[0]), float(adv[1]), float(adv[3])] == pytest.approx(expected.tolist(), abs=1e-6)
    assert float(adv[2]) == pytest.approx(0.7)

    mb = batch()
    actor = _actor(AlgorithmConfig(kl_coef=0.1, kl_estimator="k1", kl_in="reward", advantage="reinforce_pp"),
                   one_rank)
    actor._reference_logprobs([mb])
    actor.batch_advantages([[mb]])
    returns = torch.tensor([1.0, 1.0, 1 - 0.1 * 1.6, 1 - 0.1 * 0.8])  # the KL still ahead of each token
    expected = (returns - returns.mean()) / returns.std()
    assert mb.extra["advantages"][:2].flatten().tolist() == pytest.approx(expected.tolist(), abs=1e-4)
    assert mb.extra["advantages"][2:].flatten().tolist() == [0.0] * 4


def test_a_rejecting_correction_takes_tokens_out_of_the_loss_mask_before_the_step():
    """mode mask in the actor: the rejection is applied once the old logprobs are known, so the
    step's normaliser counts only what is kept; the fraction rejected is a metric."""
    from gloo_threads import on_ranks
    from models.trainer import MicroBatch

    (one_rank,) = on_ranks(1, lambda rank, group: group)
    cfg = _cfg(correction=("token", "mask", 2.0))
    actor = _actor(cfg, one_rank)
    assert not actor.fused  # the counts must be known before the training forward
    old = torch.full((1, 3), -1.0)
    mb = MicroBatch(None, {"loss_mask": torch.ones(1, 3), "old_logprobs": old,
                           "rollout_logprobs": old - torch.tensor([[1.0, 0.0, 0.0]])}, ["g"])
    metrics = actor._reject([mb])
    assert metrics["rollout/correction_masked_fraction"] == pytest.approx(1 / 3)
    assert mb.extra["loss_mask"].tolist() == [[0.0, 1.0, 1.0]]


def test_reinforce_pp_whitens_over_every_dp_rank():
    """Two DP ranks with their own groups: each rank's advantages are whitened with the step's
    mean and variance, not its own."""
    from gloo_threads import on_ranks
    from models.trainer import MicroBatch

    rewards = [torch.tensor([1.0, 0.0]), torch.tensor([1.0, 1.0, 1.0])]
    masks = [torch.ones(2, 2), torch.tensor([[1.0, 0.0], [1.0, 1.0], [1.0, 1.0]])]

    def rank_fn(rank, group):
        mb = MicroBatch(None, {"loss_mask": masks[rank], "response_mask": masks[rank], "rewards": rewards[rank],
                               "advantages": rewards[rank].clone()}, [str(rank)] * len(rewards[rank]))
        _actor(AlgorithmConfig(advantage="reinforce_pp"), group).batch_advantages([[mb]])
        return mb.extra["advantages"]

    out = on_ranks(2, rank_fn)
    tokens = torch.tensor([1.0, 1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0])  # every loss token's return
    expected = (tokens - tokens.mean()) / tokens.std()
    got = torch.cat([out[0][masks[0] > 0], out[1][masks[1] > 0]])
    assert got.tolist() == pytest.approx(expected.tolist(), abs=1e-5)


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
