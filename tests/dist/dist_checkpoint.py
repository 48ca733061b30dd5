"""A full-weight trainer's checkpoint in Megatron's distributed format (run.checkpoint_format=
torch_dist), written at one layout and resumed at another by the checkpointer itself, under
torchrun (gloo):

    torchrun --nproc-per-node 2 tests/dist/dist_checkpoint.py save DIR KIND TP PP EP DISTOPT [LORA_RANK [TARGETS]]
    torchrun --nproc-per-node N tests/dist/dist_checkpoint.py resume DIR KIND TP PP EP DISTOPT [LORA_RANK [TARGETS]]
    torchrun --nproc-per-node 2 tests/dist/dist_checkpoint.py JOB + JOB + ...   # one after another

where a JOB is one of the two argument lists above: several jobs share one launch (a launch's
imports cost more than a tiny model's job), each with its own parallel state, trainer and
checkpointer. `layers=N,M,...` anywhere after DIR sets policy.trainer.pipeline_layers (the layers
of each stage).
With LORA_RANK > 0 the trainer trains LoRA adapters (the vision tower's too; TARGETS: HF module
names, comma-separated, else the default ones) and the checkpoint holds the adapter alone.

`save` trains step 1, checkpoints it, trains step 2; `resume` resumes the checkpoint, saves what
it restored to DIR/resaved_N (N: the job's number in the launch; at its own layout: the same
global tensors, whatever layout wrote them) and trains step 2 again. Every rank trains on the same micro-batches and the loss is their token mean, so
step 2's loss and gradient norm do not depend on the layout. Each job writes, from its first
rank, the HF export of the weights the checkpoint holds (after step 1, or as resumed) to
DIR/weights_N.safetensors (with LoRA: the PEFT adapter), and prints one JSON line:
step 2's loss and gradient norm, and the resumed step. Rank 0 prints `=== job N ===` before each job's
output, so that what a resume says stays with its job.
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
from models.comm import init_distributed, init_parallel  # noqa: E402
from models.tiny import tiny_model_dir  # noqa: E402
from models.trainer import TrainerConfig, VLMTrainer  # noqa: E402
from yatt_mm.rl.checkpoint import Checkpointer  # noqa: E402
from yatt_mm.rl.layout import Layout  # noqa: E402


def _shares_live_storage(trainer) -> int:
    """How many tensors of a snapshot share memory with the live weights or optimizer state: the
    writer thread reads the snapshot while the next step changes those, so it must be 0."""
    from models import dist_ckpt
    from models.offload import optimizer_tensors

    live = {t.untyped_storage().data_ptr() for t in [*trainer.module.parameters(),
                                                     *optimizer_tensors(trainer.optimizer)]}
    tensors = []

    def visit(x):
        if isinstance(x, dict):
            for v in x.values():
                visit(v)
        elif isinstance(x, list | tuple):
            for v in x:
                visit(v)
        elif hasattr(x, "untyped_storage"):
            tensors.append(x)

    visit(dist_ckpt.snapshot_tensors(dist_ckpt.snapshot(trainer)))
    return sum(t.untyped_storage().data_ptr() in live for t in tensors)


def main(job: int, mode: str, out: Path, kind: str, tp: int, pp: int, ep: int, distopt: bool, lora_rank: int = 0,
         targets: str = "", layers: tuple[int, ...] = ()) -> dict:
    from safetensors.torch import save_file
    from transformers import AutoProcessor

    from models.lora import LoRAConfig

    ranks = init_parallel(tp, 0, pp, ep)
    lora = LoRAConfig(rank=lora_rank, vision_tower=True)
    if targets:
        lora.target_modules = targets.split(",")
    trainer = VLMTrainer(str(tiny_model_dir(kind)), TrainerConfig(tensor_parallel=tp, pipeline_parallel=pp,
                                                                  pipeline_layers=list(layers), expert_parallel=ep,
                                                                  lr=1e-3, distributed_optimizer=distopt),
                         lora if lora_rank else None)
    processor = AutoProcessor.from_pretrained(str(tiny_model_dir(kind)))
    processor.tokenizer.padding_side = "right"
    rng = random.Random(7)
    first, second = [[sft_batch(processor, trainer.spec, [colour_image(rng) for _ in range(2)]) for _ in range(2)]
                     for _ in range(2)]

    def step(batches) -> dict:
        tokens = sum(float(b.extra["mask"].sum()) for b in batches)
        metrics = trainer.train_step(batches, lambda lp, mb: (-(lp * mb.extra["mask"]).sum() / tokens, {}))
        return {"loss": metrics["train/loss"], "grad_norm": metrics["train/grad_norm"]}

    layout = Layout(ranks.tp_size, ranks.cp_size, ranks.pp_size, ranks.ep_size, ranks.dp_size, distopt)
    checkpointer = Checkpointer(out / "checkpoints", ranks.rank, ranks.world, keep=2, attempt=mode, layout=layout,
                                fmt="torch_dist")
    result = {"world": ranks.world}
    if mode == "save":
        step(first)
        result["snapshot_shares_live"] = _shares_live_storage(trainer)
        result |= checkpointer.save(1, trainer)
        checkpointer.wait()
    else:  # what it restored, in words, goes to stdout; then the state as restored, saved again
        result["step"] = checkpointer.resume(trainer, None, 0, lambda: None, [], group=dist.new_group(backend="gloo"))
        again = Checkpointer(out / f"resaved_{job}", ranks.rank, ranks.world, keep=1, attempt=mode, layout=layout,
                             fmt="torch_dist")
        again.save(1, trainer)
        again.wait()
    weights = trainer.export_adapter() if lora_rank else trainer.export_hf()  # a collective over TP, PP and EP
    if ranks.rank == 0:
        save_file({k: v.clone() for k, v in weights.items()}, str(out / f"weights_{job}.safetensors"))
    return result | step(second)


def parse(job: list[str]) -> tuple:
    split = [a for a in job if a.startswith("layers=")]
    args = [a for a in job if a not in split]
    mode, out, kind = args[0], Path(args[1]), args[2]
    tp, pp, ep, distopt = map(int, args[3:7])
    lora_rank, targets = (int(args[7]) if len(args) > 7 else 0), (args[8] if len(args) > 8 else "")
    layers = tuple(int(n) for n in split[0].removeprefix("layers=").split(",")) if split else ()
    return mode, out, kind, tp, pp, ep, bool(distopt), lora_rank, targets, layers


if __name__ == "__main__":
    from models.comm import destroy_parallel

    jobs, job = [], []
    for arg in [*sys.argv[1:], "+"]:
        if arg == "+":
            jobs.append(parse(job))
            job = []
        else:
            job.append(arg)
    init_distributed()
    for i, args in enumerate(jobs):
        if dist.get_rank() == 0:
            print(f"=== job {i} ===", flush=True)
        result = main(i, *args)
        if dist.get_rank() == 0:
            print(json.dumps(result), flush=True)
        destroy_parallel()  # the next job makes its own layout's groups
    dist.destroy_process_group()
