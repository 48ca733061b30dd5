"""A measured run replayed under a placement on the machine it ran on (CPU), step by step.

Each wave is first brought back to "alone on every core" (full colocation's conditions): under
partial colocation, generation beside the judge server ran `rollout_speed[j]` times as fast and
a streamed response cost the judges `judge_cost[j]` times a batched one (the calibration of the
device profile, at the j judge cores the wave had). From there a wave is replayed under full
colocation (generation, the measured switch, then the batch) or partial colocation at any split
(yatt_mm/simulate/replay.py). Everything else in a step (training, sync, ...) runs the same
under either placement and is kept as measured.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from yatt_mm.simulate.profile import CpuCalibration, interpolate
from yatt_mm.simulate.replay import Replay, Wave, replay_full, replay_partial
from yatt_mm.simulate.trace import RunTrace, WaveTrace


@dataclass
class PlacementResult:
    placement: str  # "full" or "partial"
    judge_units: float  # partial: the judges' devices; full: every device
    units: int
    rollout_reward_seconds: list[float] = field(default_factory=list)  # per step
    step_seconds: list[float] = field(default_factory=list)  # per step, the other phases as measured
    rollout_busy: float = 0.0  # seconds generating, summed over steps
    judge_busy: float = 0.0  # seconds judging, summed over steps
    rollout_held: float = 0.0  # device-seconds the rollout side held during rollout+reward
    judge_held: float = 0.0  # device-seconds the judges held
    rollout_cpu: float = 0.0  # CPU seconds the rollout side used (as measured; None-safe: 0 if unknown)
    judge_cpu: float = 0.0  # CPU seconds the judges used
    waves: list[tuple[Wave, Replay]] = field(default_factory=list)  # the simulated waves (for the timeline PNG)

    def idle_share(self) -> tuple[float, float]:
        """Of the time each role holds devices during rollout+reward, the share in which it has
        nothing to do: (rollout, judges)."""
        held_r = self.rollout_held / max(self.units - (self.judge_units if self.placement == "partial" else 0), 1e-9)
        held_j = self.judge_held / max(self.judge_units, 1e-9)
        return 1 - self.rollout_busy / max(held_r, 1e-9), 1 - self.judge_busy / max(held_j, 1e-9)

    def utilisation(self) -> tuple[float, float]:
        """CPU seconds each role used over the core-seconds it held: (rollout, judges); what a
        role alone cannot use of the devices it holds shows here (e.g. one busy core of two)."""
        return self.rollout_cpu / max(self.rollout_held, 1e-9), self.judge_cpu / max(self.judge_held, 1e-9)


def alone(wave: WaveTrace, cal: CpuCalibration | None) -> Wave:
    """The wave as generated and judged alone on every core (full colocation's conditions)."""
    w = wave.wave
    if wave.placement == "full" or cal is None:
        return w
    speed = interpolate(cal.rollout_speed, wave.judge_units)
    cost = interpolate(cal.judge_cost, wave.judge_units)
    return Wave(w.generation_seconds * speed, [e * speed for e in w.sample_ends], w.judge_seconds_per_response / cost,
                w.sample_tokens)


def beside(base: Wave, judge_units: float, cal: CpuCalibration | None) -> Wave:
    """A wave from alone-on-every-core to partial colocation with `judge_units` judge cores."""
    if cal is None:
        return base
    speed = interpolate(cal.rollout_speed, judge_units)
    cost = interpolate(cal.judge_cost, judge_units)
    return Wave(base.generation_seconds / speed, [e / speed for e in base.sample_ends],
                base.judge_seconds_per_response * cost, base.sample_tokens)


def predict(trace: RunTrace, placement: str, cal: CpuCalibration | None, judge_units: float | None = None
            ) -> PlacementResult:
    """`trace` replayed under `placement` (partial: at `judge_units`, default half the devices)."""
    units = trace.units
    j = judge_units if judge_units is not None else units / 2
    result = PlacementResult(placement, j if placement == "partial" else float(units), units)
    for step in trace.steps:
        seconds = 0.0
        for wave in step.waves:
            base = alone(wave, cal)
            judge_cpu = wave.judge_cpu or 0.0
            if wave.placement == "partial" and cal is not None:  # the judges' CPU, as if batched in-process
                judge_cpu /= interpolate(cal.judge_cost, wave.judge_units)
            if placement == "full":
                switch = step.switch_seconds / len(step.waves) if step.placement == "full" else 0.0
                replay = replay_full(base, switch_seconds=switch)
                result.rollout_held += replay.generation_seconds * units
                result.judge_held += (replay.seconds - replay.generation_seconds) * units
            else:
                replay = replay_partial(beside(base, j, cal))
                judge_cpu *= interpolate(cal.judge_cost, j) if cal is not None else 1.0
                result.rollout_held += replay.seconds * (units - j)
                result.judge_held += replay.seconds * j
            seconds += replay.seconds
            result.rollout_busy += replay.generation_seconds
            result.judge_busy += replay.judge_busy_seconds
            result.rollout_cpu += wave.rollout_cpu or 0.0
            result.judge_cpu += judge_cpu
            result.waves.append((base, replay))
        result.rollout_reward_seconds.append(seconds)
        result.step_seconds.append(seconds + step.other_seconds)
    return result


def best_split(trace: RunTrace, cal: CpuCalibration | None, notch: float = 0.5) -> PlacementResult:
    """Partial colocation at the split that replays fastest (each side keeps at least a notch).
    Without a calibration a split changes nothing in the replay: the run's own split (or
    half the devices) is used."""
    if cal is None:
        measured = [w.judge_units for s in trace.steps for w in s.waves if w.placement == "partial"]
        return predict(trace, "partial", None, measured[len(measured) // 2] if measured else trace.units / 2)
    options = [k * notch for k in range(1, round(trace.units / notch))]
    return min((predict(trace, "partial", cal, j) for j in options), key=lambda r: sum(r.rollout_reward_seconds))
