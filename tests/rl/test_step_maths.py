"""The step's maths without processes: the loss normaliser makes micro-batching and DP
invisible, and the typed per-step stats sum across DP groups into the plotted metrics."""

from __future__ import annotations

import pytest
import torch

from gloo_threads import on_ranks
from yatt_mm.rl.algorithms import AlgorithmConfig
from yatt_mm.rl.losses import aggregate, loss_normalizer, policy_loss
from yatt_mm.rl.stats import RolloutStats


@pytest.mark.parametrize("how, form", [("token", "ppo"), ("sequence", "ppo"), ("group", "ppo"),
                                       ("token_sum_norm", "ppo"), ("sequence", "gspo"), ("sequence", "gspo_token")])
def test_micro_batches_and_dp_ranks_sum_to_the_full_batch_loss(how, form):
    torch.manual_seed(0)
    rows, t = 8, 7
    lengths = torch.tensor([3, 7, 1, 5, 0, 2, 6, 4])  # row 4 is a masked (padding) group's row
    mask = (torch.arange(t).unsqueeze(0) < lengths.unsqueeze(1)).float()
    lp, old = torch.randn(rows, t) * 0.1 - 1, torch.randn(rows, t) * 0.1 - 1
    adv = torch.randn(rows)
    groups = ["a", "a", "b", "b", "c", "c", "d", "d"]
    cfg = AlgorithmConfig(loss_agg=how, policy_loss=form, loss_norm_tokens=t)
    rollout = old + torch.randn(rows, t) * 0.5  # the rollout correction is per row: it splits with the rows
    full = policy_loss(cfg, lp, old, adv, mask, rollout, group_ids=groups).loss

    # 2 DP ranks of 2 micro-batches each; whole groups stay on one rank (as balancing keeps them)
    ranks = [[slice(0, 2), slice(2, 4)], [slice(4, 5), slice(5, 8)]]
    counts = [loss_normalizer([mask[s] for s in mbs], [groups[s] for s in mbs], cfg.aggregation) for mbs in ranks]
    normalizer = sum(counts) / len(ranks)  # what Actor.update passes: the DP sum over the DP size
    per_rank = [sum(policy_loss(cfg, lp[s], old[s], adv[s], mask[s], rollout[s], group_ids=groups[s],
                                normalizer=normalizer).loss for s in mbs) for mbs in ranks]
    # DDP averages over DP; measured 0 to 1.5e-8 off (float32 sums of a loss ~0.1 in another order)
    assert sum(per_rank) / len(ranks) == pytest.approx(float(full), abs=1e-7)


def test_normaliser_counts():
    mask = torch.tensor([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0], [1.0, 0.0, 0.0]])
    assert loss_normalizer([mask], [["a", "b", "a"]], "token") == 3
    assert loss_normalizer([mask], [["a", "b", "a"]], "sequence") == 2
    assert loss_normalizer([mask[:1], mask[1:]], [["a"], ["b", "a"]], "group") == 1  # a spans micro-batches
    assert float(aggregate(torch.ones(3, 3), mask, "token")) == pytest.approx(1.0)


def test_rollout_stats_sum_across_groups_into_metrics():
    a = RolloutStats(groups=4, responses=16, reward_sum=8, reward_sq_sum=8, response_tokens=64, gen_seconds=2,
                     valid_generated=3, waves=1, reward_counts={"exact_match/sum": 8, "exact_match/n": 16})
    b = RolloutStats(groups=2, responses=8, reward_sum=8, reward_sq_sum=8, response_tokens=32, gen_seconds=1,
                     valid_generated=0, waves=2, reward_counts={"exact_match/sum": 8, "exact_match/n": 8})
    # two DP groups over a real gloo group: every count summed, keys intact, on both ranks
    totals = on_ranks(2, lambda rank, group: (a, b)[rank].summed(group=group))
    assert totals[0] == totals[1]
    total = totals[0]
    assert total.responses == 24 and total.reward_counts == {"exact_match/sum": 16, "exact_match/n": 24}
    m = total.metrics(["exact_match"], [])
    assert m["rollout/reward_mean"] == pytest.approx(16 / 24) and m["reward/exact_match"] == pytest.approx(16 / 24)
    assert m["rollout/reward_std"] == pytest.approx((16 / 24 - (16 / 24) ** 2) ** 0.5)
    assert m["rollout/valid_group_rate"] == pytest.approx(3 / 6) and m["rollout/tokens_per_s"] == pytest.approx(96 / 3)
    from_buffer = RolloutStats(from_buffer=4).metrics([], [])
    assert "rollout/reward_mean" not in from_buffer and from_buffer["rollout/from_buffer"] == 4


