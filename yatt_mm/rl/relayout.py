"""A checkpoint carried to another TP, PP, CP or EP size, or across a switch of the distributed
optimizer, through Hugging Face names.

A rank's trainer file holds its TP shard of its pipeline stage, in Megatron's names and fused
layouts, so another TP/PP/CP layout cannot read it directly. The model's HF names are the one form
that does not depend on the layout, and yatt-mm already converts both ways for every family (the
weight sync exports HF tensors from any layout; a run loads an HF directory into any layout). The
optimizer state goes the same way: Adam's moments and the fp32 main weights have the parameters'
shapes and are moved element for element, so each is exported as if it were the weights (through
an fp32 copy of the model) and loaded back as if it were.

1. `convert` (once, by the first rank that resumes): `yatt-mm export CKPT --with-optimizer` on this
   machine's CPU, with the ranks of the layout that wrote the checkpoint, writes
   `CKPT/converted/`: `model/` (the weights), `optimizer_{param,exp_avg,exp_avg_sq}/` (HF
   directories of the optimizer's state) and `optimizer.pt` (Adam's step and Megatron's
   hyperparameters), then `done`.
2. `load_converted` (every rank): the weights loaded into its own layout, the optimizer state
   loaded into an fp32 copy of the model per key and cut as this rank's distributed optimizer owns
   it, or loaded whole into the plain one (models/reshard.py).

The distributed optimizer may be on or off on either side (the state is per parameter in both:
models/reshard.py's whole form). A LoRA run's adapter and its optimizer state go in the Megatron
model's own whole names instead (`write_adapter_state`, `load_adapter_state`): each tensor whole
over TP as the adapter sync gathers it (models/convert.py), one safetensors file per pipeline
stage and key, cut again for the new layout; the base is checked by the export, at the layout
that wrote the checkpoint. Under expert parallelism the export runs with one DP rank per expert
shard, or at the very layout that wrote the checkpoint where a distributed optimizer sharded the
experts' state over expert-data-parallel ranks too (DP > EP: yatt_mm/rl/export.py's
`export_layout`); each rank puts together the state its optimizers shard over their DP groups, and the experts are gathered over EP
as the weight sync gathers them. Megatron gives the experts an optimizer of their own only under
EP, so a conversion to another EP, or from the plain optimizer, takes this run's hyperparameters
with the saved step.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import torch

from models.reshard import load_whole

KEYS = ("param", "exp_avg", "exp_avg_sq")
_TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
                 "ROLE_NAME", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def converted_dir(ckpt: Path) -> Path:
    return Path(ckpt) / "converted"


def convert(ckpt: Path) -> Path:
    """`CKPT/converted/`, written now unless an earlier resume wrote it whole. Runs the export on the
    CPU in processes of its own (the layout that wrote the checkpoint), outside this run's groups."""
    out = converted_dir(ckpt)
    if (out / "done").is_file():
        return out
    env = {k: v for k, v in os.environ.items() if k not in _TORCHRUN_ENV and not k.startswith("TORCHELASTIC")}
    env["CUDA_VISIBLE_DEVICES"] = ""  # a conversion, not training: gloo on the CPU, whatever the machine has
    cmd = [sys.executable, "-m", "yatt_mm.cli", "export", str(ckpt), "--out", str(out), "--with-optimizer"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"converting {ckpt} to this run's layout failed (exit {proc.returncode}): "
                           f"{proc.stderr.strip()[-2000:]}")
    return out


def write_optimizer(trainer, out: Path, rank0: bool) -> None:
    """The optimizer state of `trainer` in HF names, one directory per key, and its step and
    hyperparameters (collectives over each inner optimizer's DP group, TP, EP and PP)."""
    from models.family import family_of
    from models.trainer import build_module

    whole, step, state = _whole_optimizer_state(trainer)
    carrier = build_module(trainer.hf_dir, trainer.spec, replace(trainer.cfg, dtype="fp32"), device="cpu")
    family = family_of(trainer.spec)
    for key in KEYS:
        with torch.no_grad():
            for name, p in carrier.named_parameters():
                if name in whole and key in whole[name]:
                    p.copy_(whole[name][key].view(p.shape))
        tensors = {k: t for bucket in family.export_hf_buckets(carrier, trainer.tp_group, torch.float32, None)
                   for k, t in bucket.items()}
        if rank0:
            from models.hf_io import save_hf_dir

            save_hf_dir(tensors, trainer.hf_dir, out / f"optimizer_{key}")
    if rank0:
        _save_meta(trainer, state, step, out)


def _whole_optimizer_state(trainer) -> tuple[dict, torch.Tensor | None, dict]:
    """(each parameter's optimizer state whole and 1-D, Adam's step, the optimizer's own state):
    the distributed optimizer's shards put together over each inner optimizer's DP group."""
    from models.optimizer import inner_optimizers
    from models.reshard import plain_whole, stitch

    state = trainer.optimizer_state()
    numel = {n: p.numel() for n, p in trainer.module.named_parameters()}
    whole, step = {}, None
    for i, opt in enumerate(inner_optimizers(trainer.optimizer)):
        part, s = stitch(_dp_shards(opt, state["shards"][i]), numel) if trainer.cfg.distributed_optimizer \
            else plain_whole(opt, trainer.module)
        whole.update(part)
        step = s if s is not None else step
    return whole, step, state


