"""lora: the trainer with LoRA adapters (`policy.lora`) on the check's model. RL steps that move
the adapter alone; the adapter's export, what `sync.lora: adapter` sends (no vLLM on the check
machine to load it: the CPU tests do), against the full export; and the LoRA trainer's memory per
phase beside the full-weight trainer's (the memory stage) and the plan's."""

from __future__ import annotations

import math

import torch

from gpu_stages.common import GIB
from gpu_stages.memory import phase_peak, plan_shape, trainer_figures
from gpu_stages.rl import make_actor

RANK = 16


def lora_stage(hf_dir: str, full_actor, samples, device: torch.device, dtype: str, steps: int,
               full_memory: dict | None) -> dict:
    from models.lora import LoRAConfig, adapter_bytes, adapter_state, frozen_state
    from yatt_mm import plan

    full_actor.trainer.release("none")  # off the device: the peaks below are the LoRA trainer's alone
    lora = LoRAConfig(rank=RANK, alpha=2.0 * RANK)
    actor, _ = make_actor(hf_dir, dtype, 4096, lora=lora)
    trainer = actor.trainer
    trainer.acquire("all")
    base_before = {k: v.detach().clone() for k, v in frozen_state(trainer.module).items()}
    adapter_before = {k: v.detach().clone() for k, v in adapter_state(trainer.module).items()}
    peaks, losses = {}, []
    for step in range(steps):  # the last step's phases measured: Adam's state exists by then, as in
        last = step == steps - 1  # the memory stage, which measures after the rl stage's steps
        minis, resident = actor.prepare(samples), trainer.device_bytes()
        for phase, run in (("logprobs", lambda: actor.old_logprobs(minis)),
                           ("train", lambda: (actor.batch_advantages(minis), losses.append(actor.update(minis))))):
            if last:
                peaks[phase] = phase_peak(run, device, resident)
            else:
                run()
    adapter = trainer.export_adapter()
    full_bytes = sum(t.numel() * t.element_size() for t in trainer.export_hf().values())
    planned = plan.trainer_memory(trainer.spec, trainer.cfg, 1, plan_shape(minis, trainer.spec),
                                  plan.CUDA if device.type == "cuda" else plan.CPU, lora)
    moved = [not torch.equal(v, adapter_state(trainer.module)[k]) for k, v in adapter_before.items()]
    base_same = all(torch.equal(v, frozen_state(trainer.module)[k]) for k, v in base_before.items())
    loss = [m["train/loss"] for m in losses]
    out = {"rank": RANK, "losses": loss, "adapter_params_m": sum(v.numel() for v in adapter_before.values()) / 1e6,
           "sync_bytes": {"adapter": adapter_bytes(adapter), "full": full_bytes},
           **trainer_figures(planned, resident, peaks)}
    if full_memory:  # the full-weight trainer's measured peak on the same model and samples
        out["train_peak_vs_full_weights"] = peaks["train"] / (full_memory["train_peak_gib"]["measured"] * GIB)
    trainer.release("none")
    # a trainer without adapters would hold no adapter and no frozen base: both must be there
    out["checks"] = {"losses_finite": all(map(math.isfinite, loss)), "adapter_moved": bool(moved) and all(moved),
                     "base_unchanged": bool(base_before) and base_same,
                     "adapter_sync_smaller": 0 < adapter_bytes(adapter) < full_bytes / 10}
    return out
