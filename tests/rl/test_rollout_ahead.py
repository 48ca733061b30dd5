"""run.max_staleness without a launch: the settings it refuses (before any rank starts), the
disaggregated plan it runs on, and how samples keep their policy version and too-stale groups
leave dynamic sampling's buffer. The run itself: tests/e2e/test_rl_async.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from yatt_mm.config import load
from yatt_mm.rl.config import RLConfig
from yatt_mm.rl.dynamic_sampling import DynamicSampler, DynamicSamplingConfig
from yatt_mm.rl.placement import PLANS, RESIDENT_ROLES
from yatt_mm.rl.samples import Group, TrainSample

DEMO = Path(__file__).resolve().parents[2] / "configs" / "tiny_demo.yaml"


@pytest.mark.parametrize("overrides, message", [
    (["run.max_staleness=1"], "run.max_staleness=1 generates the next step while this one trains, beside the "
                              "trainer: set run.placement=disaggregated (now full)"),
    (["run.max_staleness=1", "run.placement=disaggregated", "run.controller=single"], "needs run.controller=parallel"),
    (["run.placement=disaggregated", "rollout.engine.tensor_parallel_size=2", "policy.trainer.tensor_parallel=2",
      "reward.judges=[]"], "run.placement=disaggregated runs each controller's engine in one worker process: set "
                           "rollout.engine.tensor_parallel_size=1 (now 2)"),
    (["run.max_staleness=-1"], "run.max_staleness"),
    (["run.partial_rollout=true", "run.placement=disaggregated"], "run.partial_rollout loads new weights into a "
                                                                  "rollout running ahead: it needs run.max_staleness >= 1"),
])
def test_bad_staleness_settings_are_refused_by_name(overrides, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load(RLConfig, DEMO, overrides)


def test_staleness_on_the_disaggregated_placement_is_accepted():
    cfg = load(RLConfig, DEMO, ["run.max_staleness=1", "run.placement=disaggregated"])
    assert cfg.run.max_staleness == 1


def test_the_disaggregated_plan_never_releases_the_trainer_and_leaves_rollout_and_judges_resident():
    plan = PLANS["disaggregated"]()
    assert [p.name for p in plan.phases] == [p.name for p in PLANS["full"]().phases]  # the controller's phase names
    assert all(p.levels()["train"] == "all" for p in plan.phases)
    assert not plan.overlaps("rollout", "judge")  # the reward phase runs after generation, as in full colocation
    assert RESIDENT_ROLES["disaggregated"] == ("rollout", "judge", "teacher")  # a distillation teacher too


def test_a_sample_keeps_its_policy_version_through_packing():
    import torch

    s = TrainSample(torch.tensor([1, 2, 3]), torch.tensor([0.0, 1.0, 0.0]), torch.zeros(3), 0.5, "g", version=7)
    assert TrainSample.unpack(*s.pack()).version == 7


def test_buffered_groups_staler_than_the_bound_are_dropped_and_counted():
    sampler = DynamicSampler(DynamicSamplingConfig(), buffer=[Group(None, [], [0.0, 1.0], version=v) for v in (3, 4, 5)])
    assert sampler.drop_older(4) == 1
    assert [g.version for g in sampler.buffer] == [4, 5]
