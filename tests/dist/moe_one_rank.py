"""The tiny Qwen3-VL-MoE on one rank, two checks in one process (one model load, one import of
Megatron and transformers). Prints one JSON line: {"padding": ..., "replay": ...}.

padding: a training step whose only loss is Megatron's load-balancing loss, on two right-padded
rows of an image prompt. The padding must stay out of it: the pad token (it appears only as
padding) gets no gradient, and models/moe_metrics.py counts top-k experts per real token only.

replay (models/routing_replay.py): two micro-batches (the padded rows, then the same rows packed)
have their routes recorded in a no-gradient pass; the weights then move (seeded noise, relative
REPLAY_NOISE of each tensor's mean size, as an optimizer step moves them) and the same
micro-batches run again with the routes replayed, and freely; finally a training step replays
them under full activation recompute (the backward re-runs each layer's router); and the RL
Actor's old-logprob and update passes with routing_replay: train.
"""

from __future__ import annotations

import json
import random
import sys

import models  # noqa: F401 - CPU runtime hooks first
import torch


REPLAY_NOISE = 0.01  # measured: 1.9% of the (token, layer) routings flip


def padded_rows(path: str, spec):
    """Two right-padded rows of an image prompt (answers of different lengths) and their processor
    batch."""
    from transformers import AutoProcessor

    from dataio.synth import colour_image
    from models.inputs import VLMInputs

    processor = AutoProcessor.from_pretrained(path)
    processor.tokenizer.padding_side = "right"
    img = colour_image(random.Random(0))
    text = processor.apply_chat_template([{"role": "user", "content": [{"type": "image"}, {"type": "text",
                                          "text": img.question}]}], add_generation_prompt=True)
    batch = dict(processor(text=[text + "red", text + "red blue green yellow red blue green"],
                           images=[img.image, img.image], return_tensors="pt", padding=True))
    pad = spec.pad_token_id if hasattr(spec, "pad_token_id") else processor.tokenizer.pad_token_id
    return VLMInputs.from_processor(spec, batch), batch, pad


def padding_check(path: str) -> dict:
    from models.moe_metrics import ExpertLoad
    from models.trainer import MicroBatch, TrainerConfig, VLMTrainer

    trainer = VLMTrainer(path, TrainerConfig(lr=5e-5, clip_grad=0.0))
    load = ExpertLoad.of(trainer.module)
    inputs, batch, pad = padded_rows(path, trainer.spec)
    mb = MicroBatch(inputs)
    load.reset()
    metrics = trainer.train_step([mb], lambda lp, b: ((lp * 0).sum(), {}))  # the aux loss alone
    emb = trainer.module.language.embedding.word_embeddings.weight
    real = int(batch["attention_mask"].sum())
    return {
        "padding": int((batch["attention_mask"] == 0).sum()), "real_tokens": real,
        "pad_is_padding_only": bool((batch["input_ids"][batch["attention_mask"].bool()] != pad).all()),
        "pad_row_grad": float(emb.main_grad[pad].abs().max()), "grad_norm": metrics["train/grad_norm"],
        "routed_per_layer": load.counts.sum(1).tolist(), "topk": trainer.spec.num_experts_per_tok,
        **load.metrics()}


