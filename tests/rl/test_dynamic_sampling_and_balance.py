import random
from dataclasses import dataclass

import pytest

from yatt_mm.rl.balance import imbalance, karmarkar_karp, loads_of, plan_moves
from yatt_mm.rl.dynamic_sampling import DynamicSampler, DynamicSamplingConfig


@dataclass
class FakeGroup:  # only the rewards matter to the sampler
    rewards: list
    id: int = 0


def source(valid_rate, limit=10_000, seed=0):
    rng = random.Random(seed)
    made = []

    def generate(n):
        n = min(n, limit - len(made))
        out = [FakeGroup([0.0, 1.0] if rng.random() < valid_rate else [1.0, 1.0], len(made) + i)
               for i in range(n)]
        made.extend(out)
        return out

    return generate, made


def test_fills_target_with_valid_groups_and_buffers_surplus():
    sampler = DynamicSampler(DynamicSamplingConfig(max_waves=5))
    generate, made = source(0.5)
    step = sampler.collect(16, generate)
    assert len(step.groups) == 16 and step.padded == 0
    assert all(max(g.rewards) > min(g.rewards) for g in step.groups)
    assert 0.2 < sampler.valid_rate < 0.8  # groups valid with p 0.5: measured 0.554
    surplus = len(sampler.buffer)
    step2 = sampler.collect(16, generate)
    assert step2.from_buffer == min(surplus, 16)
    ids = [g.id for g in step.groups + step2.groups]
    assert len(ids) == len(set(ids))  # no group trained twice


def test_starvation_pads_with_masked_groups_instead_of_failing():
    sampler = DynamicSampler(DynamicSamplingConfig(max_waves=2))
    generate, _ = source(0.0)
    step = sampler.collect(8, generate)
    assert len(step.groups) == 8 and step.padded == 8 and all(step.masked)
    assert step.waves == 2
    assert sampler.valid_rate < 0.5  # from its initial 0.5, two waves of none valid: measured 0.125


def test_exhausted_data_ends_the_step_without_error():
    sampler = DynamicSampler(DynamicSamplingConfig(max_waves=10))
    generate, made = source(0.5, limit=5)
    step = sampler.collect(8, generate)
    assert step.exhausted and len(made) == 5 and step.generated == 5
    # every group the data had goes in: its valid ones first, then the rest masked as padding
    valid = [g for g in made if max(g.rewards) > min(g.rewards)]
    assert 0 < len(valid) < 5  # the seeded source gives both kinds
    assert [g.id for g in step.groups] == [g.id for g in valid] + [g.id for g in made if g not in valid]
    assert step.masked == [False] * len(valid) + [True] * (5 - len(valid)) and step.valid_generated == len(valid)


def test_state_roundtrip():
    sampler = DynamicSampler(DynamicSamplingConfig())
    generate, _ = source(0.9)
    sampler.collect(4, generate)
    state = sampler.state_dict(lambda g: {"rewards": g.rewards, "id": g.id})
    other = DynamicSampler(DynamicSamplingConfig())
    other.load_state_dict(state, lambda d: FakeGroup(**d))
    assert other.valid_rate == sampler.valid_rate
    assert [g.id for g in other.buffer] == [g.id for g in sampler.buffer]


def test_karmarkar_karp_balances_long_tail():
    rng = random.Random(0)
    costs = [rng.paretovariate(1.5) * 100 for _ in range(256)]
    parts = karmarkar_karp(costs, 4)
    assert sorted(i for p in parts for i in p) == list(range(256))
    loads = [sum(costs[i] for i in p) for p in parts]
    naive = loads_of(costs, [i % 4 for i in range(256)], 4)
    assert imbalance(loads) < imbalance(naive)
    assert imbalance(loads) < 1.05


def test_plan_moves_keeps_what_is_already_balanced():
    costs = [10.0, 10.0, 10.0, 10.0]
    owner = [0, 1, 0, 1]
    new_owner, moves = plan_moves(costs, owner, 2)
    assert moves == [] and new_owner == owner
    owner = [0, 0, 0, 0]
    new_owner, moves = plan_moves(costs, owner, 2)
    assert len(moves) == 2 and all(m.src == 0 and m.dst == 1 for m in moves)
    assert imbalance(loads_of(costs, new_owner, 2)) == pytest.approx(1.0)


class _Resource:
    """Records what the PhaseRunner asks of it (the real resources are vLLM engines and the
    trainer; their own tests check what release/acquire do)."""

    def __init__(self, log, name):
        self.log, self.name = log, name

    def release(self, keep):
        self.log.append(f"release {self.name} keep {keep}")
        return 0.0

    def acquire(self, part):
        self.log.append(f"acquire {self.name} {part}")
        return 0.0


def test_phase_runner_releases_what_a_phase_does_not_need_and_acquires_what_it_does():
    from yatt_mm.metrics import Timeline
    from yatt_mm.rl.placement import PhaseRunner, full_colocation

    log = []
    runner = PhaseRunner(full_colocation(), {"rollout": [_Resource(log, "actor")], "judge": [_Resource(log, "judge")]},
                         Timeline(rank=0))
    with runner.phase("rollout", 0):
        assert log == ["release judge keep none"]
    with runner.phase("reward", 0):
        pass
    with runner.phase("train", 0):
        pass
    assert log == ["release judge keep none", "release actor keep none", "acquire judge all", "release judge keep none"]
    assert [s["phase"] for s in runner.timeline.spans if not s["phase"].startswith("switch")] == ["rollout", "reward", "train"]
    assert "full" in full_colocation().describe() and "rollout[rollout]" in full_colocation().describe()


def test_a_full_colocation_step_wakes_weights_for_the_sync_and_the_kv_cache_only_after_the_trainer_left():
    """The GPU memory order of a step: the engine sleeps while the trainer works; for the sync it
    wakes its weights only, beside the whole trainer; the trainer's optimizer state leaves before
    the KV cache comes back for the probe; the trainer's weights leave before eval/rollout."""
    from yatt_mm.metrics import Timeline
    from yatt_mm.rl.placement import PhaseRunner, full_colocation

    log = []
    runner = PhaseRunner(full_colocation(), {"rollout": [_Resource(log, "engine")], "judge": [_Resource(log, "judge")],
                                             "train": [_Resource(log, "trainer")]}, Timeline(rank=0))
    for name in ("rollout", "reward", "prepare", "balance", "logprobs", "train", "sync", "probe", "eval", "rollout"):
        with runner.phase(name, 0):
            log.append(f"run {name}")
    assert log == [
        "release judge keep none", "release trainer keep none", "run rollout",
        "release engine keep none", "acquire judge all", "run reward",
        "release judge keep none", "run prepare", "run balance",
        "acquire trainer all", "run logprobs", "run train",
        "acquire engine weights", "run sync",
        "release trainer keep weights", "acquire engine all", "run probe",
        "release trainer keep none", "run eval", "run rollout"]
