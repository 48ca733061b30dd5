"""Sequence packing vs right-padded micro-batches: tokens per micro-batch and trainer time.

A GRPO-like batch with a realistic mix of lengths: 8 prompts with images of four sizes (56 to
448 px; the processor caps the patches), 8 responses each, most short (4-16 tokens), some
medium (32-64), a few long (150-200: the long tail that sets a padded micro-batch's width).
Both ways use `run.micro_batch_tokens` = 2048 and the same model (`models.tiny.wide_model_dir`,
~36M parameters). Timed: the old-logprobs forward plus one train step (forward + backward +
Adam), rounds interleaved, medians.

Last line: JSON with micro-batch counts, real tokens per micro-batch, the padded batches' pad
share, seconds each way and the speedup (padded / packed).
"""

from __future__ import annotations

import json
import random
import statistics
import time

import models  # noqa: F401 - CPU runtime hooks first
import torch
from _common import full_or_smoke

# a smoke run: 2 groups of 4 responses on the tiny model
GROUPS, RESPONSES = full_or_smoke((8, 8), (2, 4))


def mixed_batch(processor, groups: int = GROUPS, n: int = RESPONSES, seed: int = 0):
    from dataio.synth import colour_image
    from yatt_mm.engines.engine import Response
    from yatt_mm.rl.samples import Group, Prompt, SampleBuilder

    builder = SampleBuilder(processor, lambda req: processor.apply_chat_template(req.messages, add_generation_prompt=True))
    rng = random.Random(seed)
    samples = []
    for g in range(groups):
        s = colour_image(rng)
        side = (56, 112, 224, 448)[g % 4]
        lengths = [rng.randint(150, 200) if u < 0.1 else rng.randint(32, 64) if u < 0.3 else rng.randint(4, 16)
                   for u in (rng.random() for _ in range(n))]
        responses = [Response([rng.randrange(5, 600) for _ in range(k)], "x", [0.0] * k, "length") for k in lengths]
        advantages = [rng.choice([-1.0, 1.0]) for _ in range(n)]
        samples += builder.build(Group(Prompt(f"g{g}", s.question, s.answer, [s.image.resize((side, side))]),
                                       responses, [0.0] * n), advantages, masked=False)
    return samples


def main(rounds: int = full_or_smoke(3, 1), micro_batch_tokens: int = 2048) -> None:
    from transformers import AutoProcessor

    from models.comm import init_parallel
    from models.tiny import tiny_model_dir, wide_model_dir
    from models.trainer import TrainerConfig, VLMTrainer
    from yatt_mm.rl.samples import micro_batches

    init_parallel(1)
    path = str(full_or_smoke(wide_model_dir, lambda: tiny_model_dir("policy"))())
    trainer = VLMTrainer(path, TrainerConfig(lr=1e-6))
    processor = AutoProcessor.from_pretrained(path)
    samples = mixed_batch(processor)
    pad_id = processor.tokenizer.pad_token_id
    batches = {mode: micro_batches(samples, micro_batch_tokens, trainer.spec, pad_id, packed=mode == "packed")
               for mode in ("padded", "packed")}
    total = sum(int(mb.inputs.attention_mask.sum()) for mb in batches["padded"])

    def loss_fn(lp, mb):
        mask = mb.extra["loss_mask"]
        return -(lp * mask * mb.extra["advantages"][:, None]).sum() / total, {}

    seconds = {mode: [] for mode in batches}
    for _ in range(rounds):
        for mode, mbs in batches.items():
            start = time.perf_counter()
            trainer.logprobs(mbs)
            trainer.train_step(mbs, loss_fn)
            seconds[mode].append(time.perf_counter() - start)
    padded, packed = (statistics.median(seconds[m]) for m in ("padded", "packed"))
    slots = sum(mb.inputs.input_ids.numel() for mb in batches["padded"])
    result = {
        "samples": len(samples), "real_tokens": total, "micro_batch_tokens": micro_batch_tokens,
        "padded_micro_batches": len(batches["padded"]), "packed_micro_batches": len(batches["packed"]),
        "padded_real_tokens_per_micro_batch": round(total / len(batches["padded"]), 1),
        "packed_real_tokens_per_micro_batch": round(total / len(batches["packed"]), 1),
        "padded_pad_share": round(1 - total / slots, 3),
        "padded_seconds": round(padded, 3), "packed_seconds": round(packed, 3), "speedup": round(padded / packed, 3),
    }
    print(f"{len(samples)} samples, {total} real tokens: padded {result['padded_micro_batches']} micro-batches "
          f"({result['padded_pad_share']:.0%} pads) {padded:.2f} s; packed {result['packed_micro_batches']} "
          f"micro-batches {packed:.2f} s; speedup {padded / packed:.2f}x (medians of {rounds})")
    print(json.dumps(result))
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
