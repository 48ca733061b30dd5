"""A step's rollout and judging on a GPU cluster, from a run's length mix and a device profile.

The run gives the shape of the work: how long each response is relative to `max_tokens` (its
long tail) and how many responses a prompt has. A `ClusterWorkload` scales it: the policy and
judge sizes, the real `max_tokens`, prompt and judge-answer lengths, responses per step. An
engine replica (a model on `tp` GPUs) runs continuous batching: each step every running
sequence gains a token, at most `max_num_seqs` run, new ones start as others finish, and a step
costs the profile's fixed overhead plus the larger of reading the weights and computing the
batch, plus reading the batch's KV cache and any prefill it admits (bf16 throughout). That is
what makes a long tail expensive: its last few sequences still read all the weights each step.

Full colocation: every GPU generates, the engines sleep and the judges wake (weights over the
host link), every GPU judges, then the judges sleep. Partial colocation: j GPUs of each node
judge while the others generate; each response reaches a judge replica when it finishes; the
wake and sleep of the two roles happen side by side on their own GPUs. Training is the same in
both: it is estimated (6 x parameters x tokens at the profile's compute efficiency) for the step
time and left out of the placements' ratio (rollout + reward only).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from yatt_mm.simulate.profile import DeviceProfile


@dataclass
class ClusterWorkload:
    policy_params_b: float = 7.0  # policy size, billions of parameters (Qwen2-VL-7B)
    judge_params_b: float = 32.0  # GenRM judge size, billions
    max_tokens: int = 4096  # the run's longest response is scaled to this
    prompt_tokens: int = 1024  # question + image tokens per prompt
    responses_per_step: int = 4096  # the whole cluster's, e.g. 512 prompts x 8
    judge_tokens: int = 256  # a judge's answer (reasoning + verdict), per vote
    votes: int = 2  # judge samples per response
    max_num_seqs: int = 256  # vLLM's batch limit per replica

    def validate(self) -> None:
        for name in ("policy_params_b", "judge_params_b", "max_tokens", "responses_per_step", "judge_tokens",
                     "votes", "max_num_seqs"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")


@dataclass
class Model:
    """One model on one replica of `tp` GPUs: what a step costs."""
    params: float
    tp: int
    profile: DeviceProfile

    @property
    def weight_bytes(self) -> float:
        return 2 * self.params  # bf16

    @property
    def kv_bytes_per_token(self) -> float:
        # K and V of every layer; about 8 bytes per billion parameters... per token for GQA models
        # of the Qwen2 family (7B: 57 KB, 72B: 327 KB per token): 6e-6 x params is within 2x of both
        return 6e-6 * self.params

    def step_seconds(self, batch: int, context_tokens: float, prefill_tokens: float = 0.0) -> float:
        p = self.profile
        bandwidth = self.tp * p.memory_bandwidth_tbs * 1e12 * p.bandwidth_efficiency
        flops = self.tp * p.bf16_tflops * 1e12 * p.compute_efficiency
        weights = self.weight_bytes / bandwidth
        compute = 2 * self.params * batch / flops
        kv = context_tokens * self.kv_bytes_per_token / bandwidth
        prefill = 2 * self.params * prefill_tokens / flops
        return p.step_overhead_ms / 1e3 + max(weights, compute) + kv + prefill

    def switch_seconds(self) -> float:
        """Sleep or wake: the replica's share of the weights over each GPU's host link."""
        return self.weight_bytes / self.tp / (self.profile.host_link_gbs * 1e9)


def fit_tp(params: float, profile: DeviceProfile) -> int:
    """The fewest GPUs (a power of two) whose memory holds the weights with room for KV (60%)."""
    tp = 1
    while 2 * params > 0.6 * tp * profile.memory_gb * 1e9:
        tp *= 2
        if tp > profile.devices_per_node:
            raise ValueError(f"a {params / 1e9:.0f}B model does not fit on one {profile.name} node")
    return tp


@dataclass
class Sequence:
    arrival: float  # when it may start
    prefill: int  # prompt tokens
    decode: int  # tokens to generate
    tag: int = 0  # which response it belongs to
    cached: bool = False  # its prompt is in the prefix cache (another vote of it computed it): no prefill compute


@dataclass
class EngineRun:
    seconds: float  # when the last sequence finished
    finished: list[tuple[float, int]] = field(default_factory=list)  # (time, tag) per sequence
    busy: list[tuple[float, float]] = field(default_factory=list)  # intervals with something running
    tokens: int = 0
    full_batch_seconds: float = 0.0  # what the tokens would cost in steps of max_num_seqs


def run_engine(model: Model, sequences: list[Sequence], max_num_seqs: int) -> EngineRun:
    """Continuous batching of `sequences` (FIFO by arrival) on one replica."""
    queue = sorted(sequences, key=lambda s: s.arrival)
    t, k = 0.0, 0
    running: list[list] = []  # [tokens left, context, tag]
    out = EngineRun(0.0)
    start_busy = None
    while k < len(queue) or running:
        if not running and queue[k].arrival > t:
            if start_busy is not None:
                out.busy.append((start_busy, t))
                start_busy = None
            t = queue[k].arrival
        if start_busy is None:
            start_busy = t
        prefill = 0
        while k < len(queue) and queue[k].arrival <= t and len(running) < max_num_seqs:
            s = queue[k]
            running.append([s.decode, s.prefill, s.tag])
            prefill += 0 if s.cached else s.prefill
            k += 1
        # steps until the next sequence finishes or the next one may start: constant batch
        until_finish = min(r[0] for r in running)
        steps = until_finish
        if k < len(queue) and len(running) < max_num_seqs:
            per_step = model.step_seconds(len(running), sum(r[1] for r in running))
            steps = max(1, min(steps, math.ceil((queue[k].arrival - t) / per_step)))
        context = sum(r[1] for r in running)
        b = len(running)
        # the context grows by b a step: the mean context over the run of steps
        prefill_seconds = model.step_seconds(0, 0, prefill) - model.step_seconds(0, 0)
        seconds = steps * model.step_seconds(b, context + b * (steps - 1) / 2) + prefill_seconds
        out.full_batch_seconds += prefill_seconds  # a prefill runs at full efficiency already
        t += seconds
        out.tokens += b * steps
        for r in running:
            r[0] -= steps
            r[1] += steps
        for r in [r for r in running if r[0] <= 0]:
            out.finished.append((t, r[2]))
        running = [r for r in running if r[0] > 0]
    if start_busy is not None:
        out.busy.append((start_busy, t))
    out.seconds = t
    # a decoded token's cost in a full batch (max_num_seqs sequences of the mean context seen)
    mean_context = sum(s.prefill + s.decode / 2 for s in sequences) / max(len(sequences), 1)
    full = model.step_seconds(max_num_seqs, max_num_seqs * mean_context) / max_num_seqs
    out.full_batch_seconds += out.tokens * full
    return out


@dataclass
class ClusterResult:
    placement: str
    gpus: int
    judge_gpus: int  # partial: the judges' GPUs in the cluster; full: every GPU
    seconds: float  # rollout + reward of one step
    train_seconds: float  # the step's training, the same under either placement: 6 x params x tokens at compute_efficiency
    generation_seconds: float
    switch_seconds: float
    rollout_utilisation: float  # tokens x full-batch cost / (GPU-seconds the role holds): 1 = batches always full
    judge_utilisation: float
    rollout_idle: float  # share of the role's held GPU-time with nothing running
    judge_idle: float
    rollout_busy: list[tuple[float, float]] = field(default_factory=list)
    judge_busy: list[tuple[float, float]] = field(default_factory=list)


def _share(lengths: list[float], count: int) -> list[float]:
    """`count` response lengths drawn evenly from the run's mix (a quantile per response)."""
    ordered = sorted(lengths)
    return [ordered[min(len(ordered) - 1, int((i + 0.5) * len(ordered) / count))] for i in range(count)]