def _save_meta(trainer, state: dict, step, out: Path) -> None:
    from models.optimizer import inner_optimizers

    lora = getattr(trainer, "lora", None)
    torch.save({"megatron": state["megatron"], "step": step, "inner": len(inner_optimizers(trainer.optimizer)),
                "distributed": trainer.cfg.distributed_optimizer, "lora_rank": lora.rank if lora else 0},
               out / "optimizer.pt")


def write_adapter_state(trainer, out: Path) -> None:
    """A LoRA run's adapter and its optimizer state, layout-free: per key (the weights, then the
    optimizer's), {whole-model parameter name: tensor whole over TP}, one file per pipeline stage
    (written by its first TP/CP/DP rank). Collectives over each inner optimizer's DP group and TP."""
    from megatron.core import parallel_state as ps
    from safetensors.torch import save_file

    from models.convert import whole_adapter_tensors

    whole, step, state = _whole_optimizer_state(trainer)
    params = dict(trainer.module.named_parameters())
    first = ps.get_tensor_model_parallel_rank() == 0 and ps.get_context_parallel_rank() == 0 \
        and ps.get_data_parallel_rank() == 0
    for key in ("weights", *KEYS):
        values = {n: (p.detach() if key == "weights" else whole[n][key].view(p.shape))
                  for n, p in params.items() if p.requires_grad}
        tensors = whole_adapter_tensors(trainer.module, values, trainer.tp_group)
        if first:
            stage = ps.get_pipeline_model_parallel_rank()
            save_file({k: t.contiguous() for k, t in tensors.items()}, str(out / f"adapter_{key}_stage{stage}.safetensors"))
    if ps.get_pipeline_model_parallel_rank() == 0 and first:
        _save_meta(trainer, state, step, out)


def _dp_shards(opt, shard: dict) -> list[dict]:
    """Every DP rank's shard of one inner optimizer (`opt` shards its parameters over its own DP
    group: the experts' over the expert-data-parallel ranks, the rest over all DP ranks)."""
    import torch.distributed as dist

    group = getattr(opt, "data_parallel_group", None)
    if group is None or group.size() == 1:
        return [shard]
    shards = [None] * group.size()
    dist.all_gather_object(shards, shard, group=group)
    return shards


def load_converted(ckpt: Path, trainer) -> None:
    """This rank's weights and optimizer state from `CKPT/converted/`, at this run's layout."""
    from models.family import family_of
    from models.trainer import build_module

    conv = converted_dir(ckpt)
    meta = torch.load(conv / "optimizer.pt", map_location="cpu", weights_only=True)
    if getattr(trainer, "lora", None) is not None:
        load_whole(trainer, load_adapter_state(conv, trainer, meta), meta)
        return
    family = family_of(trainer.spec)
    tp_rank, tp = trainer.tp_rank, trainer.cfg.tensor_parallel
    family.load_hf_into(trainer.module, conv / "model", tp_rank, tp)
    # in host memory: on a GPU the engines already hold their share of the device
    carrier = build_module(str(conv / "model"), trainer.spec, replace(trainer.cfg, dtype="fp32"), device="cpu")
    whole: dict[str, dict[str, torch.Tensor]] = {}
    for key in KEYS:
        family.load_hf_into(carrier, conv / f"optimizer_{key}", tp_rank, tp)
        for name, p in carrier.named_parameters():
            whole.setdefault(name, {})[key] = p.detach().reshape(-1).clone()
    load_whole(trainer, whole, meta)


def load_adapter_state(conv: Path, trainer, meta: dict) -> dict[str, dict[str, torch.Tensor]]:
    """`write_adapter_state`'s files into this rank's adapter (its TP part of its stage's layers),
    and the optimizer state of each adapter parameter, whole and 1-D, as models/reshard.py's `load_whole` takes it."""
    from safetensors.torch import load_file

    from models.convert import split_adapter_tensors

    if meta.get("lora_rank") != trainer.lora.rank:
        raise RuntimeError(f"{conv.parent} was written with policy.lora.rank={meta.get('lora_rank')}; this run has "
                           f"policy.lora.rank={trainer.lora.rank}: set it the same to resume")
    params = {n: p for n, p in trainer.module.named_parameters() if p.requires_grad}
    whole: dict[str, dict[str, torch.Tensor]] = {}
    for key in ("weights", *KEYS):
        saved = {}
        for part in sorted(conv.glob(f"adapter_{key}_stage*.safetensors")):
            saved.update(load_file(str(part)))
        mine = split_adapter_tensors(trainer.module, saved, trainer.tp_group)
        if set(mine) != set(params):
            raise RuntimeError(f"{conv.parent}: the converted adapter lacks {sorted(set(params) - set(mine))[:3]}")
        for name, t in mine.items():
            if key == "weights":
                with torch.no_grad():
                    params[name].copy_(t.view(params[name].shape))
            else:
                whole.setdefault(name, {})[key] = t.reshape(-1).clone()
    return whole
