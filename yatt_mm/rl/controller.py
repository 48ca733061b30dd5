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
from yatt_mm.rl import cpu_pinning, evaluation
from yatt_mm.rl.advantages import advantages, overlong_penalty
from yatt_mm.rl.algorithms import AlgorithmConfig
from yatt_mm.rl.dynamic_sampling import DynamicSampler, StepGroups
from yatt_mm.rl.evaluation import HeldOut
from yatt_mm.rl.placement import PhaseRunner
from yatt_mm.rl.samples import Group, Prompt, SampleBuilder, TrainSample
from yatt_mm.rl.stats import RolloutStats
from yatt_mm.simulate.replay import Wave, busy_seconds


PROBE_TOKENS = 4  # answer length of the weight-sync probe


class Controller:
    def __init__(self, source, engine: RolloutEngine, rewarder: Rewarder, sampler: DynamicSampler,
                 sampling: SamplingConfig, builder: SampleBuilder, algorithm: AlgorithmConfig, phases: PhaseRunner,
                 max_staleness: int = 0):
        self.source = source
        self.engine = engine
        self.rewarder = rewarder
        self.sampler = sampler
        self.sampling = sampling
        self.builder = builder
        self.algorithm = algorithm
        self.phases = phases
        self.probe_prompt: Prompt | None = None  # checks each weight sync: an eval prompt, else the first trained
        # the policy version the engine holds (steps its weights have trained; the loop sets it at
        # each weight sync), stamped on every group sampled
        self.policy_version = 0
        self.max_staleness = max_staleness  # run.max_staleness; 0: dynamic sampling's buffer as ever
        self._waves: list[Wave] = []  # this step's, for the device split
        self._wave_seconds = 0.0

    def _wave(self, n: int, step: int, stats: RolloutStats) -> list[Group]:
        version = self.policy_version  # the engine's weights as the wave starts (partial rollout may load newer)
        prompts = self.source.take(n)
        requests = [p.request(p.sampling_seed(self.sampling.seed)) for p in prompts]
        done: dict[tuple[int, int], float] = {}  # when each sample finished: the timeline, the split, the replay
        servers = self._judge_server_pids()  # CPU seconds of each side, for the simulator's utilisation
        if self.phases.plan.overlaps("rollout", "judge"):  # partial colocation: judge while generating
            with self.phases.phase("rollout_reward", step):
                stream = self.rewarder.stream(prompts)

                def sample_done(i: int, j: int, response) -> None:
                    done[(i, j)] = time.time()
                    stream.add_sample(i, j, response)

                own, judge_cpu = self._engine_cpu(), cpu_pinning.cpu_seconds(servers)
                start = time.time()
                result = self.engine.generate(requests, self.sampling, on_finished=stream.add, on_sample=sample_done)
                end = time.time()
                own = self._engine_cpu() - own
                scored = stream.results()
                stream.teach(result.responses)
                judge_cpu = cpu_pinning.cpu_seconds(servers) - judge_cpu
            self._record_generation(step, start, end, done, result.responses, own)
            spans = stream.judge_spans()
            for span in spans:
                self.phases.timeline.record("judge", step, span["start"], span["end"], prompt=span["prompt"],
                                            sample=span["sample"], judge=span["judge"], handed=span["handed"])
            taught = stream.teacher_spans()  # the teacher's server shares the judges' side of the split
            for span in taught:
                self.phases.timeline.record("teacher", step, span["start"], span["end"], prompt=span["prompt"],
                                            sample=span["sample"], handed=span["handed"])
            if servers:
                self.phases.timeline.record("judging", step, start, time.time(), cpu=judge_cpu, responses=len(done))
            stats.add_overlap(spans, end)
            self._waves.append(measured_wave(start, end, done, spans + taught))
            self._wave_seconds += time.time() - start
        else:
            with self.phases.phase("rollout", step):
                own = self._engine_cpu()
                start = time.time()
                result = self.engine.generate(requests, self.sampling,
                                              on_sample=lambda i, j, _: done.__setitem__((i, j), time.time()))
                end = time.time()
                own = self._engine_cpu() - own
            with self.phases.phase("reward", step):
                judged, judge_cpu = time.time(), self._engine_cpu() + cpu_pinning.cpu_seconds(servers)
                scored = self.rewarder.score(prompts, result.responses)
                judge_cpu = self._engine_cpu() + cpu_pinning.cpu_seconds(servers) - judge_cpu
            self._record_generation(step, start, end, done, result.responses, own)
            if self.rewarder.judges:
                self.phases.timeline.record("judge_batch", step, judged, time.time(), cpu=judge_cpu,
                                            responses=sum(len(r) for r in result.responses))
            if self.rewarder.teacher is not None:
                self._teach(step, prompts, result.responses, servers)
        groups = [self._shape_length(Group(p, rs, total, parts, version=version))
                  for p, rs, (total, parts) in zip(prompts, result.responses, scored)]
        stats.add_wave(groups, result.seconds, own, result.prompt_tokens)
        stats.add_sources(groups, self.sampler.is_valid)
        return groups

    def _teach(self, step: int, prompts: list[Prompt], responses, servers: list[int]) -> None:
        """On-policy distillation, in full colocation: the teacher scores the wave's responses in
        a phase of its own (on GPUs its engine wakes while the judges' sleep), timed as a batch."""
        with self.phases.phase("teacher", step):
            start, cpu = time.time(), self._engine_cpu() + cpu_pinning.cpu_seconds(servers)
            self.rewarder.teach(prompts, responses)
            cpu = self._engine_cpu() + cpu_pinning.cpu_seconds(servers) - cpu
        self.phases.timeline.record("teacher_batch", step, start, time.time(), cpu=cpu,
                                    responses=sum(len(r) for r in responses))

    def _shape_length(self, group: Group) -> Group:
        """DAPO's soft overlong punishment, before dynamic sampling sees the rewards: a response
        within algorithm.overlong.soft_penalty.buffer tokens of the limit loses reward linearly
        (its own reward part, `overlong`, in the metrics)."""
        soft = self.algorithm.overlong.soft_penalty
        if not soft.buffer:
            return group
        penalties = [overlong_penalty(len(r.token_ids), self.sampling.max_tokens, soft.buffer, soft.penalty)
                     for r in group.responses]
        group.rewards = [r + p for r, p in zip(group.rewards, penalties)]
        group.reward_parts["overlong"] = penalties
        return group

    def _engine_cpu(self) -> float:
        """CPU seconds the engines have used so far: this process's, or, where the engines are in
        a worker process of their own (placement disaggregated), the worker's."""
        worker = getattr(self.engine, "worker", None)
        return cpu_pinning.cpu_seconds(worker.pids) if worker is not None else cpu_pinning.own_cpu_seconds()

    def _judge_server_pids(self) -> list[int]:
        """The processes of the judge servers this controller started (none: clients only)."""
        servers = [getattr(j, "server", None) for _, j, _ in self.rewarder.judges]
        servers.append(getattr(self.rewarder.teacher, "server", None))
        return [pid for s in servers if s is not None and s.proc is not None
                for pid in cpu_pinning.session_pids(s.proc.pid)]

    def _record_generation(self, step: int, start: float, end: float, done: dict[tuple[int, int], float],
                           responses, cpu: float) -> None:
        """The wave's generation, sample by sample, in the timeline: when each finished (the
        judges' start in partial colocation; `yatt-mm simulate` replays them under the other
        placement), and the CPU seconds this process spent meanwhile."""
        timeline = self.phases.timeline
        timeline.record("generate", step, start, end, prompts=len(responses),
                        samples=sum(len(r) for r in responses), cpu=cpu)
        for (i, j), finished in sorted(done.items()):
            timeline.record("generated", step, start, finished, prompt=i, sample=j,
                            tokens=responses[i][j].sampled_tokens)

    def step(self, step: int, target: int) -> tuple[list[list[TrainSample]], RolloutStats]:
        """Rollout, reward and dynamic sampling until `target` groups, then their training
        samples with advantages; and what it took (this DP group's counts)."""
        stats = RolloutStats.for_sources(self.source.names)
        self._waves, self._wave_seconds = [], 0.0
        if self.max_staleness:  # buffered groups the weights of `step` would train more than k versions off
            stats.stale_dropped += self.sampler.drop_older(step - self.max_staleness)
        chosen = self.sampler.collect(target, lambda n: self._wave(n, step, stats))
        stats.add_choice(chosen)
        # partial colocation: the next step's device split, from what this one's waves measured
        stats.add_split(self.phases.decide_split(step, self._waves, self._wave_seconds))
        if self.probe_prompt is None and chosen.groups:
            self.probe_prompt = chosen.groups[0].prompt
        stats.reward_counts = self.rewarder.take_counts()
        stats.data_counts = self.source.data_counts()
        with self.phases.phase("prepare", step):
            return self.train_samples(chosen, step), stats

    def evaluate(self, held: HeldOut, step: int, seed: int = 0) -> dict[str, float]:
        """One eval set's answers scored by its rule, unfiltered (rl/evaluation.py): its counts."""
        with self.phases.phase("eval", step):
            return evaluation.counts(held, evaluation.answer(self.engine, held, seed))

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

    def train_samples(self, chosen: StepGroups, step: int | None = None) -> list[list[TrainSample]]:
        """Per group, its responses as training samples with their group's advantages (REINFORCE++'s
        are finished over the whole step by the actor). With algorithm.overlong.filter, the
        truncated ones are kept out of the loss (DAPO's overlong filtering)."""
        out = []
        for i, (group, masked) in enumerate(zip(chosen.groups, chosen.masked)):
            rewards = torch.tensor(group.rewards, dtype=torch.float32)
            adv = advantages(self.algorithm.advantage, rewards, [0] * len(group.rewards))
            # stale: sampled by older weights than those of `step` (the buffer's; or generated ahead)
            stale = i < chosen.from_buffer or (step is not None and group.version < step)
            samples = self.builder.build(group, adv.tolist(), masked, stale=stale)
            if self.algorithm.overlong.filter:
                for s in samples:
                    s.filtered = s.truncated
            out.append(samples)
        return out


def measured_wave(start: float, end: float, done: dict[tuple[int, int], float], judge_spans: list[dict]) -> Wave:
    """A partial-colocation wave as the replay models it: each sample's finish time, and the
    judges' cost per response (the seconds some judge request was open, per response judged)."""
    busy = busy_seconds([(s["start"], s["end"]) for s in judge_spans])
    return Wave(generation_seconds=end - start, sample_ends=sorted(t - start for t in done.values()),
                judge_seconds_per_response=busy / max(len(done), 1))
