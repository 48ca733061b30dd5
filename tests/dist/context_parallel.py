"""Context parallelism against CP 1, on the Megatron Qwen2-VL: the packing test's mix (images of
three sizes, a short video, responses of 2 to 60 tokens) plus a longer video (16 frames of
112 x 112: 128 video tokens) as one right-padded micro-batch and as one packed row (neither
length a multiple of 2 x CP: both are padded). Logprobs and entropy at every real token, the
gradients of an RL-style loss (summed over the CP ranks) and the weights after one train step
over both micro-batches must match CP 1's. Then the tiny Qwen3-VL (interleaved M-RoPE, DeepStack
features added after its first two layers) on one packed row of an image group, a video group and
the longer video: logprobs and gradients, with and without full recompute (DeepStack's gradient
hand-over) at CP 2 against CP 1 without it.

Run twice with the same OUT: `python tests/dist/context_parallel.py OUT` (one rank, CP 1: writes
the reference), then `torchrun --nproc-per-node 2 tests/dist/context_parallel.py OUT` (CP 2:
compares with it and prints one JSON line)."""

from __future__ import annotations

import dataclasses
import json
import os
import random
import sys
from pathlib import Path

import models  # noqa: F401 - CPU runtime hooks first
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
from packing import mixed_samples  # noqa: E402

from dataio.synth import moving_ball_video  # noqa: E402
from models.comm import comm, init_parallel  # noqa: E402
from models.tiny import tiny_model_dir  # noqa: E402
from models.trainer import TrainerConfig, VLMTrainer, _forward_scores  # noqa: E402
from yatt_mm.engines.engine import Response  # noqa: E402
from yatt_mm.rl.samples import Group, Prompt, SampleBuilder, micro_batches  # noqa: E402


def long_video_group(processor, seed: int = 1):
    builder = SampleBuilder(processor,
                            lambda req: processor.apply_chat_template(req.messages, add_generation_prompt=True))
    rng = random.Random(seed)
    v = moving_ball_video(rng, frames=16, size=112)
    lengths = [3, 17, 45]
    responses = [Response([rng.randrange(5, 300) for _ in range(n)], "x", [0.0] * n, "length") for n in lengths]
    return builder.build(Group(Prompt("long", v.question, v.answer, videos=[v.video]), responses, [0.0] * 3),
                         [1.0, -0.5, 0.25], masked=False)


def main() -> None:
    from transformers import AutoProcessor

def scores_and_grads(trainer, batch, real: torch.Tensor, cp: int):
    """Logprobs and entropy at every real token [b, s] and the gradients of an RL-style loss,
    summed over the CP ranks."""
    trainer.model.zero_grad_buffer()
    lp, ent = _forward_scores(trainer.model, dataclasses.replace(batch, score_mask=None), trainer.device,
                              with_entropy=True)
    (lp * batch.extra["loss_mask"] * batch.extra["advantages"][:, None]).sum().backward()
    grads = {n: p.main_grad.clone() for n, p in trainer.module.named_parameters()}  # Megatron DDP's, not reduced
    if cp > 1:  # each CP rank holds its chunks' share of every gradient
        for g in grads.values():
            dist.all_reduce(g, group=comm().cp)
    return lp.detach() * real, ent.detach() * real, grads


def qwen3vl_runs(cp: int) -> dict:
    """The tiny Qwen3-VL on one packed row (image group, video group, longer video): at CP 1
    without recompute (the reference), at CP 2 also with full recompute."""
    from transformers import AutoProcessor

    path = str(tiny_model_dir("qwen3vl"))
    processor = AutoProcessor.from_pretrained(path)
    got = {}
    for recompute in ("none", "full") if cp > 1 else ("none",):
        trainer = VLMTrainer(path, TrainerConfig(lr=1e-3, context_parallel=cp, recompute=recompute))
        samples = mixed_samples(processor)[6:] + long_video_group(processor)
        pad_id = processor.tokenizer.pad_token_id
        (padded,) = micro_batches(samples, 10**6, trainer.spec, pad_id)
        (packed,) = micro_batches(samples, 10**6, trainer.spec, pad_id, packed=True)
        real = padded.inputs.attention_mask.bool()
        lp, _, grads = scores_and_grads(trainer, packed, real, cp)
        got.update({f"q3-{recompute}/lp": lp, **{f"q3-{recompute}/grad/{n}": g for n, g in grads.items()}})
        got["q3/tokens"] = torch.tensor(int(real.sum()))
        got["q3/media"] = torch.tensor([int((padded.inputs.input_ids == t).sum())
                                        for t in (trainer.spec.image_token_id, trainer.spec.video_token_id)])
        del trainer
    return got


