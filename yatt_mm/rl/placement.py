"""Placement: which role holds the devices in each phase of a step. A plan is plain data, so it
can be printed and tested; `PhaseRunner` carries it out by acquiring the roles a phase needs and
releasing the others, timing each phase on this rank.

Full colocation: rollout, reward and train take turns on all devices. Partial colocation: one
phase in which rollout and reward run side by side on split devices, responses streaming to the
judges as they finish (the controller asks the plan which of the two it runs), then training.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

from yatt_mm.metrics import Timeline


@dataclass(frozen=True)
class Phase:
    name: str
    roles: tuple[str, ...]  # roles that must hold their resources during the phase
    devices: str = "all"  # full colocation: every phase has all of the rank's devices


@dataclass(frozen=True)
class PlacementPlan:
    mode: str
    phases: tuple[Phase, ...]

    def overlaps(self, *roles: str) -> bool:
        """Whether one phase holds all of `roles` at once."""
        return any(set(roles) <= set(p.roles) for p in self.phases)

    def describe(self) -> str:
        return f"placement {self.mode}: " + " -> ".join(f"{p.name}[{'+'.join(p.roles) or '-'}]" for p in self.phases)


# After rollout and reward, both placements run the same phases: building and balancing the
# training samples (no devices), then the trainer, the weight sync, and eval on the engine.
AFTER_GENERATION = (
    Phase("prepare", ()),
    Phase("balance", ()),
    Phase("logprobs", ("train",)),
    Phase("train", ("train",)),
    Phase("sync", ("train", "rollout")),
    Phase("eval", ("rollout",)),
)


def full_colocation() -> PlacementPlan:
    return PlacementPlan("full", (Phase("rollout", ("rollout",)), Phase("reward", ("judge",))) + AFTER_GENERATION)


def partial_colocation() -> PlacementPlan:
    """Rollout and the GenRM judges side by side (the judges as vLLM servers on their own share
    of the devices), each prompt's responses going to the judges the moment they finish; then
    training takes every device."""
    return PlacementPlan("partial", (Phase("rollout_reward", ("rollout", "judge"), devices="split"),)
                         + AFTER_GENERATION)


PLANS = {"full": full_colocation, "partial": partial_colocation}


class PhaseRunner:
    """Runs phases of a plan: before a phase, releases every resident role the phase does not
    need (vLLM sleep on GPUs; a no-op for CPU engines kept resident) and acquires those it does."""

    def __init__(self, plan: PlacementPlan, resources: dict[str, list], timeline: Timeline):
        self.plan = plan
        self.phases = {p.name: p for p in plan.phases}
        # role -> the objects (with acquire()/release()) that hold its memory, e.g. judge engines
        self.resources = {role: objs for role, objs in resources.items() if objs}
        self.timeline = timeline
        self.resident: set[str] = set(self.resources)
        self.switch_seconds = 0.0

    @contextmanager
    def phase(self, name: str, step: int):
        spec = self.phases[name]
        with self.timeline.phase(f"switch:{name}", step):
            for role in sorted(self.resident - set(spec.roles)):
                self.switch_seconds += sum(obj.release() for obj in self.resources[role])
                self.resident.discard(role)
            for role in spec.roles:
                if role in self.resources and role not in self.resident:
                    self.switch_seconds += sum(obj.acquire() for obj in self.resources[role])
                    self.resident.add(role)
        with self.timeline.phase(name, step):
            yield
