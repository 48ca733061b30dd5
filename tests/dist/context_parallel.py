"""Context parallelism against CP 1, on the Megatron Qwen2-VL: the packing test's mix (images of
three sizes, a short video, responses of 2 to 60 tokens) plus a longer video (16 frames of
112 x 112: 128 video tokens) as one right-padded micro-batch and as one packed row (neither
length a multiple of 2 x CP: both are padded). Logprobs and entropy at every real token, the
gradients of an RL-style loss (summed over the CP ranks) and the weights after one train step
over both micro-batches must match CP 1's, and each rank's vision tower must run only its share
of the frames. Then the tiny Qwen3-VL (interleaved M-RoPE, DeepStack features added after its
first two layers) and the tiny Qwen2.5-VL (window attention in its vision tower) on one packed
row of an image group, a video group and the longer video, and the tiny Qwen3-VL-MoE on the same
samples as right-padded rows (its routers' padding mask): logprobs and gradients (Qwen3-VL with
and without full recompute, DeepStack's gradient hand-over) at CP 2 against CP 1 without it.
The tiny Qwen3.5 (its DeltaNet layers split heads over CP) likewise on the packed row, with and
without full recompute, and the tiny Qwen3.5-MoE on right-padded rows. Core attention by
all-to-all (context_parallel_comm=a2a) on the Qwen3-VL packed row under full recompute, the
Qwen3-VL-MoE padded rows and the Qwen3.5 packed row (its attention layers beside the DeltaNet's),
and a tiny Qwen3-VL with one key/value group for its 2 heads (copied to both ranks) packed, with
and without selective recompute (core attention, its all-to-alls included, run again).

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
from models.moe_metrics import ExpertLoad  # noqa: E402
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
                              with_entropy=True, cp_comm=trainer.cfg.context_parallel_comm)
    (lp * batch.extra["loss_mask"] * batch.extra["advantages"][:, None]).sum().backward()
    grads = {n: p.main_grad.clone() for n, p in trainer.module.named_parameters()}  # Megatron DDP's, not reduced
    if cp > 1:  # each CP rank holds its chunks' share of every gradient
        for g in grads.values():
            dist.all_reduce(g, group=comm().cp)
    return lp.detach() * real, ent.detach() * real, grads


def vision_patches(trainer) -> list[int]:
    """Counts the patches this rank's vision tower runs on, one entry per forward (appended to
    the returned list): under CP each rank runs its share of the frames."""
    seen = []
    trainer.module.vision.register_forward_pre_hook(lambda module, args: seen.append(int(args[0].shape[0])))
    return seen


def family_model_dir(kind: str) -> Path:
    """The tiny model of `kind`; "qwen3vl_kv1": the tiny Qwen3-VL with one key/value group for
    its 2 query heads (a2a at CP 2 copies it to both ranks), built once beside the cache's."""
    if kind != "qwen3vl_kv1":
        return tiny_model_dir(kind)
    from models.qwen3vl.tiny import make_tiny

    path = tiny_model_dir("qwen3vl").with_name("qwen3vl_kv1-test-v1")
    if not (path / "config.json").is_file():  # the CP 1 run (one process) builds it, before CP 2's ranks
        tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
        make_tiny(tmp, widths=({"num_key_value_heads": 1}, {}))
        os.rename(tmp, path)
    return path


def family_runs(kind: str, cp: int, variants: tuple[str, ...], layout: str = "packed") -> dict:
    """A tiny model of another family (`kind`) on an image group, a video group and the longer
    video as one packed row (or right-padded rows: `layout`): at CP 1 without recompute (the
    reference), at CP 2 with each of `variants` (see FAMILY_RUNS). Also the patches its vision
    tower ran on this rank and in all."""
    from transformers import AutoProcessor

    path = str(family_model_dir(kind))
    processor = AutoProcessor.from_pretrained(path)
    got = {}
    for variant in variants if cp > 1 else ("none",):
        cp_comm, _, recompute = variant.rpartition(":")
        trainer = VLMTrainer(path, TrainerConfig(lr=1e-3, context_parallel=cp, recompute=recompute,
                                                 context_parallel_comm=cp_comm or "all_gather"))
        seen = vision_patches(trainer)
        load = ExpertLoad.of(trainer.module)  # MoE: the routers' load metrics, over the CP ranks
        if load is not None:
            load.reset()
        samples = mixed_samples(processor)[6:] + long_video_group(processor)
        pad_id = processor.tokenizer.pad_token_id
        (padded,) = micro_batches(samples, 10**6, trainer.spec, pad_id)
        (packed,) = micro_batches(samples, 10**6, trainer.spec, pad_id, packed=True)
        real = padded.inputs.attention_mask.bool()
        lp, _, grads = scores_and_grads(trainer, packed if layout == "packed" else padded, real, cp)
        if load is not None:
            moe = load.metrics(cp_group=comm().cp_cpu if cp > 1 else None)
            got[f"{kind}-{variant}/moe"] = torch.tensor([moe["moe/load_max_over_mean"], moe["moe/aux_loss"]],
                                                         dtype=torch.float64)
        got.update({f"{kind}-{variant}/lp": lp, **{f"{kind}-{variant}/grad/{n}": g for n, g in grads.items()}})
        got[f"{kind}/tokens"] = torch.tensor(int(real.sum()))
        got[f"{kind}/media"] = torch.tensor([int((padded.inputs.input_ids == t).sum())
                                             for t in (trainer.spec.image_token_id, trainer.spec.video_token_id)])
        got[f"{kind}-{variant}/vision_patches"] = torch.tensor(sum(seen))
        del trainer
    return got


