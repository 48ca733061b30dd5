"""Partial colocation's split of a node's devices between the rollout engine and the judge
servers, decided between steps from what the last step measured.

Each step the controller hands over its waves (when every sample finished, and the judges'
cost per response, from the request timeline). The decision replays the step under the split
one notch either way (yatt_mm/simulate/replay.py: generation and judging sped up or slowed
down by the change of their devices) and moves only when the rollout+reward time is predicted
to fall by at least `min_gain`; every decision is logged with its reason. It takes effect at
the next step's first rollout_reward phase, never within a step.

Devices are a node's CPU cores (a notch is half a core: one core shared by both sides) or its
GPUs (a notch is one GPU). On CPU the split is applied for real (yatt_mm/rl/cpu_pinning.py:
every thread of the node's ranks on the rollout cores, of the judge server's processes on the
judge cores, and the controller's torch threads to match). On GPUs the decision is made and
logged as the judge servers' CUDA_VISIBLE_DEVICES (`gpu_judge_devices`), but not applied:
moving a running judge server to other GPUs between steps is not built, and none of this has
run on a GPU.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Literal

from yatt_mm.simulate.replay import Wave, linear, replay_partial, speedup


@dataclass
class SplitConfig:
    mode: Literal["dynamic", "fixed"] = "dynamic"  # dynamic: re-split each step from the measured load; fixed: judge_share
    judge_share: float = 0.5  # the judge servers' share of the node's devices at the first step (fixed: always)
    min_gain: float = 0.05  # re-split only when rollout+reward is predicted to take this share less time
    cores: int = 0  # CPU: how many of the run's cores are split (0: every core the launch may use)
    rollout_threads: int = 0  # CPU, full colocation: torch threads of the rollout phase (0: as the process started)
    judge_threads: int = 0  # CPU, full colocation: torch threads of in-process judging (0: as the process started)
    # CPU: a calibrated profile (configs/profiles/cpu_2core.yaml) for how each side's speed changes
    # with its cores; empty: in proportion to its cores
    profile: str = ""

    RANGES = {"judge_share": "(0, 1)", "min_gain": "[0, 1)", "cores": ">= 0", "rollout_threads": ">= 0",
              "judge_threads": ">= 0"}

    def validate(self) -> None:
        if self.profile:
            from yatt_mm.simulate.profile import load_profile

            if load_profile(self.profile).kind != "cpu":
                raise ValueError(f"split.profile {self.profile} is a GPU profile; the split's speeds come from a "
                                 "CPU calibration (configs/profiles/cpu_2core.yaml)")


def calibrated_speeds(profile_path: str, units: int) -> tuple[Callable[[float], float], Callable[[float], float]]:
    """(rollout speed at its cores, judge speed at its cores) from a CPU profile's calibration,
    measured at every split of `units` cores."""
    from yatt_mm.simulate.profile import interpolate, load_profile

    profile = load_profile(profile_path)
    if profile.devices_per_node != units:
        raise ValueError(f"split.profile {profile_path} was measured on {profile.devices_per_node} cores, this run "
                         f"splits {units}: calibrate this machine (python -m yatt_mm.simulate.calibrate)")
    cal = profile.calibration
    return (lambda rollout: interpolate(cal.rollout_speed, units - rollout),
            lambda judge: 1.0 / interpolate(cal.judge_cost, judge))


@dataclass(frozen=True)
class Split:
    units: int  # the node's devices that are split: cores or GPUs
    judge: float  # the judges' devices; a half is a device both sides share
    notch: float  # the smallest change: 0.5 on CPU, 1 on GPUs

    @property
    def rollout(self) -> float:
        return self.units - self.judge

    @property
    def share(self) -> float:
        return self.judge / self.units

    def moved(self, notches: int) -> "Split | None":
        """The split `notches` toward the judges (negative: away); None beyond the ends (each
        side keeps at least one notch)."""
        judge = self.judge + notches * self.notch
        if judge < self.notch or judge > self.units - self.notch:
            return None
        return Split(self.units, judge, self.notch)

    def describe(self) -> str:
        return f"judges {self.judge:g} of {self.units} {'GPUs' if self.notch == 1 else 'cores'}"


def initial_split(units: int, notch: float, judge_share: float) -> Split:
    """The split nearest `judge_share` on the notch grid; each side keeps at least one notch."""
    steps = max(1, min(round(units * judge_share / notch), round(units / notch) - 1))
    return Split(units, steps * notch, notch)


def cpu_cores(split: Split, cores: list[int]) -> tuple[list[int], list[int]]:
    """(rollout cores, judge cores): the rollout side from the first core, the judges from the
    last; with half a core each way, the middle core is in both sets (the scheduler shares it)."""
    rollout, judge = math.ceil(split.rollout), math.ceil(split.judge)
    return cores[:rollout], cores[len(cores) - judge:]


def gpu_judge_devices(split: Split) -> str:
    """The judge servers' CUDA_VISIBLE_DEVICES for a GPU split: the node's last GPUs. Decided
    and logged only; not applied (see the module's doc)."""
    judge = int(split.judge)
    return ",".join(str(g) for g in range(split.units - judge, split.units))


@dataclass(frozen=True)
class Decision:
    step: int
    split: Split  # what the step ran with
    next: Split  # what the next step runs with
    reason: str
    measured_seconds: float  # the step's rollout+reward, summed over its waves
    predicted_seconds: float  # the replay's figure for `next`
    backlog: int  # responses not yet judged when generation ended, summed over waves
    judge_seconds_per_response: float

    @property
    def move(self) -> int:
        return round((self.next.judge - self.split.judge) / self.split.notch)


def decide(step: int, split: Split, waves: list[Wave], measured_seconds: float, cfg: SplitConfig,
           speed_rollout: Callable[[float], float] = linear,
           speed_judge: Callable[[float], float] = linear) -> Decision:
    """The split for the next step, from this step's waves."""
    def predicted(option: Split) -> float:
        up_rollout = speedup(speed_rollout, split.rollout, option.rollout)
        up_judge = speedup(speed_judge, split.judge, option.judge)
        return sum(replay_partial(w, up_rollout, up_judge).seconds for w in waves)

    now = [replay_partial(w) for w in waves]
    backlog = sum(r.backlog_at_generation_end for r in now)
    responses = sum(w.responses for w in waves)
    per_response = sum(w.judge_seconds_per_response * w.responses for w in waves) / max(responses, 1)
    generation = sum(r.generation_seconds for r in now)
    judge_busy = sum(r.judge_busy_seconds for r in now)
    here = sum(r.seconds for r in now)
    load = (f"{backlog} of {responses} responses still waiting for the judges when generation ended, "
            f"{per_response * 1000:.0f} ms of judging each; judges busy {judge_busy:.2f} s of {generation:.2f} s "
            f"of generation")
    if cfg.mode == "fixed" or not waves:
        why = "fixed split (split.mode=fixed)" if cfg.mode == "fixed" else "nothing generated this step"
        return Decision(step, split, split, why, measured_seconds, here, backlog, per_response)
    options = [o for o in (split.moved(1), split.moved(-1)) if o is not None]
    best = min(options, key=predicted, default=split)
    gain = 1 - predicted(best) / max(here, 1e-9)
    if best is split or gain < cfg.min_gain:
        nearest = f"; best neighbour, {best.describe()}, predicted {predicted(best):.2f} s" if best is not split else ""
        reason = (f"kept {split.describe()}: {load}; replayed {here:.2f} s{nearest}, "
                  f"a gain under split.min_gain {cfg.min_gain:.0%}")
        return Decision(step, split, split, reason, measured_seconds, here, backlog, per_response)
    direction = "toward the judges" if best.judge > split.judge else "away from the judges"
    reason = (f"{direction}, {split.describe()} -> {best.judge:g}: {load}; rollout+reward replayed "
              f"{here:.2f} s -> {predicted(best):.2f} s ({gain:.0%} less)")
    return Decision(step, split, best, reason, measured_seconds, predicted(best), backlog, per_response)
