"""What the plan is asked about besides the config: the cluster (`Cluster`: as the config's
`cluster` section states it, each figure a flag gives taking its place, the rest `Cluster`'s
defaults; `plan_cluster`), what the config does not say about the data (`Assumptions`), and the
checks that refuse impossible figures before any work (`input_problems`; `check_inputs` raises
them as a PlanError)."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

from yatt_mm.plan.constants import GIB, PlanError


@dataclass(frozen=True)
class Cluster:
    gpus_per_node: int = 8
    gpu_memory_gib: float = 80.0
    nodes: int = 1
    host_memory_gib: float = 0.0  # 0: not checked

    @property
    def world(self) -> int:
        return self.gpus_per_node * self.nodes

    @property
    def gpu_bytes(self) -> int:
        return int(self.gpu_memory_gib * GIB)


@dataclass(frozen=True)
class Assumptions:
    """What the config does not say about the data: 0 / -1 take the defaults of rl_micro_batch."""

    seq_len: int = 0
    media_tokens: int = -1
    frame_tokens: int = 0


# Each input: its `yatt-mm plan` flag, the least value that makes sense, whether it must be above
# that value (else at least it), whether it counts things (a whole number), and what it is.
_INPUTS = {
    "gpus_per_node": ("--gpus-per-node", 1, False, True, "GPUs per node"),
    "gpu_memory_gib": ("--gpu-memory-gb", 0, True, False, "memory of one GPU, GiB"),
    "nodes": ("--nodes", 1, False, True, "nodes"),
    "host_memory_gib": ("--host-memory-gb", 0, False, False, "host memory per node, GiB; 0: not checked"),
    "seq_len": ("--seq-len", 0, False, True, "longest training row; 0: rollout.engine.max_model_len"),
    "media_tokens": ("--media-tokens", -1, False, True, "media tokens per sample; -1: from data.media"),
    "frame_tokens": ("--frame-tokens", 0, False, True, "merged tokens per image or frame; 0: from data.media"),
}


def plan_cluster(stated: dict[str, float], given: dict[str, float]) -> Cluster:
    """The cluster to plan on: each figure as the flags give it, else as the config states it
    (RLConfig.cluster.stated()), else Cluster's default."""
    return Cluster(**{**stated, **given})


def cluster_sources(stated: dict[str, float], given: dict[str, float]) -> str:
    """Where plan_cluster took each figure from, in words, flags by their names."""
    names = [f.name for f in fields(Cluster)]
    parts = [("the flags", [_INPUTS[n][0] for n in names if n in given]),
             ("the config", [f"cluster.{n}" for n in names if n in stated and n not in given]),
             ("the defaults", [n for n in names if n not in stated and n not in given])]
    return "cluster figures from " + "; from ".join(f"{where}: {', '.join(which)}" for where, which in parts if which)


def input_problems(cluster: Cluster, assume: Assumptions = Assumptions()) -> list[str]:
    """One message per impossible figure (a count below one, a non-positive GPU memory, a value
    that is not a finite number...), each naming its flag and its field: empty when all are usable."""
    out = []
    for obj in (cluster, assume):
        for f in fields(obj):
            flag, least, strict, whole, what = _INPUTS[f.name]
            value = getattr(obj, f.name)
            about = f"({what}; {type(obj).__name__}.{f.name})"
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                out.append(f"{flag} must be a finite number, not {value!r} {about}")
            elif whole and value != int(value):
                out.append(f"{flag} must be a whole number, not {value!r} {about}")
            elif value < least or (strict and value == least):
                out.append(f"{flag} must be {'>' if strict else '>='} {least}, not {value!r} {about}")
    return out


def check_inputs(cluster: Cluster, assume: Assumptions = Assumptions()) -> None:
    """PlanError naming every impossible figure of `cluster` and `assume`."""
    problems = input_problems(cluster, assume)
    if problems:
        raise PlanError("; ".join(problems))
