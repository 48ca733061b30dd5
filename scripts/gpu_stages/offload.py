"""offload: the trainer released to host memory and back, bit for bit; the device memory freed and
the pinned host memory held, beside the plan's figure."""

from __future__ import annotations

import torch

from gpu_stages.common import GIB, allocated, rss_bytes, trainer_state


def offload_stage(trainer, device: torch.device) -> dict:
    """release("none") and acquire("all"): bytes back bit for bit, device memory freed, the host
    memory held meanwhile (pinned on a GPU) beside the plan's trainer offload figure."""
    from yatt_mm import plan

    trainer.acquire("all")
    before, resident = trainer_state(trainer), trainer.device_bytes()
    allocated_before, rss = allocated(device), rss_bytes()
    release_s = trainer.release("none")
    host = _held_host(trainer)
    out = {"resident_gib": resident / GIB, "release_seconds": release_s,
           "host_gib": {"plan": plan.trainer_memory(trainer.spec, trainer.cfg, 1, offload_shape(),
                                                    plan.CUDA).host_offload / GIB,
                        "measured": sum(h.nbytes for h in host) / GIB},
           "host_pinned": bool(host) and all(h.is_pinned() for h in host)}
    if device.type == "cuda":
        out["freed_gpu_gib"] = (allocated_before - allocated(device)) / GIB
        # the pinned-memory allocator's own count (torch.cuda.host_memory_stats, where torch has it)
        stats = torch.cuda.host_memory_stats() if hasattr(torch.cuda, "host_memory_stats") else {}
        pinned = stats.get("allocated_bytes.current")
        out["pinned_allocator_gib"] = pinned / GIB if pinned is not None else None
    else:
        out["cuda"] = "skipped: no CUDA"
        out["rss_growth_gib"] = (rss_bytes() - rss) / GIB  # same memory on a CPU: the host copies
    out["acquire_seconds"] = trainer.acquire("all")
    after = trainer_state(trainer)
    out["bitwise"] = len(before) == len(after) and all(torch.equal(a, b) for a, b in zip(before, after))
    checks = {"bitwise": out["bitwise"], "host_copy_held": out["host_gib"]["measured"] > 0}
    if device.type == "cuda":
        checks |= {"pinned": out["host_pinned"], "freed": out["freed_gpu_gib"] > 0}
    out["checks"] = checks
    return out


def _held_host(trainer) -> list[torch.Tensor]:
    """The host copies a released trainer holds (models/offload.py's HostOffload entries; gradient
    buffers are dropped, not copied)."""
    return [h.host for part in (trainer._state, trainer._weights) for h in part._held if h.host is not None]


def offload_shape():
    """host_offload (weights + optimizer state) does not depend on the micro-batch."""
    from yatt_mm.plan import MicroBatchShape

    return MicroBatchShape(rows=1, seq=1, scored=1, media_tokens=0, frame_tokens=1)
