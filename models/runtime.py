"""The one place where yatt-mm adapts its libraries to a machine without a GPU.

Nothing here runs by itself: `models._hooks` calls `fix_torchvision_ops()` right before
torchvision is first imported and `patch_megatron_for_cpu()` right after megatron.core is first
imported, in every process of the environment (see that module for why). The rollout engine calls
`set_vllm_cpu_defaults()`. On a machine with a CUDA GPU only the torchvision fix can act, and only
when torchvision's native library cannot load.

Each shim below says in one line what it works around.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from pathlib import Path

import torch

log = logging.getLogger(__name__)

_keep_alive: list = []  # torch.library.Library objects must outlive this module's functions


def has_gpu() -> bool:
    return torch.cuda.is_available()


# --- torchvision -------------------------------------------------------------------------------


def fix_torchvision_ops() -> None:
    """PyPI's torchvision is a CUDA build: its `_C` fails to load beside the CPU torch, and then
    `import torchvision` dies on `register_fake("torchvision::nms")` for an operator nobody
    defined. Defining the two schemas first lets the pure-Python transforms import and work."""
    spec = importlib.util.find_spec("torchvision")
    if spec is None or not spec.submodule_search_locations:
        return
    if _torchvision_ops_defined():
        return
    lib_path = next(Path(spec.submodule_search_locations[0]).glob("_C*.so"), None)
    if lib_path is not None:
        try:
            torch.ops.load_library(str(lib_path))
            return  # a torchvision that matches this torch: nothing to fix
        except (OSError, RuntimeError):
            pass
    lib = torch.library.Library("torchvision", "DEF")
    lib.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    lib.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    _keep_alive.append(lib)
    log.debug("torchvision native ops unavailable; defined nms/qnms schemas so it imports")


def _torchvision_ops_defined() -> bool:
    try:
        torch.ops.torchvision.nms.default  # noqa: B018 - raises when the op is not registered
        return True
    except (AttributeError, RuntimeError):
        return False


# --- vLLM ----------------------------------------------------------------------------------------


# The in-process, eager engine starts in ~5 s on CPU; the default (multiprocess + torch.compile)
# takes 65-138 s. These only set defaults: a user's environment wins.
VLLM_CPU_ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # engine in the caller's process
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB of KV cache; vLLM's CPU default is far larger
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",  # binding to cores fights torch's own threads
    "TORCHDYNAMO_DISABLE": "1",  # no torch.compile on CPU: minutes of start-up for tiny models
    "HF_HUB_OFFLINE": "1",  # tiny models are built locally; never reach for a hub
}


def set_vllm_cpu_defaults() -> None:
    for key, value in VLLM_CPU_ENV.items():
        os.environ.setdefault(key, value)


# --- Megatron-Core ------------------------------------------------------------------------------


def patch_megatron_for_cpu() -> None:
    """megatron-core 0.16.1 assumes CUDA in a few places; see the shims below."""
    # Filled in by the megatron CPU shims (RNG tracker, device redirects, type strings, ViT norm).
    pass