def replay_check(path: str) -> dict:
    from models.routing_replay import RoutingReplay
    from models.trainer import MicroBatch, TrainerConfig, VLMTrainer

    trainer = VLMTrainer(path, TrainerConfig(lr=5e-5, clip_grad=0.0, recompute="full"))
    inputs, _, _ = padded_rows(path, trainer.spec)
    mbs = [MicroBatch(inputs), MicroBatch(inputs, packed=True)]
    real = [mb.inputs.attention_mask.bool() for mb in mbs]
    replay = RoutingReplay.of(trainer.module, force=True)
    experts = trainer.spec.num_experts
    used = [[] for _ in replay.routers]  # per router: the routing map of every call, recompute included
    for i, router in enumerate(replay.routers):
        router.register_forward_hook(lambda m, a, out, i=i: used[i].append(out[1].detach().clone()))

    def used_the_recorded(routes, calls_per_mb: int = 1) -> bool:
        """Every router call took exactly the recorded experts of its micro-batch (in order)."""
        for i, calls in enumerate(used):
            want = [torch.zeros(r.shape[1], experts, dtype=torch.bool).scatter(1, r[i].long(), True) for r in routes]
            want = [w for w in want for _ in range(calls_per_mb)]
            if len(calls) != len(want) or not all(torch.equal(a, b) for a, b in zip(calls, want)):
                return False
        return True

    def gap(lps) -> float:
        """Mean |logprob - the record pass's| over the real tokens."""
        return float(sum((a - b).abs()[m].sum() for a, b, m in zip(lps, start, real)) / sum(m.sum() for m in real))

    with replay.record():
        start = trainer.logprobs(mbs)
    routes = replay.recorded()
    out = {"routes_shape": [list(r.shape) for r in routes], "topk": trainer.spec.num_experts_per_tok}
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # the weights move as an optimizer step moves them (the router's too)
        for p in trainer.module.parameters():
            p.add_(torch.randn(p.shape, generator=g) * REPLAY_NOISE * p.abs().mean())
    for force in (True, False):
        replay.force = force
        replay.reset()
        for calls in used:
            calls.clear()
        with replay.follow(routes):
            lps = trainer.logprobs(mbs)
        name = "replayed" if force else "free"
        out |= {f"{name}_gap": gap(lps), f"{name}_mismatch": replay.metrics()["moe/route_mismatch"],
                f"{name}_took_recorded": used_the_recorded(routes)}
    # an update pass: forward, then the backward's recompute of every layer, both replayed
    replay.force = True
    replay.reset()
    for calls in used:
        calls.clear()
    with replay.follow(routes):
        metrics = trainer.train_step(mbs, lambda lp, mb: (-(lp * mb.inputs.attention_mask).sum() / 100, {}))
    out |= {"train_took_recorded": used_the_recorded(routes, calls_per_mb=2), "train_calls": len(used[0]),
            "train_mismatch": replay.metrics()["moe/route_mismatch"], "train_grad_norm": metrics["train/grad_norm"],
            "router_grad": float(sum(r.weight.main_grad.abs().sum() for r in replay.routers))}
    try:  # a forward beyond the recorded micro-batches is refused
        with replay.follow(routes[:1]):
            trainer.logprobs(mbs)
    except RuntimeError as e:
        out["extra_forward_error"] = str(e)
    for calls in used:
        calls.clear()
    return out | actor_check(trainer, inputs, used, used_the_recorded)


def actor_check(trainer, inputs, used, used_the_recorded) -> dict:
    """The RL Actor with routing_replay: train and 2 PPO mini-batches (the padded rows, then the
    packed ones): its old-logprob pass records each micro-batch's routes, its update passes (the
    second after an optimizer step) take them, forward and recompute."""
    from models.trainer import MicroBatch
    from yatt_mm.rl.actor import Actor
    from yatt_mm.rl.algorithms import AlgorithmConfig

    minis = []
    for g, packed in enumerate((False, True)):
        mb = MicroBatch(inputs, packed=packed, group_ids=[f"g{g}", f"g{g}"])
        mask = inputs.attention_mask.float()
        mask[:, -1] = 0  # the last position predicts nothing
        mb.extra = {"loss_mask": mask, "fresh_mask": mask, "advantages": torch.tensor([1.0, -1.0])}
        minis.append([mb])
    for (mb,), lp in zip(minis, trainer.logprobs([m for (m,) in minis])):
        mb.extra["rollout_logprobs"] = lp  # as vLLM's would be: the trainer's own
    actor = Actor(trainer, AlgorithmConfig(routing_replay="train", mini_batches=2), 4096, 0)
    actor.old_logprobs(minis)
    for calls in used:
        calls.clear()
    metrics = actor.update(minis)
    routes = [mb.extra["routes"] for (mb,) in minis]
    return {"actor_routes_shape": [list(r.shape) for r in routes], "actor_steps": metrics["train/optimizer_steps"],
            "actor_took_recorded": used_the_recorded(routes, calls_per_mb=2),
            "actor_mismatch": metrics["moe/route_mismatch"]}


def main() -> int:
    from models.comm import init_parallel
    from models.tiny import tiny_model_dir

    init_parallel(1)
    path = str(tiny_model_dir("qwen3vlmoe"))
    print(json.dumps({"padding": padding_check(path), "replay": replay_check(path)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
