"""The SFT run's settings."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from dataio.index import check_shard_specs
from dataio.reader import DataConfig
from models.trainer import TrainerConfig
from yatt_mm.metrics import MetricsConfig


@dataclass
class HeldOutConfig:
    every: int = 0  # evaluate every N steps (0: only before and after training)
    samples: int = 32  # held-out examples per DP rank
    holdout_fraction: float = 0.1  # share of keys (by hash) held out of training; used when shards is empty
    shards: list[str] = field(default_factory=list)  # separate held-out shards (then nothing is held out)
    stop_at: float = 0.0  # end training early once held-out accuracy reaches this (0: never; needs every > 0)

    RANGES = {"every": ">= 0", "samples": ">= 0", "holdout_fraction": "[0, 1)", "stop_at": "[0, 1]"}

    def validate(self) -> None:
        if self.stop_at and not (self.every and self.samples):
            raise ValueError("stop_at needs every > 0 and samples > 0 (it acts on the periodic held-out accuracy)")


@dataclass
class SFTConfig:
    model: str = "tiny:policy"  # HF directory, or tiny:policy / tiny:judge (built offline by the launcher)
    data: DataConfig = field(default_factory=DataConfig)  # the training shards and how to read them
    trainer: TrainerConfig = field(default_factory=lambda: TrainerConfig(lr=1e-3))  # Megatron trainer settings
    examples: str = "answer"  # example builder: a registered name (answer) or module:function (yatt_mm/sft/examples.py)
    tasks: list[str] = field(default_factory=list)  # keep only these sample tasks (e.g. image/colour); empty: all
    steps: int = 50  # optimizer steps
    batch_size: int = 16  # samples per DP rank per step
    micro_batch_size: int = 8  # samples per forward/backward
    warmup_steps: int = 0  # linear learning-rate warmup from 0 to trainer.lr
    eval: HeldOutConfig = field(default_factory=HeldOutConfig)  # held-out loss and teacher-forced accuracy
    seed: int = 0  # random answers / judge responses
    run_dir: str | None = None  # metrics and the summary; default runs/sft-TIME
    output_dir: str | None = None  # the exported HF directory; default RUN_DIR/hf
    log_every: int = 1  # steps between progress lines
    metrics: MetricsConfig = field(default_factory=lambda: MetricsConfig(tensorboard=False))  # W&B, TensorBoard

    RANGES = {"steps": ">= 1", "batch_size": ">= 1", "micro_batch_size": ">= 1", "warmup_steps": ">= 0", "seed": ">= 0",
              "log_every": ">= 1"}

    def validate(self) -> None:
        from yatt_mm.sft.examples import get_builder

        if self.micro_batch_size > self.batch_size:
            raise ValueError(f"micro_batch_size ({self.micro_batch_size}) must be <= batch_size ({self.batch_size})")
        get_builder(self.examples)  # a clear error for an unknown name, at load time

    def check_world(self, world_size: int) -> None:
        self.trainer.check_world(world_size, "trainer")

    def check_inputs(self) -> None:
        """Before any rank starts: the training shards and the held-out shards are there
        (FileNotFoundError naming the setting)."""
        self.data.check_inputs("data")
        if self.eval.shards:
            check_shard_specs(self.eval.shards, "eval.shards")

    def check_model(self) -> None:
        """After resolve_models: the model splits into the trainer's TP x PP layout, and media
        are sized for it (data.media.factor 0: the model's patch x merge)."""
        from yatt_mm.engines.media import media_for_model

        self.trainer.check_model(self.model, "trainer")
        self.data.media = media_for_model(self.data.media, self.model, "data.media.factor")

    def resolve_models(self, resolve) -> None:
        self.model = resolve(self.model, self.data.all_shards())

    def fix_run_dir(self) -> Path:
        self.run_dir = self.run_dir or f"runs/sft-{time.strftime('%Y%m%d-%H%M%S')}"
        return Path(self.run_dir)
