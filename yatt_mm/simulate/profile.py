"""Device profiles: what `yatt-mm simulate` needs to know about a machine to replay a run on it.

A GPU profile holds a node's published figures (memory, memory bandwidth, dense bf16 FLOP/s,
the host link) and two efficiencies; the cluster model (yatt_mm/simulate/cluster.py) turns them
into the time of an engine step. A CPU profile holds what was measured on one machine by
`python -m yatt_mm.simulate.calibrate` (configs/profiles/cpu_2core.yaml): how fast the rollout
engine generates and what a response costs the judges when the two run side by side under
partial colocation, relative to each alone on every core under full colocation.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from yatt_mm.config import ConfigError, load


@dataclass
class CpuCalibration:
    # judge cores -> generation speed beside a streaming judge server, relative to generation alone on every core
    rollout_speed: dict[float, float] = field(default_factory=dict)
    # judge cores -> a streamed response's judge cost on the server, relative to batched in-process judging on every core
    judge_cost: dict[float, float] = field(default_factory=dict)
    rounds: int = 0  # interleaved measurement rounds behind each figure (medians)
    measured: str = ""  # when and where it was measured, and under what load

    def validate(self) -> None:
        for name in ("rollout_speed", "judge_cost"):
            table = getattr(self, name)
            if not table:
                raise ValueError(f"calibration.{name} is empty: measure it with `python -m yatt_mm.simulate.calibrate`")
            if any(float(k) <= 0 or v <= 0 for k, v in table.items()):
                raise ValueError(f"calibration.{name}: judge cores and factors must be > 0, got {table}")


@dataclass
class DeviceProfile:
    name: str = ""  # what the profile describes, e.g. "H100 SXM node"
    kind: Literal["cpu", "gpu"] = "gpu"  # gpu: published figures and the cluster model; cpu: a calibration
    devices_per_node: int = 8  # GPUs (gpu) or cores (cpu) of one node
    source: str = ""  # where the figures come from (datasheet, measurement)
    memory_gb: float = 0.0  # gpu: memory of one GPU, GB
    memory_bandwidth_tbs: float = 0.0  # gpu: HBM bandwidth of one GPU, TB/s (datasheet)
    bf16_tflops: float = 0.0  # gpu: dense bf16 tensor FLOP/s of one GPU, TFLOP/s (datasheet, no sparsity)
    host_link_gbs: float = 0.0  # gpu: host <-> GPU bandwidth of one GPU, GB/s (sleep/wake, offload)
    # gpu: one GPU's network link to other nodes, GB/s (the trainer's weights broadcast to rollout
    # GPUs under run.max_staleness); 0: the host link's figure is used
    network_gbs: float = 0.0
    bandwidth_efficiency: float = 0.7  # gpu: share of the memory bandwidth a decode step achieves
    compute_efficiency: float = 0.5  # gpu: share of the FLOP/s a prefill achieves
    step_overhead_ms: float = 3.0  # gpu: an engine step's fixed cost (scheduling, sampling, launch), ms
    calibration: CpuCalibration | None = None  # cpu: measured factors (python -m yatt_mm.simulate.calibrate)

    def validate(self) -> None:
        if self.devices_per_node < 1:
            raise ValueError(f"devices_per_node must be >= 1, got {self.devices_per_node}")
        if self.kind == "gpu":
            for name in ("memory_gb", "memory_bandwidth_tbs", "bf16_tflops", "host_link_gbs"):
                if getattr(self, name) <= 0:
                    raise ValueError(f"a gpu profile needs {name} > 0 (from the GPU's datasheet)")
            if self.network_gbs < 0:
                raise ValueError(f"network_gbs must be >= 0 (0: the host link's), got {self.network_gbs}")
            for name in ("bandwidth_efficiency", "compute_efficiency"):
                if not 0 < getattr(self, name) <= 1:
                    raise ValueError(f"{name} must be in (0, 1], got {getattr(self, name)}")
        elif self.calibration is None:
            raise ValueError("a cpu profile needs its calibration: measure it with "
                             "`python -m yatt_mm.simulate.calibrate configs/profiles/NAME.yaml`")


def load_profile(path: str | Path) -> DeviceProfile:
    """A profile from YAML; a missing file or a bad field is an error that names the fix."""
    path = Path(path)
    if not path.is_file():
        shipped = sorted(p.name for p in (Path(__file__).resolve().parents[2] / "configs" / "profiles").glob("*.yaml"))
        raise ConfigError(f"profile {path} not found; the shipped ones are configs/profiles/{{{','.join(shipped)}}}")
    try:
        return load(DeviceProfile, path)
    except ConfigError as e:
        raise ConfigError(f"profile {path}: {e}") from e


def interpolate(table: dict[float, float], x: float) -> float:
    """A measured table read between (and beyond: the nearest end) its points."""
    points = sorted((float(k), v) for k, v in table.items())
    if x <= points[0][0]:
        return points[0][1]
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return points[-1][1]
