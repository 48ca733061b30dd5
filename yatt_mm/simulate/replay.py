"""The one model of a step's rollout and judging that the dynamic split and the simulator share.

A wave is what one call of the rollout engine generated: each sample's finish time (seconds
from the start of generation) and the judges' cost per response. Under partial colocation each
sample goes to the judges the moment it finishes; the judges work through what has arrived,
one response after another at their measured cost (a work-conserving queue), so the wave ends
when generation has ended and the judges have drained. Under full colocation the judges start
when generation ends and take the whole batch. Changing a side's devices scales its times by
the ratio of its speeds (`speed`: relative throughput at a number of devices; linear unless a
device profile says otherwise).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable


@dataclass
class Wave:
    generation_seconds: float  # from the first request to the last sample's end
    sample_ends: list[float]  # when each sample finished, seconds from the start of generation
    judge_seconds_per_response: float  # the judges' cost of one response, on the devices measured
    sample_tokens: list[int] = field(default_factory=list)  # each sample's length (for reports)

    @property
    def responses(self) -> int:
        return len(self.sample_ends)


def linear(units: float) -> float:
    return units


@dataclass(frozen=True)
class Replay:
    """What a wave took under one placement: the seconds of its rollout+reward, and the busy
    seconds of each side (for idle shares)."""

    seconds: float
    generation_seconds: float
    judge_busy_seconds: float
    judge_after_generation: float  # of the wave's seconds, those after generation ended
    backlog_at_generation_end: int  # responses not yet judged when generation ended
    judging: tuple[tuple[float, float], ...] = ()  # when the judges worked (for timeline drawings)


def replay_partial(wave: Wave, rollout_speedup: float = 1.0, judge_speedup: float = 1.0) -> Replay:
    """The wave with generation `rollout_speedup` times and judging `judge_speedup` times as
    fast as measured, each sample judged from the moment it finished."""
    cost = wave.judge_seconds_per_response / judge_speedup
    generation_end = wave.generation_seconds / rollout_speedup
    free = 0.0  # when the judges next have nothing to do
    backlog = 0
    judging: list[list[float]] = []
    for end in sorted(wave.sample_ends):
        arrival = end / rollout_speedup
        begin = max(free, arrival)
        free = begin + cost
        if judging and begin <= judging[-1][1] + 1e-12:
            judging[-1][1] = free
        else:
            judging.append([begin, free])
        if free > generation_end:
            backlog += 1
    seconds = max(generation_end, free)
    return Replay(seconds, generation_end, cost * wave.responses, seconds - generation_end, backlog,
                  tuple((a, b) for a, b in judging))


def replay_full(wave: Wave, rollout_speedup: float = 1.0, judge_speedup: float = 1.0,
                switch_seconds: float = 0.0) -> Replay:
    """The wave generated, then (after `switch_seconds` of handing the devices over) judged as
    one batch."""
    generation_end = wave.generation_seconds / rollout_speedup
    judging = wave.judge_seconds_per_response / judge_speedup * wave.responses
    seconds = generation_end + switch_seconds + judging
    return Replay(seconds, generation_end, judging, seconds - generation_end, wave.responses,
                  ((generation_end + switch_seconds, seconds),))


def speedup(speed: Callable[[float], float], measured_units: float, units: float) -> float:
    """How much faster a side runs on `units` devices than on the `measured_units` it had."""
    return speed(units) / speed(measured_units)


def busy_seconds(intervals: list[tuple[float, float]], until: float | None = None) -> float:
    """Seconds covered by the union of `intervals` (before `until`, if given): how long some
    request was open."""
    merged: list[list[float]] = []
    for a, b in sorted(intervals):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    if until is None:
        return sum(b - a for a, b in merged)
    return sum(max(0.0, min(b, until) - a) for a, b in merged)
