"""Metrics a person can plot: one JSON line per step (and TensorBoard when it is installed, and
Weights & Biases when `metrics.wandb.project` is set), plus a per-rank phase timeline."""

from __future__ import annotations

import importlib.util
import json
import sys
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Literal

WANDB_MISSING = "metrics.wandb is set but wandb is not installed: pip install 'yatt-mm[wandb]'"


@dataclass
class WandbConfig:
    project: str = ""  # Weights & Biases project; empty: no W&B (metrics.jsonl and TensorBoard only)
    name: str = ""  # the run's name in W&B; empty: the run directory's name
    mode: Literal["online", "offline", "disabled"] = "online"  # online, offline (no network; `wandb sync` uploads later) or disabled
    entity: str = ""  # W&B user or team; empty: your default entity
    group: str = ""  # W&B run group; empty: none
    tags: list[str] = field(default_factory=list)  # W&B tags of the run
    dir: str = ""  # where wandb keeps its files (a wandb/ folder in it); empty: the run directory
    images: bool = True  # at the end, log the run's PNG plots (reward curve, phase timeline) as W&B images

    @property
    def enabled(self) -> bool:
        return bool(self.project) and self.mode != "disabled"

    def validate(self) -> None:
        if not self.project and (self.name or self.entity or self.group or self.tags or self.dir):
            raise ValueError("W&B settings are given but project is empty: set metrics.wandb.project to log to W&B")


@dataclass
class MetricsConfig:
    tensorboard: bool = True  # TensorBoard event files in RUN_DIR/tb (when tensorboard is installed)
    wandb: WandbConfig = field(default_factory=WandbConfig)  # Weights & Biases, off unless project is set

    def check_installed(self) -> None:
        """Before any rank starts: the optional packages these settings ask for are there."""
        if self.wandb.enabled and importlib.util.find_spec("wandb") is None:
            raise RuntimeError(WANDB_MISSING)


class MetricsWriter:
    """Rank 0 writes `metrics.jsonl` (and TensorBoard, and a W&B run); every rank writes its own
    `timeline_rank{r}.jsonl`. With W&B on, rank 0 logs every step's metrics under the keys of
    metrics.jsonl, the run's config as wandb.config, and at close the PNGs `plots(run_dir)`
    writes, then finishes the W&B run."""

    def __init__(self, run_dir: str | Path, rank: int = 0, tensorboard: bool = True,
                 wandb: WandbConfig | None = None, config: Any = None,
                 plots: Callable[[Path], list[Path]] | None = None):
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
        self._wandb = _start_wandb(wandb, self.run_dir, config) if rank == 0 and wandb and wandb.enabled else None
        self._plots = plots if wandb and wandb.images else None
        self._last_step = 0

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if self._jsonl is None:
            return
        values = {k: _plain(v) for k, v in metrics.items()}
        record = {"step": step, "time": time.time(), **values}
        self._jsonl.write(json.dumps(record) + "\n")
        self._jsonl.flush()
        if self._tb is not None:
            for k, v in metrics.items():
                if isinstance(v, (int, float)):
                    self._tb.add_scalar(k, v, step)
        if self._wandb is not None:
            self._wandb.log(values, step=step)
            self._last_step = max(self._last_step, step)

    def close(self) -> None:
        if self._jsonl:
            self._jsonl.close()
            self._jsonl = None
        if self._tb:
            self._tb.close()
            self._tb = None
        if self._wandb is not None:
            run, self._wandb = self._wandb, None
            if self._plots is not None:
                _log_plots(run, self._plots, self.run_dir, self._last_step)
            run.finish()


def _start_wandb(cfg: WandbConfig, run_dir: Path, config: Any):
    """A W&B run for this run directory; a resumed run (same directory) continues the same W&B
    run, whose id is kept in RUN_DIR/wandb_id."""
    try:
        import wandb
    except ImportError as e:
        raise RuntimeError(WANDB_MISSING) from e
    from yatt_mm.config import to_dict

    where = Path(cfg.dir) if cfg.dir else run_dir
    where.mkdir(parents=True, exist_ok=True)
    id_file = run_dir / "wandb_id"
    run_id = id_file.read_text().strip() if id_file.is_file() else uuid.uuid4().hex[:12]
    id_file.write_text(run_id + "\n")
    plain = json.loads(json.dumps(to_dict(config), default=str)) if config is not None else None
    return wandb.init(project=cfg.project, name=cfg.name or run_dir.name, mode=cfg.mode, entity=cfg.entity or None,
                      group=cfg.group or None, tags=cfg.tags or None, dir=str(where), config=plain, id=run_id,
                      resume="allow")


def _log_plots(run, plots: Callable[[Path], list[Path]], run_dir: Path, step: int) -> None:
    import wandb

    try:
        paths = plots(run_dir)
    except Exception as e:  # the run itself is done: a plot that fails is reported, not fatal
        print(f"W&B: the run's plots were not drawn ({type(e).__name__}: {e})", file=sys.stderr, flush=True)
        return
    if paths:
        run.log({f"plots/{Path(p).stem}": wandb.Image(str(p)) for p in paths}, step=step)


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
