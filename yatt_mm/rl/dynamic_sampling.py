"""Dynamic sampling: fill a step with groups whose rewards differ, without ever failing.

A group (one prompt, n responses) whose rewards are all equal has zero GRPO advantage and
teaches nothing. The sampler asks its controller for prompts in waves sized from a running
estimate of the valid-group rate, keeps surplus valid groups for the next step, and after a
bounded number of waves pads the step with masked (invalid) groups instead of crashing — the
failure mode users hit in verl ("max generation batches exceeded") and DAPO.

Which groups count as valid is a rollout filter chosen by name (`dynamic_sampling.filter`):
`reward_spread` (rewards not all equal) is built in; `module:function` takes anyone's own
`(group) -> bool`, where a group has `.rewards` (and, from the controller, `.prompt`,
`.responses` and `.reward_parts`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Generic, Protocol, TypeVar

from yatt_mm.registry import Registry


class HasRewards(Protocol):
    rewards: list[float]


G = TypeVar("G", bound=HasRewards)


FILTERS: Registry[Callable[[HasRewards], bool]] = Registry("rollout filter")


@FILTERS.register("reward_spread")
def is_valid(group: HasRewards, tol: float = 1e-9) -> bool:
    return len(group.rewards) > 1 and (max(group.rewards) - min(group.rewards)) > tol


@dataclass
class DynamicSamplingConfig:
    enabled: bool = True  # off: every generated group trains, valid or not
    filter: str = "reward_spread"  # which groups are valid: a registered filter or module:function
    max_waves: int = 3  # generation waves per step before padding with masked groups
    oversample: float = 1.2  # margin on top of the estimated need
    initial_valid_rate: float = 0.5  # valid-group rate assumed before the first wave; in [min_valid_rate, 1]
    min_valid_rate: float = 0.05  # floor on the estimate: bounds the size of one wave
    max_wave_groups: int = 64  # bounds the cost of a starved step (a policy that is always right or wrong)
    ema: float = 0.5  # weight of the newest wave in the valid-rate estimate
    max_buffer: int = 64  # surplus valid groups kept for later steps

    RANGES = {"max_waves": ">= 1", "oversample": "> 0", "initial_valid_rate": "(0, 1]", "min_valid_rate": "(0, 1]",
              "max_wave_groups": ">= 1", "ema": "(0, 1]", "max_buffer": ">= 0"}

    def validate(self) -> None:
        FILTERS.get(self.filter)
        if self.min_valid_rate > self.initial_valid_rate:
            raise ValueError(f"min_valid_rate ({self.min_valid_rate}) must be <= initial_valid_rate "
                             f"({self.initial_valid_rate})")


@dataclass
class StepGroups(Generic[G]):
    groups: list[G]  # exactly `target` when anything was generated at all
    masked: list[bool]  # True: padding, excluded from the loss
    waves: int
    generated: int  # groups generated this step
    valid_generated: int
    from_buffer: int
    exhausted: bool  # the data source returned fewer groups than asked

    @property
    def padded(self) -> int:
        return sum(self.masked)


@dataclass
class DynamicSampler(Generic[G]):
    cfg: DynamicSamplingConfig
    valid_rate: float = -1.0
    buffer: list = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.valid_rate < 0:
            self.valid_rate = self.cfg.initial_valid_rate
        self.is_valid = FILTERS.get(self.cfg.filter)

    def wave_size(self, shortfall: int) -> int:
        rate = max(self.valid_rate, self.cfg.min_valid_rate)
        return max(1, min(self.cfg.max_wave_groups, math.ceil(shortfall / rate * self.cfg.oversample)))

    def collect(self, target: int, generate: Callable[[int], list[G]]) -> StepGroups[G]:
        """`generate(n)` rolls out and scores up to n new groups (fewer when data runs out)."""
        if not self.cfg.enabled:
            groups = generate(target)
            return StepGroups(groups, [False] * len(groups), 1, len(groups),
                              sum(map(self.is_valid, groups)), 0, len(groups) < target)

        valid: list[G] = self.buffer[:target]
        self.buffer = self.buffer[target:]
        from_buffer = len(valid)
        invalid: list[G] = []
        waves = generated = valid_generated = 0
        exhausted = False
        while len(valid) < target and waves < self.cfg.max_waves and not exhausted:
            asked = self.wave_size(target - len(valid))
            wave = generate(asked)
            waves += 1
            exhausted = len(wave) < asked
            if not wave:
                break
            good = [g for g in wave if self.is_valid(g)]
            generated += len(wave)
            valid_generated += len(good)
            self.valid_rate = (1 - self.cfg.ema) * self.valid_rate + self.cfg.ema * len(good) / len(wave)
            valid.extend(good)
            invalid.extend(g for g in wave if not self.is_valid(g))

        surplus = valid[target:]
        self.buffer = (surplus + self.buffer)[: self.cfg.max_buffer]
        chosen = valid[:target]
        pad = invalid[: target - len(chosen)]
        return StepGroups(chosen + pad, [False] * len(chosen) + [True] * len(pad), waves,
                          generated, valid_generated, from_buffer, exhausted)

    def drop_older(self, min_version: int) -> int:
        """Bounded staleness: drop the buffered groups sampled by a policy older than
        `min_version` (they would train too far off-policy); returns how many."""
        kept = [g for g in self.buffer if g.version >= min_version]
        dropped = len(self.buffer) - len(kept)
        self.buffer = kept
        return dropped

    def state_dict(self, encode: Callable[[G], dict]) -> dict:
        return {"valid_rate": self.valid_rate, "buffer": [encode(g) for g in self.buffer]}

    def load_state_dict(self, state: dict, decode: Callable[[dict], G]) -> None:
        self.valid_rate = float(state["valid_rate"])
        self.buffer = [decode(g) for g in state["buffer"]]
