"""speed: one training step, Megatron vs transformers + AdamW on the same batch, in paired rounds;
step ms, tokens/s, and MFU from the model's FLOPs."""

from __future__ import annotations

import statistics

import torch

from gpu_stages.common import GIB, allocated, free, sync, timed_seconds


# Dense bf16 tensor-core peak of the GPUs MFU is reported for (NVIDIA's datasheets, SXM parts).
PEAK_BF16_FLOPS = {"H200": 989.4e12, "H100": 989.4e12}


def speed_stage(hf_dir: str, actor, samples, device: torch.device, dtype: str, rounds: int) -> dict:
    """One training step on the same micro-batches and token-mean loss: the Megatron trainer vs
    transformers' model + torch AdamW (fp32 weights, bf16 autocast on a GPU), both resident, in
    paired rounds (which goes first alternates); step ms as medians, the ratio as the median of
    the rounds' ratios, MFU from the batch's model FLOPs (`train_flops`)."""
    from transformers import AutoModelForImageTextToText

    trainer = actor.trainer
    trainer.acquire("all")
    mbs = actor.micro_batches(samples)
    tokens = sum(int(mb.inputs.attention_mask.sum()) for mb in mbs)
    target = sum(float(mb.extra["loss_mask"].sum()) for mb in mbs)

    def megatron_step():
        trainer.train_step(mbs, lambda lp, mb: (-(lp * mb.extra["loss_mask"]).sum() / target, {}))

    hf = AutoModelForImageTextToText.from_pretrained(hf_dir, dtype=torch.float32).to(device).train()
    opt = torch.optim.AdamW(hf.parameters(), lr=1e-5, weight_decay=0.0)
    image_token = hf.config.image_token_id

    def hf_step():
        opt.zero_grad(set_to_none=True)
        for mb in mbs:
            x = mb.inputs.to(device)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=dtype == "bf16"):
                logits = hf(input_ids=x.input_ids, attention_mask=x.attention_mask, pixel_values=_per_occurrence(x),
                            image_grid_thw=x.image_grid_thw,
                            mm_token_type_ids=(x.input_ids == image_token).int()).logits
            lp = torch.log_softmax(logits.float(), -1).gather(-1, mb.labels.to(device).unsqueeze(-1)).squeeze(-1)
            (-(lp * mb.extra["loss_mask"].to(device)).sum() / target).backward()
        torch.nn.utils.clip_grad_norm_(hf.parameters(), 1.0)
        opt.step()

    steps = {"megatron": megatron_step, "transformers": hf_step}
    times: dict[str, list[float]] = {k: [] for k in steps}
    extra: dict[str, int] = {}
    for name, step in steps.items():  # warm-up (allocations, kernels), the step's own memory measured
        extra[name] = _step_extra_bytes(step, device)
    for r in range(rounds):
        order = list(steps) if r % 2 == 0 else list(steps)[::-1]
        for name in order:
            times[name].append(timed_seconds(steps[name], device))
    flops = train_flops(trainer.spec, mbs)
    peak = _peak_flops(device, dtype)
    out = {"micro_batches": len(mbs), "tokens_per_step": tokens, "scored_per_step": int(target),
           "model_tflop_per_step": flops / 1e12, "peak_tflops": peak and peak / 1e12, "rounds": rounds}
    for name in steps:
        s = statistics.median(times[name])
        out[name] = {"step_ms": s * 1e3, "tokens_per_s": tokens / s, "model_tflops": flops / s / 1e12,
                     "mfu": flops / s / peak if peak else None,
                     "step_extra_gib": extra[name] / GIB if device.type == "cuda" else None}
    out["ratio_to_transformers"] = statistics.median(b / a for a, b in zip(times["megatron"], times["transformers"]))
    del hf, opt
    free(device)
    out["checks"] = {"timed": all(out[n]["tokens_per_s"] > 0 for n in steps)}
    return out


def train_flops(spec, mbs) -> int:
    """Model FLOPs of one training step (forward + backward = 3 x forward, 2 per multiply-add) on
    the micro-batches' real tokens, by the plan's formula (yatt_mm/plan/flops.py) on each row's
    real length and each distinct image's patches (each image once, as the trainer encodes it,
    attending within itself). Padding, recompute and transformers' per-occurrence image encoding
    are work the model's FLOPs do not count."""
    from yatt_mm.plan.flops import language_forward_flops, vision_forward_flops

    flops = 0
    for mb in mbs:
        flops += language_forward_flops(spec, mb.inputs.attention_mask.sum(-1).tolist())
        if mb.inputs.image_grid_thw is not None:
            patches = _distinct_image_patches(mb.inputs)
            flops += vision_forward_flops(spec, sum(patches), patches)
    return 3 * flops


def _distinct_image_patches(x) -> list[int]:
    """Patches of each distinct image of a micro-batch, in pixel_values' order (a group's shared
    image once: `VLMInputs.image_sources` maps each occurrence to its distinct image)."""
    sources = x.image_sources.tolist() if x.image_sources is not None else range(len(x.image_grid_thw))
    sizes: dict[int, int] = {}
    for src, grid in zip(sources, x.image_grid_thw):
        sizes.setdefault(src, int(grid.prod()))
    return [sizes[i] for i in range(len(sizes))]


def _peak_flops(device: torch.device, dtype: str) -> float | None:
    if device.type != "cuda" or dtype != "bf16":
        return None
    name = torch.cuda.get_device_name()
    return next((f for gpu, f in PEAK_BF16_FLOPS.items() if gpu in name), None)


def _per_occurrence(x) -> torch.Tensor:
    """The micro-batch's pixel values with a copy per image occurrence, as transformers takes them
    (the trainer encodes a group's shared image once; `VLMInputs.image_sources`)."""
    if x.image_sources is None:
        return x.pixel_values
    distinct = torch.split(x.pixel_values, _distinct_image_patches(x))
    return torch.cat([distinct[s] for s in x.image_sources.tolist()])


def _step_extra_bytes(step, device: torch.device) -> int:
    """Run `step` once; on CUDA, the peak it allocated above what was allocated before it."""
    sync(device)
    before = allocated(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    step()
    sync(device)
    return torch.cuda.max_memory_allocated() - before if device.type == "cuda" else 0
