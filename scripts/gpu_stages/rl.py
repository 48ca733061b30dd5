"""rl: GRPO steps through the real Actor and VLMTrainer on random-token groups."""

from __future__ import annotations

import math
import random

import torch


def rl_samples(processor, n_groups: int, n: int, response_tokens: int, seed: int = 0):
    """GRPO groups as the controller builds them: a prompt with an image, n responses of random
    tokens, rewards 0/1 with group-relative advantages."""
    import numpy as np
    from PIL import Image

    from yatt_mm.rl.advantages import advantages
    from yatt_mm.rl.samples import TrainSample

    rng = random.Random(seed)
    np_rng = np.random.default_rng(seed)
    vocab = len(processor.tokenizer) - 20  # ordinary tokens, not the special ones at the end
    out = []
    for g in range(n_groups):
        image = Image.fromarray(np_rng.integers(0, 255, (224, 224, 3), dtype=np.uint8))
        msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What colour is the square?"}]}]
        enc = processor(text=[processor.apply_chat_template(msgs, add_generation_prompt=True)], images=[image],
                        return_tensors="pt")
        prompt = enc["input_ids"][0]
        rewards = torch.tensor([float(rng.random() < 0.5) for _ in range(n)])
        adv = advantages("grpo", rewards, [f"g{g}"] * n)
        for i in range(n):
            ids = torch.cat([prompt, torch.randint(0, vocab, (response_tokens,), generator=torch.Generator().manual_seed(g * 97 + i))])
            mask = torch.zeros(ids.numel())
            mask[prompt.numel() - 1 : -1] = 1.0
            out.append(TrainSample(input_ids=ids, loss_mask=mask, rollout_logprobs=torch.zeros(ids.numel()),
                                   advantage=float(adv[i]), reward=float(rewards[i]), group_id=f"g{g}",
                                   pixel_values=enc["pixel_values"], image_grid_thw=enc["image_grid_thw"]))
    return out


def make_actor(hf_dir: str, dtype: str, micro_batch_tokens: int, lora=None):
    """The real Actor over a VLMTrainer (with `lora`, a models.lora.LoRAConfig: adapters, the base
    frozen), 2 PPO mini-batches a step (an old-logprob pass, then the
    clipped loss). No vLLM on the check machine: its logprobs are absent, so the sampler
    correction and the trainer/sampler gap guard are off here (the CPU tests cover both)."""
    from transformers import AutoProcessor

    from models.trainer import TrainerConfig, VLMTrainer
    from yatt_mm.rl.actor import Actor
    from yatt_mm.rl.algorithms import AlgorithmConfig

    trainer = VLMTrainer(hf_dir, TrainerConfig(dtype=dtype, lr=1e-5, offload="always"), lora=lora)
    processor = AutoProcessor.from_pretrained(hf_dir)
    algorithm = AlgorithmConfig(mini_batches=2)
    algorithm.rollout_correction.level = "none"  # random tokens: no sampler to correct for
    actor = Actor(trainer, algorithm, micro_batch_tokens=micro_batch_tokens,
                  pad_id=processor.tokenizer.pad_token_id, max_logprob_diff=float("inf"))
    return actor, processor


def rl_stage(actor, samples, steps: int) -> dict:
    losses, changed = [], []
    for _ in range(steps):
        minis = actor.prepare(samples)
        actor.old_logprobs(minis)
        actor.batch_advantages(minis)
        m = actor.update(minis)
        losses.append(m["train/loss"])
        changed.append(m["train/weights_checksum_after"] != m["train/weights_checksum_before"])
    return {"losses": losses, "weights_changed_every_step": all(changed), "grad_norm": m["train/grad_norm"],
            "checks": {"losses_finite": all(map(math.isfinite, losses)), "weights_changed": all(changed),
                       "grad_norm_positive": m["train/grad_norm"] > 0}}