# the other families' runs: (kind, variants, layout); a variant is a recompute setting, with
# "a2a:" before it for core attention by all-to-all (context_parallel_comm=a2a; else all_gather).
# The MoE models on right-padded rows (the
# default, packing off): the routers' padding mask and Megatron's token count over the CP group
# decide the load-balancing loss's gradient. Qwen3.5's DeltaNet layers split heads over CP, not
# positions (models/qwen35/model.py), each sample of a packed row alone.
FAMILY_RUNS = (("qwen3vl", ("none", "full", "a2a:full"), "packed"), ("policy25", ("none",), "packed"),
               ("qwen3vlmoe", ("none", "a2a:none"), "padded"), ("qwen35", ("none", "full", "a2a:none"), "packed"),
               ("qwen35moe", ("none",), "padded"), ("qwen3vl_kv1", ("a2a:none", "a2a:selective"), "packed"))
# the DeltaNet's own parameters (Qwen3.5)
DELTANET = ("conv1d.", "A_log", "dt_bias", "out_norm.")


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
    seen = vision_patches(trainer)
    for name, batch in (("padded", padded), ("packed", packed)):
        first = len(seen)  # the tower runs once for the images, once for the videos
        got[f"{name}/lp"], got[f"{name}/entropy"], grads = scores_and_grads(trainer, batch, real, cp)
        got.update({f"{name}/grad/{n}": g for n, g in grads.items()})
        got[f"{name}/vision_patches"] = torch.tensor(sum(seen[first:]))

    def loss_fn(lp, mb):
        return -(lp * mb.extra["loss_mask"] * mb.extra["advantages"][:, None]).sum() / total, {}

    before = {n: p.detach().clone() for n, p in trainer.module.named_parameters()}
    step = trainer.train_step([padded, packed], loss_fn)
    got.update({f"weight/{n}": p.detach().clone() for n, p in trainer.module.named_parameters()})
    got.update({f"step/{n}": p.detach() - before[n] for n, p in trainer.module.named_parameters()})
    got["loss"] = torch.tensor(step["train/loss"])
    for kind, recomputes, layout in FAMILY_RUNS:
        got.update(family_runs(kind, cp, recomputes, layout))
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
    shares = {}  # this rank's share of the vision tower's patches, and the CP ranks' together
    for key in (k for k in got if k.endswith("/vision_patches")):
        total = got[key].clone()
        dist.all_reduce(total, group=comm().cp)
        name = key.removesuffix("/vision_patches")
        whole = int(ref[name.split("-")[0] + ("-none" if "-" in name else "") + "/vision_patches"])  # CP 1's run
        shares[f"{name}/vision_share"] = int(got[key]) / whole
        shares[f"{name}/vision_share_all_ranks"] = int(total) / whole
    result.update(shares)
    for kind, recomputes, _ in FAMILY_RUNS:
        result[f"{kind}/tokens"], result[f"{kind}/image_tokens"], result[f"{kind}/video_tokens"] = \
            int(ref[f"{kind}/tokens"]), *ref[f"{kind}/media"].tolist()
        result[f"{kind}/grad_scale"], result[f"{kind}/lp_scale"] = scale(f"{kind}-none/grad/"), scale(f"{kind}-none/lp")
        for recompute in recomputes:  # each against CP 1 without recompute
            run = f"{kind}-{recompute}"
            result[f"{run}/lp_max_diff"] = float((got[f"{run}/lp"] - ref[f"{kind}-none/lp"]).abs().max())
            result[f"{run}/grad_max_diff"] = max(float((got[k.replace(f"{kind}-none", run)] - ref[k]).abs().max())
                                                 for k in ref if k.startswith(f"{kind}-none/grad/"))
        if f"{kind}-none/moe" in ref:  # load max/mean and the load-balancing loss, CP 2 against CP 1
            result[f"{kind}/moe_metrics_cp"] = got[f"{kind}-none/moe"].tolist()
            result[f"{kind}/moe_metrics_cp1"] = ref[f"{kind}-none/moe"].tolist()
        routers = [k for k in ref if k.startswith(f"{kind}-none/grad/") and ".router." in k]
        if routers:  # their gradients are small beside the others': on their own scale
            result[f"{kind}/router_grad_scale"] = max(float(ref[k].abs().max()) for k in routers)
            result[f"{kind}/router_grad_max_diff"] = max(float((got[k] - ref[k]).abs().max()) for k in routers)
        own = [k for k in ref
               if k.startswith(f"{kind}-none/grad/") and any(f".self_attention.{p}" in k for p in DELTANET)]
        if own:  # the DeltaNet's own parameters, each on its own scale (A_log's and dt_bias' are small)
            result[f"{kind}/deltanet_grad_max_rel"] = max(
                float((got[k.replace("-none/", f"-{r}/")] - ref[k]).abs().max() / ref[k].abs().max())
                for k in own for r in recomputes)
    result["step_scale"] = scale("step/")  # how far the step moved the weights
    if dist.get_rank() == 0:
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
