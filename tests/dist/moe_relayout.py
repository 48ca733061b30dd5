"""A distributed-optimizer checkpoint of the tiny Qwen3-VL-MoE written at DP 4 x EP 2 (each
expert's Adam state sharded over its two expert-data-parallel ranks) resumed at DP 2 x EP 1,
under torchrun (gloo), as a run's resume does it (yatt_mm/rl/layout.py's plan, the conversion of
yatt_mm/rl/relayout.py run by the first rank, every rank loading its part):

    torchrun --nproc-per-node 4 tests/dist/moe_relayout.py save DIR     # step 1, checkpoint, step 2
    torchrun --nproc-per-node 2 tests/dist/moe_relayout.py resume DIR   # the checkpoint, step 2 again

Every rank trains on the same micro-batches and the loss is their token mean, so the step's
gradient does not depend on the DP size (DDP averages it over DP, the experts' over their ranks
as Megatron scales them). Each launch writes, from its first rank, the HF export after step 2
and (save) after step 1 to DIR, and prints one JSON line with step 2's loss and gradient norm.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import models  # noqa: F401 - CPU runtime hooks first
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from vlm_train_steps import sft_batch  # noqa: E402

from dataio.synth import colour_image  # noqa: E402
from models.comm import init_parallel  # noqa: E402
from models.tiny import tiny_model_dir  # noqa: E402
from models.trainer import TrainerConfig, VLMTrainer  # noqa: E402
from yatt_mm.rl.layout import Layout  # noqa: E402

KIND, LR = "qwen3vlmoe", 1e-3


def _trainer(ep: int) -> VLMTrainer:
    return VLMTrainer(str(tiny_model_dir(KIND)), TrainerConfig(expert_parallel=ep, lr=LR, distributed_optimizer=True))


def _batches(trainer) -> list:
    """Two steps' micro-batches, the same on every rank."""
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(str(tiny_model_dir(KIND)))
    processor.tokenizer.padding_side = "right"
    rng = random.Random(7)
    return [[sft_batch(processor, trainer.spec, [colour_image(rng) for _ in range(2)]) for _ in range(2)]
            for _ in range(2)]


def _step(trainer, batches) -> dict:
    tokens = sum(float(b.extra["mask"].sum()) for b in batches)
    metrics = trainer.train_step(batches, lambda lp, mb: (-(lp * mb.extra["mask"]).sum() / tokens, {}))
    return {"loss": metrics["train/loss"], "grad_norm": metrics["train/grad_norm"]}


def _export(trainer, path: Path) -> None:
    from safetensors.torch import save_file

    weights = trainer.export_hf()  # a collective over EP
    if dist.get_rank() == 0:
        save_file({k: v.contiguous() for k, v in weights.items()}, str(path))


def save(out: Path) -> dict:
    from yatt_mm.config import load
    from yatt_mm.config import save as save_config
    from yatt_mm.rl.checkpoint import Checkpointer
    from yatt_mm.rl.config import RLConfig

    ranks = init_parallel(1, 0, 1, 2)
    trainer = _trainer(ep=2)
    first, second = _batches(trainer)
    _step(trainer, first)
    if ranks.rank == 0:  # the run's config.yaml: what the conversion's export reads the model from
        cfg = load(RLConfig, str(Path(__file__).resolve().parents[2] / "configs" / "tiny_demo.yaml"),
                   [f"policy.model={tiny_model_dir(KIND)}", "policy.trainer.expert_parallel=2",
                    "policy.trainer.distributed_optimizer=true", f"policy.trainer.lr={LR}"])
        save_config(cfg, out / "config.yaml")
    checkpointer = Checkpointer(out / "checkpoints", ranks.rank, ranks.world, keep=2, attempt="a",
                                layout=Layout(1, 1, 1, 2, ranks.dp_size, True))
    checkpointer.save(1, trainer)
    checkpointer.wait()
    _export(trainer, out / "after_step1.safetensors")
    result = _step(trainer, second)
    _export(trainer, out / "saved_step2.safetensors")
    return result | {"dp": ranks.dp_size}


def resume(out: Path) -> dict:
    from yatt_mm.rl.checkpoint_state import load_trainer_as
    from yatt_mm.rl.export import checkpoint_layout
    from yatt_mm.rl.layout import resume_plan
    from yatt_mm.rl.relayout import convert

    ranks = init_parallel(1, 0, 1, 1)
    trainer = _trainer(ep=1)
    _, second = _batches(trainer)
    ckpt = out / "checkpoints" / "step_1"
    saved = checkpoint_layout(ckpt)
    plan = resume_plan(saved, Layout(1, 1, 1, 1, ranks.dp_size, True), ranks.rank)
    if ranks.rank == 0:
        convert(ckpt)  # the export at the layout that wrote it: 4 ranks of its own
    dist.barrier()
    step, how = load_trainer_as(ckpt, trainer, plan, {})
    result = _step(trainer, second)
    _export(trainer, out / "resumed_step2.safetensors")
    return result | {"dp": ranks.dp_size, "saved": saved.describe(), "convert": plan.convert, "step": step,
                     "how": how}


if __name__ == "__main__":
    mode, out = sys.argv[1], Path(sys.argv[2])
    from models.comm import init_distributed

    init_distributed()
    result = save(out) if mode == "save" else resume(out)
    if dist.get_rank() == 0:
        print(json.dumps(result), flush=True)
    dist.destroy_process_group()