def simulate_cluster(lengths: list[float], work: ClusterWorkload, profile: DeviceProfile, gpus: int,
                     placement: str, judge_per_node: int = 0) -> ClusterResult:
    """One step's rollout + reward on `gpus` GPUs. `lengths`: the run's response lengths as
    shares of its max_tokens (0-1]."""
    policy = Model(work.policy_params_b * 1e9, fit_tp(work.policy_params_b * 1e9, profile), profile)
    judge = Model(work.judge_params_b * 1e9, fit_tp(work.judge_params_b * 1e9, profile), profile)
    nodes = max(1, gpus // profile.devices_per_node)
    if placement == "full":
        rollout_gpus, judge_gpus = gpus, gpus
    else:
        if judge_per_node % judge.tp or not 0 < judge_per_node < profile.devices_per_node:
            raise ValueError(f"judges on {judge_per_node} GPUs a node: need a multiple of the judge's TP {judge.tp} "
                             f"below {profile.devices_per_node}")
        judge_gpus = judge_per_node * nodes
        rollout_gpus = gpus - judge_gpus
    rollout_replicas = max(1, rollout_gpus // policy.tp)
    judge_replicas = max(1, judge_gpus // judge.tp)
    per_replica = math.ceil(work.responses_per_step / rollout_replicas)
    decode = [max(1, round(x * work.max_tokens)) for x in _share(lengths, per_replica)]
    import random

    random.Random(0).shuffle(decode)  # responses start in no order of length
    gen = run_engine(policy, [Sequence(0.0, work.prompt_tokens, d, i) for i, d in enumerate(decode)],
                     work.max_num_seqs)
    # each judge replica gets its share of every rollout replica's responses, as they finish
    share = rollout_replicas / judge_replicas
    arrivals = []
    for n, (t, tag) in enumerate(sorted(gen.finished)):
        copies = math.floor((n + 1) * share) - math.floor(n * share)
        arrivals += [(t, decode[tag])] * copies
    if placement == "full":
        arrivals = [(0.0, d) for _, d in arrivals]
    # a response's votes share its prefill (vLLM's prefix cache): the first vote pays it
    judged = run_engine(judge, [Sequence(t, work.prompt_tokens + d, work.judge_tokens, i, cached=v > 0)
                                for i, (t, d) in enumerate(arrivals) for v in range(work.votes)], work.max_num_seqs)
    if placement == "full":
        switch = policy.switch_seconds() + judge.switch_seconds() * 2 + policy.switch_seconds()
        into_judging = policy.switch_seconds() + judge.switch_seconds()
        seconds = gen.seconds + into_judging + judged.seconds + judge.switch_seconds()
        judge_busy = [(a + gen.seconds + into_judging, b + gen.seconds + into_judging) for a, b in judged.busy]
        held_rollout, held_judge = gen.seconds * rollout_gpus, judged.seconds * judge_gpus
        rollout_busy_time, judge_busy_time = gen.seconds, judged.seconds
        switch_seconds = switch
        seconds += policy.switch_seconds()  # the rollout engines wake again for the next step
    else:
        wake = max(policy.switch_seconds(), judge.switch_seconds())
        seconds = wake + max(gen.seconds, judged.seconds) + wake
        judge_busy = [(a + wake, b + wake) for a, b in judged.busy]
        held = seconds - 2 * wake
        held_rollout, held_judge = held * rollout_gpus, held * judge_gpus
        rollout_busy_time, judge_busy_time = gen.seconds, sum(b - a for a, b in judged.busy)
        switch_seconds = 2 * wake
    tokens = work.responses_per_step * (work.prompt_tokens + sum(decode) / len(decode))
    train = 6 * policy.params * tokens / (gpus * profile.bf16_tflops * 1e12 * profile.compute_efficiency)
    rollout_util = gen.full_batch_seconds * rollout_replicas * policy.tp / max(held_rollout, 1e-9)
    judge_util = judged.full_batch_seconds * judge_replicas * judge.tp / max(held_judge, 1e-9)
    held_time = held_rollout / rollout_gpus
    return ClusterResult(placement, gpus, judge_gpus, seconds, train, gen.seconds, switch_seconds, min(1.0, rollout_util),
                         min(1.0, judge_util), 1 - rollout_busy_time / max(held_time, 1e-9),
                         1 - judge_busy_time / max(held_judge / judge_gpus, 1e-9),
                         [(a + (0 if placement == "full" else wake), b + (0 if placement == "full" else wake))
                          for a, b in gen.busy], judge_busy)


def best_partial(lengths: list[float], work: ClusterWorkload, profile: DeviceProfile, gpus: int) -> ClusterResult:
    """Partial colocation at the judge share of each node that is fastest."""
    judge = fit_tp(work.judge_params_b * 1e9, profile)
    options = [j for j in range(judge, profile.devices_per_node, judge)]
    if not options:
        raise ValueError(f"the judge needs {judge} GPUs: no node of {profile.devices_per_node} can split")
    return min((simulate_cluster(lengths, work, profile, gpus, "partial", j) for j in options), key=lambda r: r.seconds)