def main() -> None:
    from transformers import AutoProcessor

    out = Path(sys.argv[1])
    cp = int(os.environ.get("WORLD_SIZE", "1"))
    init_parallel(1, 0, context_parallel=cp)
    path = str(tiny_model_dir("policy"))
    trainer = VLMTrainer(path, TrainerConfig(lr=1e-3, context_parallel=cp))
    processor = AutoProcessor.from_pretrained(path)
    samples = mixed_samples(processor) + long_video_group(processor)
    pad_id = processor.tokenizer.pad_token_id
    (padded,) = micro_batches(samples, 10**6, trainer.spec, pad_id)
    (packed,) = micro_batches(samples, 10**6, trainer.spec, pad_id, packed=True)
    real = padded.inputs.attention_mask.bool()
    total = padded.extra["loss_mask"].sum()

    got = {}
    for name, batch in (("padded", padded), ("packed", packed)):
        got[f"{name}/lp"], got[f"{name}/entropy"], grads = scores_and_grads(trainer, batch, real, cp)
        got.update({f"{name}/grad/{n}": g for n, g in grads.items()})

    def loss_fn(lp, mb):
        return -(lp * mb.extra["loss_mask"] * mb.extra["advantages"][:, None]).sum() / total, {}

    before = {n: p.detach().clone() for n, p in trainer.module.named_parameters()}
    step = trainer.train_step([padded, packed], loss_fn)
    got.update({f"weight/{n}": p.detach().clone() for n, p in trainer.module.named_parameters()})
    got.update({f"step/{n}": p.detach() - before[n] for n, p in trainer.module.named_parameters()})
    got["loss"] = torch.tensor(step["train/loss"])
    got.update(qwen3vl_runs(cp))
    if cp == 1:
        torch.save(got, out)
        print(json.dumps({"cp": 1, "reference": str(out), "loss": float(got["loss"])}), flush=True)
        return
    ref = torch.load(out)
    diff = lambda prefix: max(float((got[k] - ref[k]).abs().max()) for k in ref if k.startswith(prefix))  # noqa: E731
    scale = lambda prefix: max(float(ref[k].abs().max()) for k in ref if k.startswith(prefix))  # noqa: E731
    result = {"cp": cp, "rows": int(real.shape[0]), "padded_width": int(real.shape[1]), "real_tokens": int(real.sum()),
              "video_tokens": int((padded.inputs.input_ids == trainer.spec.video_token_id).sum()),
              "loss_cp1": float(ref["loss"]), "loss_cp": float(got["loss"])}
    for prefix in ("padded/lp", "padded/entropy", "padded/grad/", "packed/lp", "packed/entropy", "packed/grad/",
                   "weight/"):
        result[f"{prefix.rstrip('/')}_max_diff"] = diff(prefix)
    result["grad_scale"] = scale("padded/grad/")
    result["q3_tokens"], result["q3_image_tokens"], result["q3_video_tokens"] = \
        int(ref["q3/tokens"]), *ref["q3/media"].tolist()
    result["q3_grad_scale"], result["q3_lp_scale"] = scale("q3-none/grad/"), scale("q3-none/lp")
    for recompute in ("none", "full"):  # both against CP 1 without recompute
        result[f"q3_{recompute}/lp_max_diff"] = float((got[f"q3-{recompute}/lp"] - ref["q3-none/lp"]).abs().max())
        result[f"q3_{recompute}/grad_max_diff"] = max(
            float((got[k.replace("q3-none", f"q3-{recompute}")] - ref[k]).abs().max())
            for k in ref if k.startswith("q3-none/grad/"))
    result["step_scale"] = scale("step/")  # how far the step moved the weights
    if dist.get_rank() == 0:
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
