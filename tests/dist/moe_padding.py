"""The tiny Qwen3-VL-MoE on one rank: a training step whose only loss is Megatron's
load-balancing loss, on two right-padded rows of an image prompt. The padding must stay out of
it: the pad token (it appears only as padding) gets no gradient, and models/moe_metrics.py counts
top-k experts per real token only. Prints one JSON line."""

from __future__ import annotations

import json
import random
import sys

import models  # noqa: F401 - CPU runtime hooks first
import torch


def main() -> int:
    from transformers import AutoProcessor

    from dataio.synth import colour_image
    from models.comm import init_parallel
    from models.inputs import VLMInputs
    from models.moe_metrics import ExpertLoad
    from models.tiny import tiny_model_dir
    from models.trainer import MicroBatch, TrainerConfig, VLMTrainer

    init_parallel(1)
    path = str(tiny_model_dir("qwen3vlmoe"))
    trainer = VLMTrainer(path, TrainerConfig(lr=5e-5, clip_grad=0.0))
    load = ExpertLoad.of(trainer.module)
    processor = AutoProcessor.from_pretrained(path)
    processor.tokenizer.padding_side = "right"
    img = colour_image(random.Random(0))
    text = processor.apply_chat_template([{"role": "user", "content": [{"type": "image"}, {"type": "text",
                                          "text": img.question}]}], add_generation_prompt=True)
    batch = dict(processor(text=[text + "red", text + "red blue green yellow red blue green"],
                           images=[img.image, img.image], return_tensors="pt", padding=True))
    mb = MicroBatch(VLMInputs.from_processor(trainer.spec, batch))
    pad = trainer.spec.pad_token_id if hasattr(trainer.spec, "pad_token_id") else processor.tokenizer.pad_token_id
    load.reset()
    metrics = trainer.train_step([mb], lambda lp, b: ((lp * 0).sum(), {}))  # the aux loss alone
    emb = trainer.module.language.embedding.word_embeddings.weight
    real = int(batch["attention_mask"].sum())
    print(json.dumps({
        "padding": int((batch["attention_mask"] == 0).sum()), "real_tokens": real,
        "pad_is_padding_only": bool((batch["input_ids"][batch["attention_mask"].bool()] != pad).all()),
        "pad_row_grad": float(emb.main_grad[pad].abs().max()), "grad_norm": metrics["train/grad_norm"],
        "routed_per_layer": load.counts.sum(1).tolist(), "topk": trainer.spec.num_experts_per_tok,
        **load.metrics()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
