"""The controller of one data-parallel group. It lives in that group's process: reads its own
prompts, rolls them out on its own vLLM engine, scores them, keeps drawing until it has enough
groups whose rewards differ (dynamic sampling), and turns them into training samples. Nothing
in here talks to other DP groups; the loop exchanges only metadata and, when balancing, samples.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from yatt_mm.algorithms import AlgorithmConfig, advantages
from yatt_mm.dynamic_sampling import DynamicSampler, StepGroups
from yatt_mm.rl.placement import PhaseRunner
from yatt_mm.rl.rewarder import Rewarder
from yatt_mm.rl.samples import Group, SampleBuilder, TrainSample
from yatt_mm.rollout.engine import RolloutEngine, SamplingConfig


@dataclass
class RolloutStats:
    """Everything generated this step, before filtering (filtered rewards are biased)."""

    groups: int = 0
    responses: int = 0
    reward_sum: float = 0.0
    reward_sq_sum: float = 0.0
    response_tokens: int = 0
    seconds: float = 0.0

    def add(self, groups: list[Group], seconds: float) -> None:
        self.seconds += seconds
        for g in groups:
            self.groups += 1
            self.responses += len(g.rewards)
            self.reward_sum += sum(g.rewards)
            self.reward_sq_sum += sum(r * r for r in g.rewards)
            self.response_tokens += sum(len(r.token_ids) for r in g.responses)


class Controller:
    def __init__(self, source, engine: RolloutEngine, rewarder: Rewarder, sampler: DynamicSampler,
                 sampling: SamplingConfig, builder: SampleBuilder, algorithm: AlgorithmConfig, phases: PhaseRunner):
        self.source = source
        self.engine = engine
        self.rewarder = rewarder
        self.sampler = sampler
        self.sampling = sampling
        self.builder = builder
        self.algorithm = algorithm
        self.phases = phases

    def _wave(self, n: int, step: int, stats: RolloutStats) -> list[Group]:
        prompts = self.source.take(n)
        requests = [p.request() for p in prompts]
        if self.phases.plan.overlaps("rollout", "judge"):  # partial colocation: judge while generating
            with self.phases.phase("rollout_reward", step):
                stream = self.rewarder.stream(prompts)
                result = self.engine.generate(requests, self.sampling, on_finished=stream.add)
                scored = stream.results()
        else:
            with self.phases.phase("rollout", step):
                result = self.engine.generate(requests, self.sampling)
            with self.phases.phase("reward", step):
                scored = self.rewarder.score(prompts, result.responses)
        groups = [Group(p, rs, total, parts) for p, rs, (total, parts) in zip(prompts, result.responses, scored)]
        stats.add(groups, result.seconds)
        return groups

    def collect(self, step: int, target: int) -> tuple[StepGroups, RolloutStats]:
        stats = RolloutStats()
        chosen = self.sampler.collect(target, lambda n: self._wave(n, step, stats))
        return chosen, stats

    def train_samples(self, chosen: StepGroups) -> list[list[TrainSample]]:
        """Per group, its responses as training samples with GRPO-family advantages."""
        out = []
        for i, (group, masked) in enumerate(zip(chosen.groups, chosen.masked)):
            rewards = torch.tensor(group.rewards, dtype=torch.float32)
            adv = advantages(self.algorithm, rewards, [0] * len(group.rewards))
            out.append(self.builder.build(group, adv.tolist(), masked, stale=i < chosen.from_buffer))
        return out
