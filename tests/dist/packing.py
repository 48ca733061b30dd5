"""Sequence packing against the padded micro-batch, on the Megatron Qwen2-VL (or the tiny model
kind given as the argument; TP as launched):
a realistic mix (images of three sizes, a video, responses of 2 to 60 tokens) run as one
right-padded micro-batch and as one packed row. Logprobs and entropy at every real token, the
gradients of an RL-style loss, and the weights after a train step through the schedule (two
trainers from the same checkpoint) must match. Prints one JSON line; `run(tp, kind)` returns it
(tests/dist/cases.py runs it beside other cases)."""

from __future__ import annotations

import dataclasses
import json
import os
import random
import sys

import models  # noqa: F401 - CPU runtime hooks first
import torch

from dataio.synth import colour_image, moving_ball_video
from models.comm import init_parallel
from models.tiny import tiny_model_dir
from models.trainer import TrainerConfig, VLMTrainer, _forward_scores
from yatt_mm.engines.engine import Response
from yatt_mm.rl.samples import Group, Prompt, SampleBuilder, micro_batches


def mixed_samples(processor, seed: int = 0):
    """Four groups of three: images of 56, 112 and the default size, and a video; most responses
    short, one per group long."""
    builder = SampleBuilder(processor, lambda req: processor.apply_chat_template(req.messages, add_generation_prompt=True))
    rng = random.Random(seed)
    samples = []
    for g, size in enumerate([(56, 56), (112, 112), None, "video"]):
        if size == "video":
            v = moving_ball_video(rng)
            prompt = Prompt(f"g{g}", v.question, v.answer, videos=[v.video])
        else:
            s = colour_image(rng)
            prompt = Prompt(f"g{g}", s.question, s.answer, [s.image.resize(size) if size else s.image])
        lengths = [rng.randint(2, 5), rng.randint(2, 8), rng.randint(40, 60)]
        responses = [Response([rng.randrange(5, 300) for _ in range(n)], "x", [0.0] * n, "length") for n in lengths]
        samples += builder.build(Group(prompt, responses, [0.0] * 3), [1.0, -1.0, 0.5], masked=False)
    return samples


def run(tp: int, kind: str = "policy") -> dict:
    """`kind`: a tiny model kind, any family's."""
    from transformers import AutoProcessor

    init_parallel(tp, 0)
    path = str(tiny_model_dir(kind))
    cfg = TrainerConfig(tensor_parallel=tp, lr=1e-3)
    trainer, twin = VLMTrainer(path, cfg), VLMTrainer(path, cfg)
    processor = AutoProcessor.from_pretrained(path)
    samples = mixed_samples(processor)
    pad_id = processor.tokenizer.pad_token_id
    (padded,) = micro_batches(samples, 10**6, trainer.spec, pad_id)
    (packed,) = micro_batches(samples, 10**6, trainer.spec, pad_id, packed=True)
    real = padded.inputs.attention_mask.bool()
    plain = dataclasses.replace(padded, score_mask=None)  # every position, prompts included

    def run(batch, mask):
        trainer.model.zero_grad_buffer()
        lp, ent = _forward_scores(trainer.model, batch, trainer.device, with_entropy=True)
        (lp * padded.extra["loss_mask"] * padded.extra["advantages"][:, None]).sum().backward()
        grads = {n: p.main_grad.clone() for n, p in trainer.module.named_parameters()}  # Megatron DDP's
        return lp.detach() * mask, ent * mask, grads

    lp_a, ent_a, g_a = run(plain, real)
    lp_b, ent_b, g_b = run(dataclasses.replace(packed, score_mask=None), real)
    grad_diff = max(float((g_a[n] - g_b[n]).abs().max()) for n in g_a)

    def loss_fn(lp, mb):
        mask = mb.extra["loss_mask"]
        return -(lp * mask * mb.extra["advantages"][:, None]).sum() / padded.extra["loss_mask"].sum(), {}

    loss_a = trainer.train_step([padded], loss_fn)["train/loss"]
    loss_b = twin.train_step([packed], loss_fn)["train/loss"]
    weight_diff = max(float((p - q).abs().max()) for p, q in zip(trainer.module.parameters(), twin.module.parameters()))
    lengths = real.sum(1)
    return {
        "tp": tp, "kind": kind, "rows": int(real.shape[0]), "padded_tokens": int(real.numel()), "real_tokens": int(lengths.sum()),
        "shortest": int(lengths.min()), "longest": int(lengths.max()), "images_and_videos": int(
            padded.inputs.image_grid_thw.shape[0] + padded.inputs.video_grid_thw.shape[0]),
        "logprob_max_diff": float((lp_a - lp_b).abs().max()), "entropy_max_diff": float((ent_a - ent_b).abs().max()),
        "grad_max_diff": grad_diff, "grad_scale": max(float(g.abs().max()) for g in g_a.values()),
        "loss_padded": loss_a, "loss_packed": loss_b, "weight_max_diff_after_step": weight_diff}


if __name__ == "__main__":
    result = run(int(os.environ.get("WORLD_SIZE", "1")), sys.argv[1] if len(sys.argv) > 1 else "policy")  # TP as launched
    if torch.distributed.get_rank() == 0:
        print(json.dumps(result))