def test_a_blends_sources_are_counted_apart_and_summed_across_groups():
    from types import SimpleNamespace

    from yatt_mm.engines.engine import Response
    from yatt_mm.rl.dynamic_sampling import is_valid

    def group(source, rewards):
        return SimpleNamespace(prompt=SimpleNamespace(source=source), rewards=rewards,
                               responses=[Response([1], "", [0.0], "stop")] * 2,
                               reward_parts={})

    def stats(rank):
        s = RolloutStats.for_sources(["charts", "video"])  # rank 1 draws no video: the same keys all the same
        groups = [group("charts", [1.0, 0.0]), group("video", [1.0, 1.0])] if rank == 0 else [group("charts", [0.0, 0.0])]
        s.add_wave(groups, 1.0)
        s.add_sources(groups, is_valid)
        s.data_counts = {"skipped": float(rank), "skipped_no_question": 0.0, "charts/skipped": float(rank),
                         "video/skipped": 0.0}
        return s

    totals = on_ranks(2, lambda rank, group: stats(rank).summed(group=group))
    m = totals[0].metrics([], [])
    assert totals[0] == totals[1]
    assert m["data/charts/groups_share"] == pytest.approx(2 / 3) and m["data/video/groups_share"] == pytest.approx(1 / 3)
    assert m["data/charts/reward_mean"] == pytest.approx(1 / 4) and m["data/video/reward_mean"] == 1.0
    assert m["data/charts/valid_group_rate"] == 0.5 and m["data/video/valid_group_rate"] == 0.0
    assert m["data/skipped"] == 1.0 and m["data/charts/skipped"] == 1.0 and m["data/video/skipped"] == 0.0
    alone = RolloutStats.for_sources([])  # no blend: no per-source keys
    alone.add_sources([group("", [1.0, 0.0])], is_valid)
    assert not alone.by_source and not any(k.startswith("data/") for k in alone.metrics([], []))


def test_sync_guard_stops_when_vllm_sampled_with_other_weights():
    from types import SimpleNamespace

    from models.trainer import MicroBatch
    from yatt_mm.rl.actor import Actor

    (one_rank,) = on_ranks(1, lambda rank, group: group)  # the DP group of a one-group run
    fresh = torch.tensor([[0.0, 1.0, 1.0, 0.0]])
    rollout = torch.tensor([[0.0, -1.0, -2.0, 0.0]])

    def actor_seeing(trainer_lp, dtype="fp32", limit=0.0):
        trainer = SimpleNamespace(cfg=SimpleNamespace(dtype=dtype), dp_cpu=one_rank,
                                  logprobs=lambda mbs, with_entropy: [(trainer_lp, torch.zeros_like(trainer_lp))])
        return Actor(trainer, AlgorithmConfig(mini_batches=2), 4096, 0, limit)  # not fused: a separate pass

    mb = lambda: MicroBatch(None, {"fresh_mask": fresh, "rollout_logprobs": rollout})  # noqa: E731
    same = actor_seeing(rollout + 1e-6).old_logprobs([[mb()]])
    # float32 sums: measured 9.83e-7 (1.7% off: 1e-6 is a few float32 steps of -1 and -2)
    assert same["train/logprob_diff_vs_rollout"] == pytest.approx(1e-6, rel=0.05)
    with pytest.raises(RuntimeError, match="weight sync that did not take effect"):
        actor_seeing(rollout + 0.5).old_logprobs([[mb()]])  # the gap of stale weights
    # bf16's own, looser default: a gap fp32 would stop at goes on, and is reported as measured
    bf16 = actor_seeing(rollout + 0.05, dtype="bf16").old_logprobs([[mb()]])
    assert bf16["train/logprob_diff_vs_rollout"] == pytest.approx(0.05, rel=1e-5)
    with pytest.raises(RuntimeError, match="run.max_logprob_diff=1e-07"):
        actor_seeing(rollout + 1e-6, limit=1e-7).old_logprobs([[mb()]])
