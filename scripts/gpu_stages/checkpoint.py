"""checkpoint: the trainer's state saved as a distributed checkpoint (run.checkpoint_format=
torch_dist, the default) and resumed bit for bit after a step moved it; the snapshot's seconds
(device to host: what the step waits for) and the writer thread's, beside the bytes written."""

from __future__ import annotations

import time
from pathlib import Path

import torch

from gpu_stages.common import GIB, sync, trainer_state


def checkpoint_stage(actor, samples, device: torch.device, tmp: Path) -> dict:
    """Save step 1 (the snapshot in the caller's thread, the write in the checkpointer's), train a
    step, resume: the weights and the optimizer's state are the saved ones again, bit for bit."""
    from yatt_mm.rl.checkpoint import Checkpointer
    from yatt_mm.rl.layout import Layout

    trainer = actor.trainer
    layout = Layout(1, 1, 1, 1, 1, trainer.cfg.distributed_optimizer)
    checkpointer = Checkpointer(tmp / "checkpoints", 0, 1, keep=1, attempt="gpu_check", layout=layout,
                                fmt="torch_dist")
    saved = trainer_state(trainer)
    sync(device)
    start = time.perf_counter()
    figures = checkpointer.save(1, trainer)
    checkpointer.wait()
    save_seconds = time.perf_counter() - start
    written = sum(f.stat().st_size for f in (tmp / "checkpoints" / "step_1").rglob("*") if f.is_file())

    minis = actor.prepare(samples)  # a step moves every weight and moment
    actor.old_logprobs(minis)
    actor.batch_advantages(minis)
    actor.update(minis)
    moved = any(not torch.equal(a, b) for a, b in zip(saved, trainer_state(trainer)))

    start = time.perf_counter()
    step = checkpointer.resume(trainer, None, 0, lambda: None, [])  # one process: no group to agree over
    sync(device)
    resume_seconds = time.perf_counter() - start
    back = trainer_state(trainer)
    bitwise = len(back) == len(saved) and all(torch.equal(a, b) for a, b in zip(saved, back))
    return {"snapshot_seconds": figures["checkpoint/snapshot_seconds"], "save_seconds": save_seconds,
            "resume_seconds": resume_seconds, "written_gib": written / GIB, "resumed_step": step,
            "checks": {"bitwise": bitwise, "moved_between": moved, "resumed_step_1": step == 1}}
