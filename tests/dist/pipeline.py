"""The trainer under any TP x PP x DP layout against the same work in one process: SFT steps and
RL steps (the Actor's old and reference logprobs through the pipeline, then its PPO update),
then the HF export and the bucketed weight sync gathered over TP and PP.

The global batch is fixed; a DP rank takes every DP-th micro-batch (SFT) or group (RL), and the
losses are normalised over the global batch, so every layout must give the same numbers. Rank 0
writes OUT/result.json (losses, grad norms, logprobs, the sync's coverage) and OUT/export.safetensors.

    python tests/dist/pipeline.py --out DIR                                   # TP1 PP1: the reference
    torchrun --nproc-per-node 2 tests/dist/pipeline.py --pp 2 --out DIR       # PP2
    torchrun --nproc-per-node 4 tests/dist/pipeline.py --tp 2 --pp 2 --out DIR
    torchrun --nproc-per-node 2 tests/dist/pipeline.py --cp 2 --out DIR      # context parallel 2
    torchrun --nproc-per-node 2 tests/dist/pipeline.py --kind judge --pp 2 --pipeline-layers 1,2 --out DIR
                                      # the 3-layer tiny model on uneven stages (its reference: --kind judge)
    torchrun --nproc-per-node 4 tests/dist/pipeline.py --layouts 2,2,1 1,2,2 --out DIR
                                      # several layouts in one launch: OUT/2,2,1 and OUT/1,2,2
    python tests/dist/pipeline.py --lora 8 --out DIR                          # LoRA rank 8 (its reference)
    torchrun --nproc-per-node 2 tests/dist/pipeline.py --layouts 1,1,2,8 --out DIR   # LoRA at CP 2
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

import models  # noqa: F401 - CPU runtime hooks first
import torch
import torch.distributed as dist
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
from vlm_train_steps import sft_batch  # noqa: E402

from dataio.synth import colour_image  # noqa: E402
from models.comm import comm, destroy_parallel, init_parallel  # noqa: E402
from models.tiny import tiny_model_dir  # noqa: E402
from models.trainer import ReferencePolicy, TrainerConfig, VLMTrainer  # noqa: E402
from yatt_mm.engines.engine import Response  # noqa: E402
from yatt_mm.rl.actor import Actor  # noqa: E402
from yatt_mm.rl.algorithms import AlgorithmConfig  # noqa: E402
from yatt_mm.rl.samples import Group, Prompt, SampleBuilder  # noqa: E402

SIZES = [(56, 84), (112, 56), (84, 84), (140, 112)]  # images of four sizes: rows of different lengths


def sft_steps(trainer, processor, steps: int) -> list[float]:
    """SFT: 4 micro-batches of 2 image questions each, every DP rank its share."""
    rng = random.Random(0)
    batches = []
    for size in SIZES:
        samples = [colour_image(rng) for _ in range(2)]
        for s in samples:
            s.image = s.image.resize(size)
        batches.append(sft_batch(processor, trainer.spec, samples))
    g = comm()
    mine = batches[g.dp_rank::g.dp_size]
    tokens = sum(float(b.extra["mask"].sum()) for b in batches)

    def loss_fn(lp, mb):  # token mean over the global batch (DDP averages gradients over DP)
        return -(lp * mb.extra["mask"]).sum() * trainer.dp_size / tokens, {}

    losses = []
    for _ in range(steps):
        losses.append(dp_sum(trainer.train_step(mine, loss_fn)["train/loss"]) / trainer.dp_size)
    return losses


def rl_groups(processor, count: int = 4) -> list:
    """GRPO-like groups: an image question and 4 responses of 2-40 tokens each."""
    builder = SampleBuilder(processor, lambda r: processor.apply_chat_template(r.messages, add_generation_prompt=True))
    rng = random.Random(1)
    groups = []
    for g in range(count):
        s = colour_image(rng)
        image = s.image.resize(SIZES[g % len(SIZES)])
        responses = []
        for _ in range(4):
            n = rng.choice([2, 5, 12, 40])
            responses.append(Response([rng.randrange(5, 300) for _ in range(n)], "x", [-1.0] * n, "length"))
        groups.append(builder.build(Group(Prompt(f"g{g}", s.question, s.answer, [image]), responses, [0.0] * 4),
                                    [1.0, -1.0, 0.5, -0.5], masked=False))
    return groups


# the newer algorithms in one run: GSPO-token on REINFORCE++ advantages (whitened over the step
# across DP ranks), an entropy bonus (vocab-parallel entropy with its gradient), KL in the loss;
# the rollout correction off (the groups' made-up rollout logprobs would drive a sequence ratio
# to 0). One mini-batch: mini-batches split each DP rank's groups, so under DP they hold other
# groups than one process's.
NEWER = dict(policy_loss="gspo_token", advantage="reinforce_pp", entropy_coef=0.01, kl_coef=0.1)


def rl_steps(trainer, reference, processor, steps: int, **algorithm) -> tuple[list[dict], list[torch.Tensor]]:
    """The Actor's step: old logprobs and the reference's (forward only through the pipeline),
    then its KL-penalised PPO update (or `algorithm`'s); the old logprobs of the first step are
    returned too."""
    g = comm()
    mine = [s for i, group in enumerate(rl_groups(processor)) if i % g.dp_size == g.dp_rank for s in group]
    cfg = AlgorithmConfig(**(algorithm or {"kl_coef": 0.1}))
    if algorithm:
        cfg.rollout_correction.level = "none"
    actor = Actor(trainer, cfg, micro_batch_tokens=700,
                  pad_id=processor.tokenizer.pad_token_id, max_logprob_diff=1e9, reference=reference)
    keys = ("train/loss", "train/grad_norm", "train/kl", "train/logprob_diff_vs_rollout", "train/entropy")
    out, first = [], []
    for step in range(steps):
        minis = actor.prepare(mine)
        metrics = actor.old_logprobs(minis)
        if step == 0:
            first = [mb.extra["old_logprobs"] for mini in minis for mb in mini]
        metrics |= actor.batch_advantages(minis)
        metrics |= actor.update(minis)
        # the actor reports the whole step's loss, every DP group's share summed
        out.append({k: metrics[k] for k in keys})
    return out, first


def fused_step_stops_before_the_update(trainer, processor) -> dict:
    """One optimizer step over the batch (the default, `Actor.fused`): the trainer/vLLM gap comes
    from the training forward itself. The groups' made-up rollout logprobs (-1 per token) are far
    from the trainer's, as stale engine weights' would be: the guard must stop the step after
    the backward pass and before the optimizer step, on every rank, the weights unchanged."""
    g = comm()
    mine = [s for i, group in enumerate(rl_groups(processor)) if i % g.dp_size == g.dp_rank for s in group]
    actor = Actor(trainer, AlgorithmConfig(), micro_batch_tokens=700, pad_id=processor.tokenizer.pad_token_id,
                  max_logprob_diff=1e-3)
    assert actor.fused
    minis = actor.prepare(mine)
    before = trainer.checksum()
    try:
        actor.update(minis)
        stopped = False
    except RuntimeError as e:
        stopped = "run.max_logprob_diff=0.001" in str(e)
    on_every_rank = torch.tensor([float(stopped), float(trainer.checksum() == before)])
    dist.all_reduce(on_every_rank, op=dist.ReduceOp.MIN, group=g.world_cpu)
    return {"stopped": bool(on_every_rank[0]), "weights_unchanged": bool(on_every_rank[1])}


def dp_sum(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, group=comm().dp_cpu)
    return float(t)


def run_layout(tp: int, pp: int, cp: int, kind: str, layers: list[int], steps: int, out: Path,
               lora_rank: int = 0) -> None:
    """One layout's run (with `lora_rank`, the trainer has LoRA adapters on every language projection,
    B set to seeded values, and its reference is the base with them off); rank 0 writes its results
    to `out`."""
    from transformers import AutoProcessor

    from models.lora import LoRAConfig
    from models.trainer import BaseWithoutAdapter

    groups = init_parallel(tp, 0, pp, context_parallel=cp)
    path = str(tiny_model_dir(kind))
    cfg = TrainerConfig(tensor_parallel=tp, pipeline_parallel=pp, pipeline_layers=layers, lr=1e-4,
                        context_parallel=cp)
    cfg.check_model(path, "trainer")
    trainer = VLMTrainer(path, cfg, lora=LoRAConfig(rank=lora_rank))
    if lora_rank:
        _seeded_b(trainer.module)  # B starts at zero: the first steps would not reach A
    reference = BaseWithoutAdapter(trainer) if lora_rank else ReferencePolicy(path, cfg)
    processor = AutoProcessor.from_pretrained(path)
    processor.tokenizer.padding_side = "right"
    sft = sft_steps(trainer, processor, steps)
    rl, old_logprobs = rl_steps(trainer, reference, processor, steps)
    rl += rl_steps(trainer, reference, processor, 2, **NEWER)[0]
    fused_guard = fused_step_stops_before_the_update(trainer, processor)
    exported = trainer.export_hf()  # every rank: gathered over TP, handed over between the stages
    bucketed, buckets = {}, 0
    for bucket in trainer.export_hf_buckets(0.2):  # the weight sync's path: a few layers a bucket
        buckets += 1
        bucketed.update(bucket)
    missed = torch.tensor([float(bucketed.keys() != exported.keys()
                                 or any(not torch.equal(bucketed[k], exported[k]) for k in exported))])
    dist.all_reduce(missed, group=groups.world_cpu)  # on every rank, every stage's weights arrived
    mine = torch.tensor([groups.pp_rank, groups.tp_rank, sum(p.numel() for p in trainer.module.parameters()),
                         len(trainer.module.language.decoder.layers), trainer.module.layer_offset])
    everyone = [torch.zeros_like(mine) for _ in range(groups.world)]
    dist.all_gather(everyone, mine, group=groups.world_cpu)  # what `yatt-mm plan` must count per stage
    if groups.rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in exported.items()}, str(out / "export.safetensors"))
        torch.save(old_logprobs, out / "old_logprobs.pt")
        (out / "result.json").write_text(json.dumps({
            "tp": groups.tp_size, "pp": groups.pp_size, "dp": groups.dp_size, "cp": groups.cp_size,
            "sft_losses": sft, "rl": rl, "fused_guard": fused_guard,
            "buckets": buckets, "buckets_cover_export": float(missed) == 0,
            "stage_params": [t.tolist() for t in everyone]}))
        print(json.dumps({"tp": groups.tp_size, "pp": groups.pp_size, "dp": groups.dp_size, "sft_losses": sft}))
    dist.barrier(group=groups.world_cpu)


def _seeded_b(module) -> None:
    """Every LoRA B to seeded values, the same on every rank (no TP here): unlike tests/dist/lora.py's
    per-rank seeds, so that the CP ranks and the one-process reference hold the same adapter."""
    from models.lora import lora_linears

    with torch.no_grad():
        for i, (_, linear) in enumerate(lora_linears(module)):
            gen = torch.Generator().manual_seed(100 + i)
            linear.lora_B.copy_(0.05 * torch.randn(linear.lora_B.shape, generator=gen))


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--cp", type=int, default=1, help="context parallel (models/context.py)")
    parser.add_argument("--layouts", nargs="+", default=None, metavar="TP,PP,CP[,LORA]",
                        help="several layouts in one launch (instead of --tp/--pp/--cp), each written to "
                             "OUT/TP,PP,CP[,LORA]: a launch costs ~10 s of imports on two cores")
    parser.add_argument("--lora", type=int, default=0, help="LoRA rank on every language projection (no TP)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", required=True)
    parser.add_argument("--kind", default="policy", help="the tiny model: policy (2 layers), judge (3 layers)")
    parser.add_argument("--pipeline-layers", default="", help="language layers per stage, e.g. 1,2")
    args = parser.parse_args()
    layers = [int(n) for n in args.pipeline_layers.split(",") if n.strip()]
    if args.layouts is None:
        run_layout(args.tp, args.pp, args.cp, args.kind, layers, args.steps, Path(args.out), args.lora)
    for layout in args.layouts or []:
        tp, pp, cp, lora = ([int(n) for n in layout.split(",")] + [0])[:4]
        run_layout(tp, pp, cp, args.kind, layers, args.steps, Path(args.out) / layout, lora)
        destroy_parallel()  # the next layout makes its own groups
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
