"""memory: the trainer's peak per phase, measured beside what `yatt-mm plan` predicts for the same
model, settings and micro-batch; the allocator's slack and the memory outside it."""

from __future__ import annotations

import sys

import torch

from gpu_stages.common import GIB, ROOT


def memory_stage(actor, samples, device: torch.device) -> dict:
    """One more RL step, each phase's peak measured (CUDA: max_memory_allocated; CPU: the peak of
    the bytes the phase allocated and has not freed, from torch.profiler's memory events, as
    benchmarks/bench_memory_plan.py measures it, on top of the trainer's resident bytes), beside
    the plan's figures for the same model, settings and largest micro-batch (CUDA or CPU kernels)."""
    from yatt_mm import plan

    trainer = actor.trainer
    trainer.acquire("all")
    minis = actor.prepare(samples)
    resident = trainer.device_bytes()
    measured = {}
    for phase, run in (("logprobs", lambda: actor.old_logprobs(minis)),
                       ("train", lambda: (actor.batch_advantages(minis), actor.update(minis)))):
        measured[phase] = phase_peak(run, device, resident)
    shape = plan_shape(minis, trainer.spec)
    planned = plan.trainer_memory(trainer.spec, trainer.cfg, 1, shape, plan.CUDA if device.type == "cuda" else plan.CPU)
    out = {"micro_batch": {"rows": shape.rows, "seq": shape.seq, "scored": shape.scored,
                           "media_tokens": shape.media_tokens, "frame_tokens": shape.frame_tokens},
           **trainer_figures(planned, resident, measured)}
    if device.type == "cuda":
        reserved, allocated = torch.cuda.max_memory_reserved(), torch.cuda.max_memory_allocated()
        free, total = torch.cuda.mem_get_info()
        out["allocator_slack"] = {"plan": plan.ALLOCATOR_SLACK, "measured": reserved / allocated - 1}
        # what the plan's CUDA_CONTEXT_GIB stands for, after real training: context, NCCL, cuBLAS
        # and kernels' workspaces outside torch's allocator
        out["outside_allocator_gib"] = {"plan": plan.CUDA_CONTEXT_GIB,
                                        "measured": (total - free - torch.cuda.memory_reserved()) / GIB}
    else:
        out["cuda"] = "skipped: no CUDA (peaks from torch.profiler's CPU memory events, CPU kernels' plan)"
    return out


def phase_peak(run, device: torch.device, resident: int) -> int:
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        run()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated()
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from bench_memory_plan import step_peak_bytes

    return resident + step_peak_bytes(run)


def trainer_figures(planned, resident: int, peaks: dict[str, int]) -> dict:
    """The trainer's resident bytes and its phases' peaks beside the plan's (yatt_mm.plan's
    TrainerMemory for the same model, settings and micro-batch), in GiB."""
    return {"resident_gib": {"plan": planned.persistent / GIB, "measured": resident / GIB},
            "logprobs_peak_gib": {"plan": (planned.persistent + planned.activations.forward_only) / GIB,
                                  "measured": peaks["logprobs"] / GIB},
            "train_peak_gib": {"plan": planned.peak / GIB, "measured": peaks["train"] / GIB}}


def plan_shape(minis, spec):
    """The plan's MicroBatchShape of the largest micro-batch of a step's mini-batches: rows, padded
    length, scored positions, media tokens and merged tokens per image."""
    from yatt_mm.plan import MicroBatchShape

    mb = max((mb for mini in minis for mb in mini), key=lambda mb: mb.inputs.input_ids.numel())

    rows, seq = mb.inputs.input_ids.shape
    scored = int(mb.score_mask.sum()) if mb.score_mask is not None else rows * seq
    media = int((mb.inputs.input_ids == spec.image_token_id).sum())
    grid = mb.inputs.image_grid_thw
    frame = int(grid[0].prod()) // spec.spatial_merge_size**2 if grid is not None and len(grid) else 1
    return MicroBatchShape(rows=rows, seq=seq, scored=scored, media_tokens=media, frame_tokens=frame)
