"""The distributed optimizer (ZeRO-1) against the plain one, 2 DP ranks under torchrun (gloo):
the same tiny Megatron Qwen2-VL, the same batches (different on each DP rank), 4 steps each.
Rank 0 prints one JSON line: the largest loss and weight differences, each optimizer's state
bytes on this rank, and whether the distributed optimizer's checkpoint state restores bit for bit
(`run()` returns it: tests/dist/cases.py runs it beside other cases).

    torchrun --nproc-per-node 2 tests/dist/distopt.py
"""

from __future__ import annotations

import json
import random

import models  # noqa: F401 - CPU runtime hooks first
import torch
import torch.distributed as dist

from dataio.synth import colour_image
from models.comm import comm, init_parallel
from models.tiny import tiny_model_dir
from models.trainer import TrainerConfig, VLMTrainer
from vlm_train_steps import sft_batch


def state_bytes(trainer) -> int:
    opts = getattr(trainer.optimizer, "chained_optimizers", None) or [trainer.optimizer]
    return sum(v.numel() * v.element_size() for o in opts for s in o.optimizer.state.values()
               for v in s.values() if torch.is_tensor(v) and v.dim() > 0)


def run() -> dict:
    from transformers import AutoProcessor

    from yatt_mm.rl.checkpoint import _clone
    from yatt_mm.rl.checkpoint_files import state_digest

    groups = init_parallel(1)
    path = str(tiny_model_dir("policy"))
    processor = AutoProcessor.from_pretrained(path)
    processor.tokenizer.padding_side = "right"
    plain = VLMTrainer(path, TrainerConfig(lr=1e-3, distributed_optimizer=False))
    sharded = VLMTrainer(path, TrainerConfig(lr=1e-3, distributed_optimizer=True))
    rng = random.Random(100 + groups.dp_rank)
    batches = [sft_batch(processor, plain.spec, [colour_image(rng) for _ in range(2)]) for _ in range(2)]
    tokens = torch.tensor(sum(float(b.extra["mask"].sum()) for b in batches))
    dist.all_reduce(tokens, group=comm().dp_cpu)

    def loss_fn(lp, mb):
        return -(lp * mb.extra["mask"]).sum() * groups.dp_size / tokens, {}

    losses = {"plain": [], "sharded": []}
    for _ in range(4):
        for name, trainer in (("plain", plain), ("sharded", sharded)):
            losses[name].append(trainer.train_step(batches, loss_fn)["train/loss"])
    weight_diff = max(float((a.detach() - b.detach()).abs().max())
                      for a, b in zip(plain.module.parameters(), sharded.module.parameters()))
    saved = _clone({"model": sharded.module.state_dict(), "optimizer": sharded.optimizer_state()})
    resharded = reshard_checks(plain, sharded, saved["optimizer"], groups)
    sharded.train_step(batches, loss_fn)  # moves weights and Adam state on
    sharded.module.load_state_dict(saved["model"])
    sharded.load_optimizer_state(saved["optimizer"])
    restored = state_digest({"model": sharded.module.state_dict(), "optimizer": sharded.optimizer_state()})
    return {"loss_max_diff": max(abs(a - b) for a, b in zip(losses["plain"], losses["sharded"])),
            "weight_max_diff": weight_diff, "losses": losses["sharded"],
            "state_bytes_plain": state_bytes(plain), "state_bytes_sharded": state_bytes(sharded),
            "restore_bitwise": restored == state_digest(saved), **resharded}


def reshard_checks(plain, sharded, mine: dict, groups) -> dict:
    """A resume at another DP size puts each parameter's optimizer state together from every
    old rank's shards (models/reshard.py). Put together from both ranks' shards here, it equals
    the plain optimizer's whole state (float32 rounding apart), and cut again at the same DP size
    it gives this rank's shards back bit for bit."""
    from models.reshard import stitch
    from yatt_mm.rl.checkpoint_files import state_digest

    both = [None] * groups.dp_size
    dist.all_gather_object(both, mine, group=comm().dp_cpu)
    numel = {n: p.numel() for n, p in sharded.module.named_parameters()}
    whole, _ = stitch([s["shards"][0] for s in both], numel)
    inner = plain.optimizer.optimizer  # the plain optimizer steps the model's own fp32 weights, whole
    names = {p: n for n, p in plain.module.named_parameters()}
    worst = 0.0
    for p, st in inner.state.items():
        for key, ref in (("param", p.detach()), ("exp_avg", st["exp_avg"]), ("exp_avg_sq", st["exp_avg_sq"])):
            got = whole[names[p]][key]
            worst = max(worst, float((got - ref.reshape(-1)).abs().max() / ref.abs().max().clamp_min(1e-30)))
    again = sharded.reshard_optimizer_state(both)
    return {"stitched_params": len(whole), "plain_params": len(inner.state), "stitched_vs_plain_max_rel": worst,
            "reshard_same_dp_bitwise": state_digest(again["shards"]) == state_digest(mine["shards"])}


if __name__ == "__main__":
    result = run()
    if dist.get_rank() == 0:
        print(json.dumps(result), flush=True)
    dist.destroy_process_group()
