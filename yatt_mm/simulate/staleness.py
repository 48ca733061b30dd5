"""Asynchronous RL predicted from a synchronous run: the step time at `run.max_staleness` k >= 1.

A synchronous step is generation (the controller: rollout, reward, dynamic sampling, building
the samples), then training (old logprobs and the update), then the weight copy into the rollout
engine (sync, probe, eval). With k >= 1 each controller generates step n+1's samples while step
n trains, and the weight copy waits for that rollout to end (yatt_mm/rl/rollout_ahead.py: one
step ahead whatever k; a larger k only lets the sampler's buffer hand older groups on). So step
n takes max(T[n], G[n+1]) + C[n]: training n beside the slowest DP group's generation of n+1,
then the copy. The first step generates its own samples first; the last has nothing to generate.
Every DP group's controller has a timeline; training waits for the slowest group.

Here (the run's own machine) both sides share the same cores (on CPU the rollout is a thread of
each rank beside its trainer), so a step also takes at least the CPU seconds both sides need
over the node's cores ("cpu"-bound). On a GPU profile the sides get their own GPUs: the run's
length mix is scaled to the cluster model (yatt_mm/simulate/cluster.py) on the rollout GPUs,
training (its estimate) to the rest, and the copy is the policy's bf16 weights over each GPU's
network link; the synchronous baseline is the same work colocated on every GPU, with the
trainer's offload around the rollout.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from yatt_mm.simulate.cluster import ClusterWorkload, Model, fit_tp, simulate_cluster
from yatt_mm.simulate.profile import DeviceProfile
from yatt_mm.simulate.trace import TraceError

# the controller's phases (and their device switches): what runs ahead under staleness k >= 1
GENERATION = ("rollout", "reward", "teacher", "rollout_reward", "prepare")
TRAINING = ("logprobs", "train")
# at a step boundary with the new weights: the copy into the engine, its check, held-out eval
PAUSE = ("sync", "probe", "eval")
# a collective between the DP groups' controllers: the groups that came first wait in it for the
# last, so only the shortest rank's time is its own work
BALANCE = ("balance",)
ADAM_BYTES_PER_PARAM = 16  # bf16 weights and grads, fp32 master weights and two Adam moments


@dataclass
class StepPhases:
    step: int
    generation: dict[int, float]  # DP group leader rank -> its controller's seconds
    generation_cpu: dict[int, float | None]  # rank -> CPU seconds of generating and judging (None: not measured)
    training: float  # the slowest rank's logprobs + update, the balance's own cost, what ran outside any phase
    pause: float  # the slowest rank's sync + probe + eval: stops generation under staleness k >= 1
    seconds: float  # measured: from this step's start to the next one's

    @property
    def slowest_generation(self) -> float:
        return max(self.generation.values())


@dataclass
class RunPhases:
    run_dir: Path
    units: int  # the node's devices both sides share (CPU: cores)
    kind: str  # "cpu" or "gpu"
    train_threads: int  # torch threads of a rank's trainer
    steps: list[StepPhases] = field(default_factory=list)


def read_phases(run_dir: str | Path) -> RunPhases:
    """Every DP group leader's phase seconds per step, from the run's `timeline_rank*.jsonl`."""
    run_dir = Path(run_dir)
    paths = sorted(run_dir.glob("timeline_rank*.jsonl")) if run_dir.is_dir() else []
    if not paths:
        raise TraceError(f"{run_dir}: no timeline_rank*.jsonl; give the run directory of a `yatt-mm rl` run")
    spans = [json.loads(line) for p in paths for line in p.read_text().splitlines() if line.endswith("}")]
    devices = [s for s in spans if s["phase"] == "devices"]
    if not devices:
        raise TraceError(f"{run_dir}: no 'devices' record; the run predates per-sample timelines: rerun it with "
                         "this version of yatt-mm")
    if devices[0].get("placement") not in (None, "full"):
        raise TraceError(f"{run_dir}: a {devices[0]['placement']} run; the staleness prediction starts from a "
                         "synchronous run under full colocation (run.placement=full, run.max_staleness=0)")
    run = RunPhases(run_dir, int(devices[0]["units"]), devices[0].get("device", "cpu"),
                    int(devices[0].get("threads") or 1))
    phases = [s for s in spans if s.get("kind") != "request" and s["step"] >= 0]
    requests = [s for s in spans if s.get("kind") == "request" and s["step"] >= 0]
    numbers = sorted({s["step"] for s in phases})
    starts = {n: min(s["start"] for s in phases if s["step"] == n) for n in numbers}
    for i, n in enumerate(numbers):
        mine = [s for s in phases if s["step"] == n]
        end = starts[numbers[i + 1]] if i + 1 < len(numbers) else max(s["end"] for s in mine)
        run.steps.append(_step(n, mine, [s for s in requests if s["step"] == n], end - starts[n]))
    if not run.steps:
        raise TraceError(f"{run_dir}: no RL step finished in this run; let it run at least one step")
    return run


def _step(step: int, phases: list[dict], requests: list[dict], seconds: float) -> StepPhases:
    ranks = sorted({s["rank"] for s in phases})

    def on(rank: int, names: tuple[str, ...]) -> float:
        names = names + tuple(f"switch:{n}" for n in names)
        return sum(s["end"] - s["start"] for s in phases if s["rank"] == rank and s["phase"] in names)

    leaders = [r for r in ranks if on(r, GENERATION) > 0] or ranks
    generation = {r: on(r, GENERATION) for r in leaders}
    cpu: dict[int, float | None] = {}
    for r in leaders:
        parts = [s.get("cpu") for s in requests if s["rank"] == r and s["phase"] in ("generate", "judge_batch", "teacher_batch")]
        cpu[r] = sum(parts) if parts and None not in parts else None
    training = max(on(r, TRAINING) for r in ranks) + min(on(r, BALANCE) for r in ranks)
    pause = max(on(r, PAUSE) for r in ranks)
    # what no phase holds (handing samples over, metrics): on the trainer's path, as in the sync run
    training += seconds - (max(generation.values()) + training + pause)
    return StepPhases(step, generation, cpu, training, pause, seconds)


@dataclass
class StalenessResult:
    staleness: int
    measured: list[float]  # per step, as the run went
    predicted: list[float]  # per step, at staleness k
    critical: list[str]  # per step: "rollout", "train" or "cpu": what held the step back
    steady_from: int  # the first step counted (after start-up)
    steady_to: int  # the first step not counted (the last one has nothing to generate beside it)

    def mean(self, values: list[float]) -> float:
        """Over the steady steps. A mean, not a median: ahead of training, each step's generation
        moves to the step before, so per-step values shift between steps while their total holds."""
        return statistics.mean(values[self.steady_from:self.steady_to] or values)

    @property
    def measured_seconds(self) -> float:
        return self.mean(self.measured)

    @property
    def predicted_seconds(self) -> float:
        return self.mean(self.predicted)

    @property
    def ratio(self) -> float:
        return self.predicted_seconds / self.measured_seconds

    @property
    def bound(self) -> str:
        counted = self.critical[self.steady_from:self.steady_to] or self.critical
        return max(sorted(set(counted)), key=counted.count)


def pipeline(generation: list[dict[int, float]], training: list[float], pause: list[float], ahead: bool
             ) -> tuple[list[float], list[str]]:
    """Seconds per step, synchronous (G[n] + T[n] + C[n]) or one step ahead (step n: max(T[n],
    G[n+1]) + C[n], the first step's own generation before it); G[n] is the slowest DP group's.
    And per step what held it back: "rollout" (training waited for samples) or "train"."""
    gen = [max(g.values()) for g in generation]
    steps, critical = [], []
    for n, (t, c) in enumerate(zip(training, pause)):
        if not ahead:
            steps.append(gen[n] + t + c)
            critical.append("rollout" if gen[n] > t else "train")
            continue
        following = gen[n + 1] if n + 1 < len(gen) else 0.0
        steps.append((gen[0] if n == 0 else 0.0) + max(t, following) + c)
        critical.append("rollout" if following > t else "train")
    return steps, critical


def predict_here(run: RunPhases, k: int) -> StalenessResult:
    """The run's own machine at staleness k: both sides on the same cores, each rank's rollout
    thread beside its trainer."""
    if k < 0:
        raise ValueError(f"--staleness must be >= 0, got {k}")
    steps = run.steps
    predicted, critical = pipeline([s.generation for s in steps], [s.training for s in steps],
                                   [s.pause for s in steps], k > 0)
    if k:
        for n, s in enumerate(steps[:-1]):  # the CPU training n and generating n+1 need, over the node's cores
            need = (training_cpu(s, run) + generation_cpu(steps[n + 1], run)) / run.units + s.pause
            need += steps[0].slowest_generation if n == 0 else 0.0
            if need > predicted[n]:
                predicted[n], critical[n] = need, "cpu"
    # the steady state: neither the first step (start-up, and its own generation) nor the last
    # (nothing left to generate beside it)
    return StalenessResult(k, [s.seconds for s in steps], predicted, critical, 1 if len(steps) > 2 else 0,
                           len(steps) - 1 if len(steps) > 2 else len(steps))


def generation_cpu(step: StepPhases, run: RunPhases) -> float:
    """CPU seconds of a step's generating and judging, as measured (where not measured: the
    rank's share of the cores for as long as it generated)."""
    per_rank = run.units / max(len(step.generation), 1)
    return sum(c if c is not None else step.generation[r] * per_rank for r, c in step.generation_cpu.items())


def generation_cpu_share(run: RunPhases) -> float | None:
    """The median share of a core a DP group's generation got (its CPU seconds over its seconds):
    well below one, either it waited on something (what overlapping can fill) or other tenants of
    the machine took the core (which the CPU bound cannot see, so the prediction is optimistic)."""
    shares = [c / s.generation[r] for s in run.steps for r, c in s.generation_cpu.items()
              if c is not None and s.generation[r] > 0]
    return statistics.median(shares) if shares else None


def training_cpu(step: StepPhases, run: RunPhases) -> float:
    """CPU seconds of a step's training: every rank's trainer busy at its torch threads (within
    its share of the cores) for the whole training time (compute-bound)."""
    ranks = max(len(step.generation), 1)
    return step.training * min(run.train_threads, run.units / ranks) * ranks


@dataclass
class ClusterStaleness:
    gpus: int
    rollout_gpus: int  # async: the GPUs generating (and judging); the trainer has the rest
    sync_seconds: float  # colocated on every GPU: rollout + reward, the trainer's offload and reload, training
    sync_parts: dict[str, float]
    async_seconds: float  # max(generation, training) + copy
    async_parts: dict[str, float]

    @property
    def ratio(self) -> float:
        return self.async_seconds / self.sync_seconds

    @property
    def bound(self) -> str:
        return "rollout" if self.async_parts["generation"] >= self.async_parts["training"] else "train"


def predict_cluster(lengths: list[float], work: ClusterWorkload, profile: DeviceProfile, gpus: int,
                    rollout_gpus: int = 0) -> ClusterStaleness:
    """A step of the scaled workload, synchronous (colocated) and at staleness >= 1 with
    `rollout_gpus` generating (0: the split that predicts the shortest step)."""
    if profile.kind != "gpu":
        raise ValueError("predict_cluster needs a gpu profile")
    work.validate()
    policy = Model(work.policy_params_b * 1e9, fit_tp(work.policy_params_b * 1e9, profile), profile)
    full = simulate_cluster(lengths, work, profile, gpus, "full")
    offload = 2 * ADAM_BYTES_PER_PARAM * policy.params / gpus / (profile.host_link_gbs * 1e9)
    sync = {"rollout_reward": full.seconds, "trainer_offload": offload, "training": full.train_seconds}
    link = profile.network_gbs or profile.host_link_gbs
    copy = policy.weight_bytes / (link * 1e9)  # a pipelined broadcast: about the bytes over one link

    def split(r: int) -> ClusterStaleness:
        gen = simulate_cluster(lengths, work, profile, r, "full")
        parts = {"generation": gen.seconds, "training": full.train_seconds * gpus / (gpus - r), "copy": copy}
        return ClusterStaleness(gpus, r, sum(sync.values()), sync, max(parts["generation"], parts["training"]) + copy,
                                parts)

    if rollout_gpus:
        if rollout_gpus % policy.tp or not 0 < rollout_gpus < gpus:
            raise ValueError(f"--rollout-gpus {rollout_gpus}: need a multiple of the policy's TP {policy.tp} "
                             f"below {gpus}")
        return split(rollout_gpus)
    # whole nodes once there are several, else the policy's TP steps within the node
    notch = policy.tp
    options = list(range(notch, gpus, notch))
    if not options:
        raise ValueError(f"{gpus} GPUs cannot be split into rollout and training (policy TP {policy.tp})")
    return min((split(r) for r in options), key=lambda s: s.async_seconds)
