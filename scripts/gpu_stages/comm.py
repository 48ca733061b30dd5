"""comm: torch.distributed with one rank, a one-element all-reduce first (NCCL on a GPU, gloo on the
CPU), then Megatron's groups; the CUDA context's and NCCL's memory."""

from __future__ import annotations

import torch

from gpu_stages.common import GIB, rss_bytes


def comm_stage(cpu: bool) -> dict:
    """torch.distributed (one rank), a one-element all-reduce on the accelerator backend at once
    (an NCCL failure costs seconds, not a model build), then Megatron's groups and the gloo ones."""
    import torch.distributed as dist

    from models.comm import init_distributed, init_parallel

    out: dict = {}
    used = _device_used()  # None on CPU
    if used is not None:
        # NVML, before this process makes a context: on a GPU nobody uses, the driver's reserve
        # (0.60 GiB on an H200), which NVML counts as used and CUDA leaves out of its total
        out["gpu_used_before_context_gib"] = used / GIB
    if torch.cuda.is_available():
        torch.cuda.set_device(0)
        free, total = torch.cuda.mem_get_info()  # makes the CUDA context
        # CUDA's own view, as the allocator and the plan see the card (the GPU is otherwise empty
        # here; subtracting NVML's figure would also subtract the driver's reserve: < 0 on an H200)
        out["cuda_context_gib"] = (total - free) / GIB
        before = total - free - torch.cuda.memory_reserved()
    else:
        out["cuda"] = "skipped: no CUDA"
        out["rss_before_gib"] = rss_bytes() / GIB
    init_distributed()
    backend = dist.get_backend()
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    one = torch.ones(1, device=device)
    try:
        dist.all_reduce(one)
        if device.type == "cuda":
            torch.cuda.synchronize()
    except Exception as e:
        raise RuntimeError(f"the first {backend} all-reduce (one element, one rank) failed: {e}. Nothing that "
                           "trains can run; rerun with NCCL_DEBUG=INFO for NCCL's reason") from e
    if float(one) != dist.get_world_size():
        raise RuntimeError(f"the first {backend} all-reduce gave {float(one)}, not {dist.get_world_size()}")
    out |= {"backend": backend, "all_reduce": "ok"}
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info()
        out["nccl_gib"] = (total - free - torch.cuda.memory_reserved() - before) / GIB
        out["context_plus_nccl_gib"] = out["cuda_context_gib"] + out["nccl_gib"]
    init_parallel(1)  # Megatron's groups (NCCL on the GPU) and the gloo ones beside them
    if device.type == "cpu":
        out["rss_after_gib"] = rss_bytes() / GIB
    from yatt_mm.plan import CUDA_CONTEXT_GIB

    out["plan_cuda_context_gib"] = CUDA_CONTEXT_GIB  # the plan's per process: this, then cuBLAS and kernels
    return out


def _device_used() -> int | None:
    """Bytes in use on GPU 0 without making a CUDA context (NVML), or None (no GPU, no pynvml)."""
    if not torch.cuda.is_available():
        return None
    try:
        import pynvml

        pynvml.nvmlInit()
        return int(pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(0)).used)
    except Exception:  # noqa: BLE001 - then the context figure includes whatever else is on the GPU
        return None
