"""The controller of one data-parallel group. It lives in that group's process: reads its own
prompts, rolls them out on its own vLLM engine, scores them, keeps drawing until it has enough
groups whose rewards differ (dynamic sampling), and turns them into training samples. Nothing
in here talks to other DP groups; the loop exchanges only metadata and, when balancing, samples.
"""

from __future__ import annotations

import time

import torch

from yatt_mm.engines.engine import RolloutEngine, SamplingConfig
from yatt_mm.reward.rewarder import Rewarder
from yatt_mm.reward.rules import RuleFn
from yatt_mm.rl.algorithms import AlgorithmConfig, advantages
from yatt_mm.rl.dynamic_sampling import DynamicSampler, StepGroups
from yatt_mm.rl.placement import PhaseRunner
from yatt_mm.rl.samples import Group, Prompt, SampleBuilder, TrainSample
from yatt_mm.rl.stats import RolloutStats


PROBE_TOKENS = 4  # answer length of the weight-sync probe


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
        self.probe_prompt: Prompt | None = None  # checks each weight sync: an eval prompt, else the first trained

    def _wave(self, n: int, step: int, stats: RolloutStats) -> list[Group]:
        prompts = self.source.take(n)
        requests = [p.request() for p in prompts]
        if self.phases.plan.overlaps("rollout", "judge"):  # partial colocation: judge while generating
            with self.phases.phase("rollout_reward", step):
                stream = self.rewarder.stream(prompts)
                start = time.time()
                result = self.engine.generate(requests, self.sampling, on_finished=stream.add)
                end = time.time()
                scored = stream.results()
            self._record_generation(step, start, end, stream.sent, result.responses)
            spans = stream.judge_spans()
            for span in spans:
                self.phases.timeline.record("judge", step, span["start"], span["end"], prompt=span["prompt"],
                                            judge=span["judge"])
            stats.add_overlap(spans, end)
        else:
            finished: dict[int, float] = {}  # when each prompt's responses were done, for the timeline
            with self.phases.phase("rollout", step):
                start = time.time()
                result = self.engine.generate(requests, self.sampling,
                                              on_finished=lambda i, _: finished.__setitem__(i, time.time()))
                end = time.time()
            with self.phases.phase("reward", step):
                judged = time.time()
                scored = self.rewarder.score(prompts, result.responses)
            self._record_generation(step, start, end, finished, result.responses)
            if self.rewarder.judges:
                self.phases.timeline.record("judge_batch", step, judged, time.time(),
                                            responses=sum(len(r) for r in result.responses))
        groups = [Group(p, rs, total, parts) for p, rs, (total, parts) in zip(prompts, result.responses, scored)]
        stats.add_wave(groups, result.seconds)
        return groups

    def _record_generation(self, step: int, start: float, end: float, finished: dict[int, float], responses) -> None:
        """The wave's generation, request by request, in the timeline: when each prompt's
        responses were done (the judge's start in partial colocation; `yatt-mm simulate` replays
        them under the other placement)."""
        timeline = self.phases.timeline
        timeline.record("generate", step, start, end, prompts=len(responses))
        for i, done in sorted(finished.items()):
            timeline.record("generated", step, start, done, prompt=i,
                            tokens=sum(len(r.token_ids) for r in responses[i]))

    def step(self, step: int, target: int) -> tuple[list[list[TrainSample]], RolloutStats]:
        """Rollout, reward and dynamic sampling until `target` groups, then their training
        samples with advantages; and what it took (this DP group's counts)."""
        stats = RolloutStats()
        chosen = self.sampler.collect(target, lambda n: self._wave(n, step, stats))
        stats.add_choice(chosen)
        if self.probe_prompt is None and chosen.groups:
            self.probe_prompt = chosen.groups[0].prompt
        stats.reward_counts = self.rewarder.take_counts()
        with self.phases.phase("prepare", step):
            return self.train_samples(chosen), stats

    def evaluate(self, prompts: list[Prompt], rule: RuleFn, max_tokens: int, step: int) -> tuple[float, int]:
        """Greedy answers to held-out prompts, scored by a rule (unfiltered): (score sum, count)."""
        if not prompts:
            return 0.0, 0
        with self.phases.phase("eval", step):
            result = self.engine.generate([p.request() for p in prompts],
                                          SamplingConfig(n=1, max_tokens=max_tokens, temperature=0.0))
        return sum(rule(g[0].text, p.answer, p.metadata) for p, g in zip(prompts, result.responses)), len(prompts)

    def probe(self) -> list[TrainSample]:
        """The engine's greedy answer to the probe prompt, as a training sample carrying vLLM's
        logprobs; none before the probe prompt is known (no eval prompts, nothing trained yet)."""
        if self.probe_prompt is None:
            return []
        # a few tokens suffice: their logprobs already depend on every weight, vision tower included
        result = self.engine.generate([self.probe_prompt.request()],
                                      SamplingConfig(n=1, max_tokens=min(self.sampling.max_tokens, PROBE_TOKENS),
                                                     temperature=0.0))
        return self.builder.build(Group(self.probe_prompt, result.responses[0], [0.0]), [0.0], masked=False)

    def train_samples(self, chosen: StepGroups) -> list[list[TrainSample]]:
        """Per group, its responses as training samples with GRPO-family advantages."""
        out = []
        for i, (group, masked) in enumerate(zip(chosen.groups, chosen.masked)):
            rewards = torch.tensor(group.rewards, dtype=torch.float32)
            adv = advantages(self.algorithm, rewards, [0] * len(group.rewards))
            out.append(self.builder.build(group, adv.tolist(), masked, stale=i < chosen.from_buffer))
        return out
