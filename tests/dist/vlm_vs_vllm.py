"""Trainer (Megatron Qwen2-VL) and rollout engine (vLLM) in one process, as in an RL rank:
logprobs of vLLM-sampled responses under both, before and after a training step whose weights
are pushed into the engine. Prints one JSON line.

`--kind policy25` runs the tiny Qwen2.5-VL, `--kind qwen3vl` the tiny Qwen3-VL; the script
records the M-RoPE positions vLLM computes for each prompt and compares them with ours
(`positions_equal`), and reports the sampled responses' lengths (vLLM generated from the image
and the video). Videos reach the processor as the RL samples give them
(`RolloutEngine.processor_media`: with their frame rate for timed models). `--two-images` adds
a prompt with two images; the gaps are also reported per prompt (`before_max_each`, and over
every prompt token, media tokens included, `before_prompt_max_each`)."""

from __future__ import annotations

import argparse
import json
import random
import sys

import models  # noqa: F401 - CPU runtime hooks first
import torch

from dataio.synth import colour_image, moving_ball_video
from models.inputs import VLMInputs
from models.tiny import tiny_model_dir
from models.comm import init_parallel
from models.trainer import MicroBatch, TrainerConfig, VLMTrainer
from yatt_mm.engines.engine import EngineConfig, Request, RolloutEngine, SamplingConfig


def build(processor, spec, engine, request, response_ids):
    # the media as the RL samples get them: videos with the metadata vLLM was given (timed models)
    batch = dict(processor(text=[engine.prompt_text(request)], return_tensors="pt", **engine.processor_media(request)))
    prompt_len = batch["input_ids"].shape[1]
    batch["input_ids"] = torch.cat([batch["input_ids"], torch.tensor([response_ids], dtype=torch.long)], 1)
    batch["attention_mask"] = torch.ones_like(batch["input_ids"])
    return MicroBatch(VLMInputs.from_processor(spec, batch)), prompt_len


VLLM_POSITIONS: dict[tuple, list] = {}  # prompt token ids -> vLLM's M-RoPE positions [3, s]


def record_vllm_positions() -> None:
    """Wrap vLLM's get_mrope_input_positions (the engine runs in this process) to keep what it
    computes for each prompt."""
    from vllm.model_executor.models import qwen2_5_vl, qwen2_vl, qwen3_vl

    for cls in (qwen2_vl.Qwen2VLForConditionalGeneration, qwen2_5_vl.Qwen2_5_VLForConditionalGeneration,
                qwen3_vl.Qwen3VLForConditionalGeneration):
        original = cls.get_mrope_input_positions

        def wrapped(self, input_tokens, mm_features, _original=original):
            positions, delta = _original(self, input_tokens, mm_features)
            VLLM_POSITIONS[tuple(int(t) for t in input_tokens)] = positions.tolist()
            return positions, delta

        cls.get_mrope_input_positions = wrapped


def positions_equal(processor, spec, engine, requests) -> bool:
    for req in requests:
        mb, p = build(processor, spec, engine, req, [])
        key = tuple(mb.inputs.input_ids[0].tolist())
        if key not in VLLM_POSITIONS or VLLM_POSITIONS[key] != mb.inputs.position_ids[:, 0].tolist():
            return False
    return True


def diffs(trainer, processor, engine, requests, sampling, lengths=None, per_request=None):
    """Max and mean |logprob diff| of the sampled tokens; `per_request` gets each request's max."""
    result = engine.generate(requests, sampling)
    out = []
    for req, group in zip(requests, result.responses):
        if lengths is not None:
            lengths.append([len(r.token_ids) for r in group])
        mine = []
        for r in group:
            mb, p = build(processor, trainer.spec, engine, req, r.token_ids)
            ours = trainer.logprobs([mb])[0][0, p - 1 : p - 1 + len(r.token_ids)]
            mine.append((ours - torch.tensor(r.logprobs)).abs())
        out += mine
        if per_request is not None:
            per_request.append(float(torch.cat(mine).max()))
    d = torch.cat(out)
    return float(d.max()), float(d.mean())


