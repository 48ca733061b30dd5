"""One training step of the tiny Qwen3-VL-MoE under torchrun (gloo), with the experts on every
rank (--ep 1, 2 ranks, DP 2), spread over both (--ep 2, DP 2), or split over them by tensor
parallelism (--tp 2, DP 1), or its layers on two pipeline stages (--pp 2, DP 1), or both spread
and split (--ep 2 --tp 2: 4 ranks, DP 2, each TP pair's experts 2 of the 4): the same step in
each, a supervised loss on the answer tokens (plus Megatron's load-balancing loss), Megatron's
distributed optimizer. The data of two DP ranks, different image samples on each: at DP 1 the
one DP rank takes both ranks' micro-batches (the loss is normalised over the whole step, so the
gradient is the same). Every rank writes its logits of its first micro-batch before the step
(gathered over the vocabulary at TP 2; none at PP 2, where no rank holds the whole model), rank 0
the HF export after it (experts gathered from every EP rank), to --out, and prints one JSON line
with the step's loss (the token mean over every DP rank's samples) and grad norm.

    torchrun --nproc-per-node 2 tests/dist/moe_ep.py --ep 2 --out DIR
    torchrun --nproc-per-node 4 tests/dist/moe_ep.py --ep 2 --tp 2 --out DIR
    torchrun --nproc-per-node 2 tests/dist/moe_ep.py --layouts 1,1,1 2,1,1 --out DIR   # EP 1, then EP 2

`--kind qwen35moe` runs the tiny Qwen3.5-MoE instead (its files named qwen35moe_...), and
`--parity` then compares a fresh model's logits with transformers' at the same layout (the
family's parity module; a second JSON line).
"""

from __future__ import annotations

import argparse
import importlib
import json
import random
import sys
from pathlib import Path

import models  # noqa: F401 - CPU runtime hooks first
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from vlm_train_steps import sft_batch  # noqa: E402

from dataio.synth import colour_image  # noqa: E402
from models.comm import comm, destroy_parallel, init_parallel  # noqa: E402
from models.tiny import tiny_model_dir  # noqa: E402
from models.trainer import TrainerConfig, VLMTrainer  # noqa: E402


def step_layout(kind: str, ep: int, tp: int, pp: int, out: Path, parity: bool, cp: int = 1) -> dict:
    """One step at EP x TP x PP (x CP: each sequence split over `cp` ranks, which may hold each
    other's experts; its files written to `out`); the JSON line's figures, with the parity diffs
    under "parity" when asked."""
    from safetensors.torch import save_file
    from transformers import AutoProcessor

    path = str(tiny_model_dir(kind))
    groups = init_parallel(tp, 0, pp, ep, cp)
    trainer = VLMTrainer(path, TrainerConfig(tensor_parallel=tp, pipeline_parallel=pp, expert_parallel=ep,
                                             context_parallel=cp, lr=1e-3, distributed_optimizer=True))
    processor = AutoProcessor.from_pretrained(path)
    processor.tokenizer.padding_side = "right"
    share = 2 // trainer.dp_size  # the data ranks (of 2) this DP rank trains on
    batches = []
    for data_rank in range(groups.dp_rank * share, (groups.dp_rank + 1) * share):
        rng = random.Random(100 + data_rank)  # different data per data rank
        batches += [sft_batch(processor, trainer.spec, [colour_image(rng) for _ in range(2)]) for _ in range(2)]
    tokens = torch.tensor(sum(float(b.extra["mask"].sum()) for b in batches))
    dist.all_reduce(tokens, group=comm().dp_cpu)

    def loss_fn(lp, mb):
        return -(lp * mb.extra["mask"]).sum() * trainer.dp_size / tokens, {}

    logits = first_logits(trainer, batches[0], tp) if pp == 1 and cp == 1 else None
    local = sorted({n.split("local_experts.")[1].split(".")[0] for n, _ in trainer.module.named_parameters()
                    if "local_experts." in n})
    metrics = trainer.train_step(batches, loss_fn)
    # train/loss is this DP rank's share of the step's loss, times the DP size (loss_fn's scale):
    # the mean over DP ranks is the step's loss, the same figure at every DP size
    loss = torch.tensor(metrics["train/loss"] / trainer.dp_size, dtype=torch.float64)
    dist.all_reduce(loss, group=comm().dp_cpu)
    exported = trainer.export_hf()
    out.mkdir(parents=True, exist_ok=True)
    prefix = "" if kind == "qwen3vlmoe" else f"{kind}_"  # the Qwen3-VL-MoE test's names unchanged
    name = prefix + f"ep{ep}" + (f"_tp{tp}" if tp > 1 else "") + (f"_pp{pp}" if pp > 1 else "") + \
        (f"_cp{cp}" if cp > 1 else "")
    if logits is not None:
        save_file({"logits": logits}, str(out / f"{name}_logits_rank{groups.rank}.safetensors"))
    if dist.get_rank() == 0:
        save_file({k: v.contiguous() for k, v in exported.items()}, str(out / f"{name}.safetensors"))
    result = {"ep": ep, "tp": tp, "pp": pp, "cp": groups.cp_size, "ep_size": groups.ep_size, "dp": trainer.dp_size,
              "local_experts_rank0": local, "loss": float(loss),
              "grad_norm": metrics["train/grad_norm"], "exported": len(exported)}
    if parity:  # a fresh model from the checkpoint, the same process groups
        from models.family import family_for_dir

        run_parity = importlib.import_module(family_for_dir(path).parity_module).run_parity
        result["parity"] = run_parity(path, tp, pp, ep)
    return result


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ep", type=int, default=1)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--layouts", nargs="+", default=None, metavar="EP,TP,PP[,CP]",
                        help="several layouts in one launch (instead of --ep/--tp/--pp): one JSON line "
                             "{layout: its figures}; a launch costs ~10 s of imports on two cores")
    parser.add_argument("--out", required=True)
    parser.add_argument("--kind", default="qwen3vlmoe", help="the tiny MoE model: qwen3vlmoe or qwen35moe")
    parser.add_argument("--parity", action="store_true",
                        help="after the step, also the model family's logits vs transformers at this layout")
    args = parser.parse_args()
    if args.layouts is None:
        result = step_layout(args.kind, args.ep, args.tp, args.pp, Path(args.out), args.parity)
        if dist.get_rank() == 0:
            parity = result.pop("parity", None)
            print(json.dumps(result), flush=True)
            if parity is not None:
                print(json.dumps({"parity": parity}), flush=True)
    else:
        results = {}
        for layout in args.layouts:
            ep, tp, pp, cp = (*(int(n) for n in layout.split(",")), 1)[:4]
            results[layout] = step_layout(args.kind, ep, tp, pp, Path(args.out), args.parity, cp)
            destroy_parallel()  # the next layout makes its own groups
        if dist.get_rank() == 0:
            print(json.dumps(results), flush=True)
    dist.destroy_process_group()
    return 0


@torch.no_grad()
def first_logits(trainer: VLMTrainer, batch, tp: int) -> torch.Tensor:
    """The logits of `batch` before any step (gathered over the vocabulary at TP > 1)."""
    trainer.model.eval()
    logits = trainer.model(batch.inputs).detach()
    if tp > 1:  # each TP rank holds its share of the vocabulary
        from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

        logits = gather_from_tensor_model_parallel_region(logits)
    trainer.model.train()
    return logits.clone()


if __name__ == "__main__":
    raise SystemExit(main())
