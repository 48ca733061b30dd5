"""The RL micro-batch shortcuts against the plain computation, on the Megatron Qwen2-VL (TP as
launched): a group's image encoded once for all its responses (`image_sources`), and logprobs
and entropy computed only at the response positions (`score_mask`). Logprobs, entropy and the
gradient of a loss on them must match the plain batch (every row's own pixels, every position).
Prints one JSON line; `run(tp)` returns it (tests/dist/cases.py runs it beside other cases)."""

from __future__ import annotations

import dataclasses
import json
import os
import random

import models  # noqa: F401 - CPU runtime hooks first
import torch

from dataio.synth import colour_image
from models.comm import init_parallel
from models.tiny import tiny_model_dir
from models.trainer import TrainerConfig, VLMTrainer, _forward_scores
from yatt_mm.engines.engine import Response
from yatt_mm.rl.samples import Group, Prompt, SampleBuilder, micro_batches


def run(tp: int) -> dict:
    from transformers import AutoProcessor

    init_parallel(tp, 0)
    path = str(tiny_model_dir("policy"))
    trainer = VLMTrainer(path, TrainerConfig(tensor_parallel=tp))
    processor = AutoProcessor.from_pretrained(path)
    builder = SampleBuilder(processor, lambda req: processor.apply_chat_template(req.messages, add_generation_prompt=True))
    rng = random.Random(0)
    samples = []
    for g in range(3):  # three groups of four responses, images of two sizes
        s = colour_image(rng)
        image = s.image.resize((56, 56) if g == 1 else s.image.size)
        responses = [Response([rng.randrange(5, 300) for _ in range(rng.randint(2, 6))], "x", [0.0] * 6, "length")
                     for _ in range(4)]
        for r in responses:
            r.logprobs = r.logprobs[: len(r.token_ids)]
        samples += builder.build(Group(Prompt(f"g{g}", s.question, s.answer, [image]), responses, [0.0] * 4),
                                 [1.0, -1.0, 0.5, -0.5], masked=False)
    (mb,) = micro_batches(samples, 10**6, trainer.spec, processor.tokenizer.pad_token_id)
    # the plain batch: the same rows in the same order, each its own group (so its own pixels)
    alone = [dataclasses.replace(s, group_id=f"{s.group_id}.{i}") for i, s in enumerate(samples)]
    (plain,) = micro_batches(alone, 10**6, trainer.spec, processor.tokenizer.pad_token_id)
    plain = dataclasses.replace(plain, score_mask=None)
    assert torch.equal(plain.inputs.input_ids, mb.inputs.input_ids) and plain.inputs.image_sources.tolist() == list(
        range(len(samples)))

    def run(batch):
        trainer.model.zero_grad_buffer()
        lp, ent = _forward_scores(trainer.model, batch, trainer.device, with_entropy=True)
        mask = mb.extra["loss_mask"]
        (lp * mask * mb.extra["advantages"][:, None]).sum().backward()
        # Megatron's DDP accumulates gradients into main_grad (no DP all-reduce is run here)
        grads = {n: p.main_grad.clone() for n, p in trainer.module.named_parameters()}
        return lp.detach() * mask, ent * mask, grads

    lp_a, ent_a, g_a = run(mb)
    lp_b, ent_b, g_b = run(plain)
    grad_diff = max(float((g_a[n] - g_b[n]).abs().max()) for n in g_b)
    grad_scale = max(float(g.abs().max()) for g in g_b.values())
    return {"tp": tp, "distinct_pixel_rows": mb.inputs.pixel_values.shape[0],
            "plain_pixel_rows": plain.inputs.pixel_values.shape[0],
            "logprob_max_diff": float((lp_a - lp_b).abs().max()), "entropy_max_diff": float((ent_a - ent_b).abs().max()),
            "grad_max_diff": grad_diff, "grad_scale": grad_scale}


if __name__ == "__main__":
    result = run(int(os.environ.get("WORLD_SIZE", "1")))  # TP as launched
    if torch.distributed.get_rank() == 0:
        print(json.dumps(result))
