"""The LoRA adapter a rollout engine samples with (sync.lora: adapter): the trainer's adapter,
written as a PEFT directory and loaded into vLLM in place, under one id for the whole run.

vLLM (0.32) loads an adapter from a directory; `add_lora` with `load_inplace=True` replaces the
weights of an id it already holds in milliseconds, where without it an id already loaded keeps
serving its old weights. Requests name the adapter without `load_inplace` (with it, vLLM would
reload the directory for every request). Each load writes a new directory (a version) and
deletes the one before, so a load never reads a directory that is being rewritten.
"""

from __future__ import annotations

import atexit
import shutil
import tempfile
import time
from pathlib import Path

import torch

from models.lora import adapter_bytes, save_adapter_dir

# the ranks vLLM's engine accepts as max_lora_rank (vllm/config/lora.py MaxLoRARanks)
VLLM_MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def vllm_max_lora_rank(rank: int) -> int:
    """The smallest rank vLLM accepts as max_lora_rank that holds an adapter of `rank`."""
    for allowed in VLLM_MAX_LORA_RANKS:
        if rank <= allowed:
            return allowed
    raise ValueError(f"LoRA rank {rank}: vLLM serves adapters of rank <= {VLLM_MAX_LORA_RANKS[-1]}")


RL_FIX = "set sync.lora=merged (the adapter merged into its weights, synced as full weights are)"


def check_adapter_serving(model_dir: str | Path, what: str = "sync.lora=adapter", fix: str = RL_FIX) -> None:
    """Whether vLLM here can serve an adapter on the base `model_dir` (ValueError naming `what`
    and the `fix`). vLLM's CPU build (0.32) cannot on a mixture-of-experts model: with LoRA on, its
    experts run a Triton kernel the CPU build lacks (AttributeError in triton_moe.py at the first
    request). On a GPU that kernel is vLLM's own; untested here."""
    from models.family import read_spec
    from models.runtime import has_gpu

    if not has_gpu() and getattr(read_spec(model_dir), "num_experts", 0):
        raise ValueError(f"{what}: vLLM's CPU build cannot serve a LoRA adapter on a mixture-of-experts model (its "
                         f"experts' LoRA path needs Triton's GPU kernels): {fix}")


def engine_lora_kwargs(rank: int, vision_tower: bool = False) -> dict:
    """vLLM's settings for serving one adapter of up to `rank` (none when `rank` is 0); with
    `vision_tower`, its tower LoRA on (without it vLLM drops a tower's adapters with a warning)."""
    if not rank:
        return {}
    return dict(enable_lora=True, max_lora_rank=vllm_max_lora_rank(rank), max_loras=1) | (
        {"enable_tower_connector_lora": True} if vision_tower else {})


class AdapterSlot:
    """The one adapter an engine serves; `request` is what generate calls pass (None: the base)."""

    NAME, ID = "policy", 1

    def __init__(self):
        self.root: Path | None = None  # made on the first load, removed by close()
        self.version = 0
        self.path: Path | None = None
        self.request = None

    def load(self, llm, tensors: dict[str, torch.Tensor], config: dict) -> dict[str, float]:
        """Write the adapter as a new version's directory and swap it in; {seconds, bytes, tensors}."""
        start = time.perf_counter()
        previous, self.path = self.path, save_adapter_dir(tensors, config, self._next_version())
        self._add(llm)
        if previous is not None and previous.parent == self.root:  # ours, not a directory serve() was given
            shutil.rmtree(previous, ignore_errors=True)
        return {"seconds": time.perf_counter() - start, "bytes": float(adapter_bytes(tensors)),
                "tensors": float(len(tensors))}

    def _next_version(self) -> Path:
        """The directory of the next version, in a folder of this process's own that goes with
        it: at close(), or at exit when a crash skips close() (not after kill -9)."""
        if self.root is None:
            self.root = Path(tempfile.mkdtemp(prefix="yatt-mm-adapter-"))
            atexit.register(shutil.rmtree, self.root, True)
        self.version += 1
        return self.root / f"v{self.version}"

    def _add(self, llm) -> None:
        from vllm.lora.request import LoRARequest

        if not llm.llm_engine.add_lora(LoRARequest(self.NAME, self.ID, str(self.path), load_inplace=True)):
            raise RuntimeError(f"vLLM did not load the LoRA adapter in {self.path}")
        self.request = LoRARequest(self.NAME, self.ID, str(self.path))

    def serve(self, llm, path: str | Path) -> None:
        """An adapter directory as it is (a LoRA run's RUN_DIR/final: `yatt-mm eval`)."""
        self.path = Path(path).resolve()
        self._add(llm)

    def reload(self, llm) -> None:
        """Into an engine started anew (release mode shutdown): the adapter it served before."""
        if self.path is not None:
            self._add(llm)

    def close(self) -> None:
        if self.root is not None:
            shutil.rmtree(self.root, ignore_errors=True)
            self.root = self.path = self.request = None