def prompt_diff(trainer, processor, engine, requests, per_request=None) -> float:
    """Max |logprob diff| over every prompt token, media tokens included: unlike sampled answers,
    which a trained-to-collapse model gives with probability ~1 whatever its weights, this sees
    any weight the engine holds differently from the trainer."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0)
    worst = 0.0
    for req in requests:
        result = engine.llm.generate([engine._vllm_input(req)], params, use_tqdm=False,
                                     lora_request=engine.adapter.request)[0]
        ids = result.prompt_token_ids
        theirs = torch.tensor([d[t].logprob for d, t in zip(result.prompt_logprobs[1:], ids[1:])])
        mb, _ = build(processor, trainer.spec, engine, req, [])
        if mb.inputs.input_ids[0].tolist() != list(ids):
            raise AssertionError("vLLM and the processor tokenise the prompt differently")
        ours = trainer.logprobs([mb])[0][0, :-1]
        diff = float((ours - theirs).abs().max())
        worst = max(worst, diff)
        if per_request is not None:
            per_request.append(diff)
    return worst


def main() -> int:
    from transformers import AutoProcessor

    parser = argparse.ArgumentParser()
    parser.add_argument("--kind", default="policy")
    parser.add_argument("--two-images", action="store_true", help="also a prompt with two images")
    parser.add_argument("--lora", action="store_true", help="then the adapter-only sync (tests/dist/lora_vs_vllm.py)")
    args = parser.parse_args()
    path = str(tiny_model_dir(args.kind))
    record_vllm_positions()
    init_parallel(1)
    trainer = VLMTrainer(path, TrainerConfig(lr=1e-2))
    engine = RolloutEngine(EngineConfig(model=path))
    processor = AutoProcessor.from_pretrained(path)
    rng = random.Random(0)
    img, vid = colour_image(rng), moving_ball_video(rng)
    requests = [
        Request([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": img.question}]}], images=[img.image]),
        Request([{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": vid.question}]}], videos=[vid.video]),
    ]
    names = ["image", "video"]
    if args.two_images:  # two images of other sizes in one prompt
        a, b = colour_image(rng), colour_image(rng)
        requests.append(Request([{"role": "user", "content": [{"type": "image"}, {"type": "image"},
                                                              {"type": "text", "text": a.question}]}],
                                images=[a.image, b.image.resize((96, 64))]))
        names.append("two_images")
    sampling = SamplingConfig(n=2, max_tokens=16, seed=0)
    lengths: list = []
    before_each: list = []
    before_max, before_mean = diffs(trainer, processor, engine, requests, sampling, lengths, before_each)
    before_prompt_each: list = []
    before_prompt_max = prompt_diff(trainer, processor, engine, requests, before_prompt_each)
    same_positions = positions_equal(processor, trainer.spec, engine, requests)

    # one SFT-style step on a fixed answer, then push the new weights into the engine
    mb, p = build(processor, trainer.spec, engine, requests[0], processor.tokenizer.encode(" red"))
    mask = torch.zeros_like(mb.inputs.input_ids, dtype=torch.float32)
    mask[0, p - 1 :] = 1.0
    mask[0, -1] = 0.0

    def loss_fn(lp, batch):
        return -(lp * mask).sum() / mask.sum(), {}

    metrics = trainer.train_step([mb], loss_fn)
    with torch.no_grad():  # and a change to every tensor that is not small: a layer the sync
        gen = torch.Generator().manual_seed(0)  # leaves stale then shows in the logprobs
        for param in trainer.module.parameters():
            param.add_(0.02 * torch.randn(param.shape, generator=gen).to(param))
    # a bucketed sync (as the RL loop does): each bucket holds whole layers, and vLLM keeps the
    # layers a bucket leaves out; every layer must end up with the new weights
    whole = trainer.export_hf()
    sync = {"seconds": 0.0, "bytes": 0.0, "buckets": 0, "largest": 0.0, "keys": []}
    for bucket in trainer.export_hf_buckets(bucket_mb=0.25):
        info = engine.update_weights(bucket.items(), partial=True)
        sync = {"seconds": sync["seconds"] + info["seconds"], "bytes": sync["bytes"] + info["bytes"],
                "buckets": sync["buckets"] + 1, "largest": max(sync["largest"], info["bytes"]),
                "keys": sync["keys"] + list(bucket),
                "equal": sync.get("equal", True) and all(torch.equal(t, whole[k]) for k, t in bucket.items())}
    after_max, after_mean = diffs(trainer, processor, engine, requests, sampling)
    after_prompt_max = prompt_diff(trainer, processor, engine, requests)
    lora = {}
    if args.lora:
        from lora_vs_vllm import run as lora_run

        lora = {"lora": lora_run(path)}
    print(json.dumps(lora | {"before_max": before_max, "before_mean": before_mean, "after_max": after_max,
                      "after_mean": after_mean, "after_prompt_max": after_prompt_max, "sync_s": sync["seconds"], "sync_bytes": sync["bytes"],
                      "sync_buckets": sync["buckets"], "largest_bucket_bytes": sync["largest"],
                      "buckets_cover_export": sorted(sync["keys"]) == sorted(whole) and sync["equal"],
                      "grad_norm": metrics["train/grad_norm"], "kind": args.kind,
                      "model_type": trainer.spec.model_type, "positions_equal": same_positions,
                      "response_lengths": lengths, "requests": names,
                      "before_max_each": dict(zip(names, before_each)), "before_prompt_max": before_prompt_max,
                      "before_prompt_max_each": dict(zip(names, before_prompt_each)),
                      "video_timed": engine.timed_videos, "engine_fixes": {k: engine._kwargs[k] for k in
                                                                           ("mm_device_do_normalize",) if k in engine._kwargs}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
