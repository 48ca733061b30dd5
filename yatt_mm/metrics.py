"""Metrics a person can plot: one JSON line per step (and TensorBoard when it is installed),
plus a per-rank phase timeline."""

from __future__ import annotations

import json
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path


class MetricsWriter:
    """Rank 0 writes `metrics.jsonl`; every rank writes its own `timeline_rank{r}.jsonl`."""

    def __init__(self, run_dir: str | Path, rank: int = 0, tensorboard: bool = True):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.rank = rank
        self._jsonl = open(self.run_dir / "metrics.jsonl", "a") if rank == 0 else None
        self._tb = None
        if rank == 0 and tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(str(self.run_dir / "tb"))
            except ImportError:  # tensorboard is optional
                self._tb = None

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if self._jsonl is None:
            return
        record = {"step": step, "time": time.time(), **{k: _plain(v) for k, v in metrics.items()}}
        self._jsonl.write(json.dumps(record) + "\n")
        self._jsonl.flush()
        if self._tb is not None:
            for k, v in metrics.items():
                if isinstance(v, (int, float)):
                    self._tb.add_scalar(k, v, step)

    def close(self) -> None:
        if self._jsonl:
            self._jsonl.close()
        if self._tb:
            self._tb.close()


def _plain(v):
    try:
        return float(v)
    except (TypeError, ValueError):
        return v


@dataclass
class Timeline:
    """Start and end of every phase on this rank, for the phase timeline and idle share."""

    rank: int
    path: Path | None = None
    spans: list[dict] = field(default_factory=list)

    @contextmanager
    def phase(self, name: str, step: int):
        start = time.time()
        try:
            yield
        finally:
            span = {"rank": self.rank, "step": step, "phase": name, "start": start, "end": time.time()}
            self.spans.append(span)
            if self.path is not None:
                with open(self.path, "a") as f:
                    f.write(json.dumps(span) + "\n")

    def record(self, name: str, step: int, start: float, end: float, **detail) -> None:
        """A span inside a phase (one request: its generation, its judging), for overlap
        measurements and replay; kind "request", so it does not count as phase time."""
        span = {"rank": self.rank, "step": step, "phase": name, "start": start, "end": end, "kind": "request", **detail}
        self.spans.append(span)
        if self.path is not None:
            with open(self.path, "a") as f:
                f.write(json.dumps(span) + "\n")

    def seconds(self, step: int) -> dict[str, float]:
        out: dict[str, float] = {}
        for s in self.spans:
            if s["step"] == step and s.get("kind") != "request":
                out[s["phase"]] = out.get(s["phase"], 0.0) + s["end"] - s["start"]
        return out
