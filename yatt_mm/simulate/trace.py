"""A run's measured timings, read back from its directory: per step and per wave, when each
sample finished and what the judges cost, plus the other phases' seconds and the switches.

What the RL loop writes and this reads: `timeline_rank{r}.jsonl` (yatt_mm/metrics.py: phase
spans, and per-request records: "generate" per wave, "generated" per sample, "judge" per judged
sample under partial colocation, "judge_batch" per wave under full colocation, "devices" once
and "split" per decision) and `config.yaml`. An on-policy distillation teacher is scoring work
of the same kind: its "teacher" records (partial) and "teacher_batch" (full, in a phase of its
own after the judges') count with the judges' cost.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from yatt_mm.simulate.replay import Wave, busy_seconds

ROLLOUT_REWARD_PHASES = ("rollout", "reward", "teacher", "rollout_reward")


class TraceError(ValueError):
    """A run directory that cannot be replayed; the message names the fix."""


@dataclass
class WaveTrace:
    wave: Wave  # the replay's view: sample ends and the judges' cost per response
    placement: str  # "full" or "partial"
    judge_units: float  # partial: the judges' devices during the wave; full: every device
    measured_seconds: float  # rollout+reward of the wave, switches included
    rollout_cpu: float | None = None  # CPU seconds the rollout side used while generating
    judge_cpu: float | None = None  # CPU seconds the judges used (None: a server this rank does not own)


@dataclass
class StepTrace:
    step: int
    waves: list[WaveTrace]
    rollout_reward_seconds: float  # measured: the rollout/reward phases and their switches
    other_seconds: float  # measured: every other phase of the step (the same under either placement)
    switch_seconds: float  # measured: of rollout_reward_seconds, handing devices between roles

    @property
    def placement(self) -> str:
        return self.waves[0].placement if self.waves else "full"


@dataclass
class RunTrace:
    run_dir: Path
    units: int  # the node's devices the run split or shared (CPU: cores)
    kind: str  # "cpu" or "gpu"
    steps: list[StepTrace] = field(default_factory=list)
    config: dict = field(default_factory=dict)

    @property
    def placement(self) -> str:
        return self.steps[0].placement if self.steps else "full"


def read_run(run_dir: str | Path, rank: int | None = None) -> RunTrace:
    """The run's trace from one controller's timeline (rank 0 unless given; every DP group's
    leader has one)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise TraceError(f"{run_dir}: not a directory; give the run directory of a `yatt-mm rl` run (run.run_dir)")
    timelines = sorted(run_dir.glob("timeline_rank*.jsonl"))
    if not timelines:
        raise TraceError(f"{run_dir}: no timeline_rank*.jsonl; simulate replays the timelines a `yatt-mm rl` run "
                         "writes into its run directory: give that directory, or rerun the run")
    path = run_dir / f"timeline_rank{rank or 0}.jsonl"
    if not path.is_file():
        raise TraceError(f"{path} not found (timelines here: {', '.join(p.name for p in timelines)})")
    spans = [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]
    devices = [s for s in spans if s["phase"] == "devices"]
    if not devices:
        raise TraceError(f"{path}: no 'devices' record; the run predates per-sample timelines: rerun it with this "
                         "version of yatt-mm")
    if not any(s["phase"] == "generated" and "sample" in s for s in spans):
        raise TraceError(f"{path}: no per-sample 'generated' records (only a controller's rank has them, and only "
                         "runs of this version): pass --rank of a DP group's leader, or rerun the run")
    config = _config(run_dir)
    trace = RunTrace(run_dir, int(devices[0]["units"]), devices[0].get("device", "cpu"), config=config)
    for step in sorted({s["step"] for s in spans if s["step"] >= 0}):
        trace.steps.append(_step(step, [s for s in spans if s["step"] == step], trace.units))
    if not trace.steps:
        raise TraceError(f"{path}: no RL step finished in this run; let it run at least one step")
    return trace


def _config(run_dir: Path) -> dict:
    path = run_dir / "config.yaml"
    if not path.is_file():
        return {}
    import yaml

    return yaml.safe_load(path.read_text()) or {}


def _step(step: int, spans: list[dict], units: int) -> StepTrace:
    phases = [s for s in spans if s.get("kind") != "request"]
    requests = [s for s in spans if s.get("kind") == "request"]

    def seconds(names) -> float:
        return sum(s["end"] - s["start"] for s in phases if s["phase"] in names)

    rollout_reward = tuple(ROLLOUT_REWARD_PHASES) + tuple(f"switch:{p}" for p in ROLLOUT_REWARD_PHASES)
    measured = seconds(rollout_reward)
    switches = seconds(tuple(f"switch:{p}" for p in ROLLOUT_REWARD_PHASES))
    others = sum(s["end"] - s["start"] for s in phases if s["phase"] not in rollout_reward)
    splits = [s for s in requests if s["phase"] == "split"]
    judge_units = splits[0]["judge"] if splits else float(units)
    partial = any(s["phase"] == "rollout_reward" for s in phases)
    waves = []
    for gen in sorted((s for s in requests if s["phase"] == "generate"), key=lambda s: s["start"]):
        start, end = gen["start"], gen["end"]
        samples = [s for s in requests if s["phase"] == "generated" and s["start"] == start]
        ends = sorted(s["end"] - start for s in samples)
        tokens = [s["tokens"] for s in sorted(samples, key=lambda s: s["end"])]
        if partial:
            judged = [s for s in requests if s["phase"] in ("judge", "teacher")
                      and start <= s.get("handed", s["start"]) <= end + 1e-6]
            cost = busy_seconds([(s["start"], s["end"]) for s in judged]) / max(len(samples), 1)
            wave_end = max([end] + [s["end"] for s in judged])
            judging = [s for s in requests if s["phase"] == "judging" and s["start"] == start]
            judge_cpu = judging[0]["cpu"] if judging else None
            placement = "partial"
        else:
            # the wave's judge batch and teacher batch: the first of each after its generation
            found = [min(batches, key=lambda s: s["start"]) for kind in ("judge_batch", "teacher_batch")
                     if (batches := [s for s in requests if s["phase"] == kind and s["start"] >= end - 1e-6])]
            cost = sum(b["end"] - b["start"] for b in found) / max(len(samples), 1)
            wave_end = max([end] + [b["end"] for b in found])
            cpus = [b.get("cpu") for b in found]
            judge_cpu = sum(cpus) if found and None not in cpus else None
            placement = "full"
        wave = Wave(end - start, ends, cost, tokens)
        waves.append(WaveTrace(wave, placement, judge_units if partial else float(units), wave_end - start,
                               gen.get("cpu"), judge_cpu))
    return StepTrace(step, waves, measured, others, switches)
