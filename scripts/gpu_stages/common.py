"""What the stages share: the repo root, GiB, the device's timing and memory helpers, and the
trainer's state as host copies."""

from __future__ import annotations

import math
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]  # the repo
GIB = 2**30


def timed_seconds(step, device: torch.device) -> float:
    sync(device)
    t0 = time.perf_counter()
    step()
    sync(device)
    return time.perf_counter() - t0


def allocated(device: torch.device) -> int:
    return torch.cuda.memory_allocated() if device.type == "cuda" else 0


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def free(device: torch.device) -> None:
    import gc

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def rss_bytes() -> int:
    import psutil

    return psutil.Process().memory_info().rss


def params_m(hf_dir: str) -> float:
    from safetensors import safe_open

    n = 0
    for path in Path(hf_dir).glob("*.safetensors"):
        with safe_open(str(path), "pt") as f:
            n += sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())
    return n / 1e6


def trainer_state(trainer) -> list[torch.Tensor]:
    """The trainer's weights and optimizer state, copied to host memory (what a round trip through
    the offload or a checkpoint must give back bit for bit)."""
    from models.offload import optimizer_tensors

    return [t.detach().clone().cpu() for t in [*trainer.module.parameters(), *optimizer_tensors(trainer.optimizer)]]
