"""What the plan is asked about besides the config: the cluster (`Cluster`) and what the config
does not say about the data (`Assumptions`)."""

from __future__ import annotations

from dataclasses import dataclass

from yatt_mm.plan.constants import GIB


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

