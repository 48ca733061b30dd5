"""`yatt-mm export RUN_DIR/checkpoints/step_N --out DIR`: any checkpoint of an RL run as a Hugging
Face model directory (a LoRA run's as a PEFT adapter directory, or merged into its base with
`--merge`), whatever layout wrote it.

The launcher reads the layout from the checkpoint's markers and the model from the run's
`config.yaml`, then starts one rank per model-parallel place (TP x CP x PP; with expert
parallelism, one per expert shard too) on this machine, on the CPU. Each rank builds the policy
at that place, loads the weights of the rank that wrote it (DP group 0's; checked against that
rank's SHA-256), and the ranks gather the whole model in HF names as the weight sync does; rank 0
writes it. No optimizer state is read.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

from yatt_mm.rl.checkpoint_files import DIST_DIR, complete_markers, is_dist, verify_dist_files
from yatt_mm.rl.checkpoint_state import check_base
from yatt_mm.rl.layout import Layout, resume_plan, weights_plan


def checkpoint_layout(ckpt: Path) -> Layout:
    markers = complete_markers(ckpt)
    if markers is None:
        raise ValueError(f"{ckpt} is not a complete checkpoint (a done_rank{{r}} marker of every rank of one attempt)")
    saved = markers[0].get("layout")
    if saved is None:
        raise ValueError(f"{ckpt} was written before checkpoints recorded their layout: resume the run to export it")
    return Layout(**saved)


def export_layout(saved: Layout, with_optimizer: bool = False) -> Layout:
    """The smallest layout that holds the whole model: DP 1, or one DP rank per expert shard. With
    the optimizer (a resume's conversion) of a distributed optimizer under expert parallelism at
    DP > EP, the layout that wrote it: the experts' optimizer shards lie over their
    expert-data-parallel ranks, each in a file of its own, and each rank reads its own file."""
    if with_optimizer and saved.distributed_optimizer and saved.dp > saved.ep > 1:
        return saved
    return Layout(saved.tp, saved.cp, saved.pp, saved.ep, saved.ep, saved.distributed_optimizer)


def run_config(ckpt: Path):
    from yatt_mm.config import load
    from yatt_mm.rl.config import RLConfig

    path = ckpt.parent.parent / "config.yaml"
    if not path.is_file():
        raise ValueError(f"{path} is missing: a checkpoint is exported with its run's config.yaml")
    return load(RLConfig, str(path), [])


def export_checkpoint(ckpt: str | Path, out: str | Path, merge: bool = False, with_optimizer: bool = False) -> int:
    """The launcher: check, then run the export here (one rank) or as ranks under torchrun."""
    from yatt_mm.launch import relaunch, under_torchrun

    ckpt = Path(ckpt)
    saved = checkpoint_layout(ckpt)
    cfg = run_config(ckpt)
    if is_dist(ckpt):  # any layout reads a distributed checkpoint: here, on one rank
        return export_dist(ckpt, Path(out), cfg, merge)
    if merge and not cfg.policy.lora.enabled:
        raise ValueError(f"{ckpt} holds every weight (its run had no policy.lora): --merge is for LoRA checkpoints")
    live = export_layout(saved, with_optimizer)
    args = [str(ckpt), "--out", str(out)] + (["--merge"] if merge else []) + (["--with-optimizer"] if with_optimizer
                                                                               else [])
    if live.world == 1 or under_torchrun():
        return export_rank(ckpt, Path(out), merge, with_optimizer)
    return relaunch("yatt_mm.rl.export", live.world, args)


def export_dist(ckpt: Path, out: Path, cfg, merge: bool = False) -> int:
    """A distributed checkpoint as an HF model directory (a LoRA run's as a PEFT adapter, or with
    `merge` merged into its base), read on one rank at TP = PP = EP = CP = 1 whatever layout wrote
    it (the files checked against the markers' SHA-256 first, the base against the adapter's)."""
    from models import dist_ckpt
    from models.comm import init_parallel
    from models.hf_io import save_hf_dir
    from models.lora import save_adapter_dir
    from models.trainer import VLMTrainer
    from yatt_mm.rl.checkpoint_files import base_identity

    reason = verify_dist_files(ckpt, 0, 1)
    if reason is not None:
        raise RuntimeError(f"{ckpt} cannot be exported: {reason}")
    init_parallel(1, cfg.run.seed)
    trainer_cfg = replace(cfg.policy.trainer, tensor_parallel=1, pipeline_parallel=1, context_parallel=1,
                          expert_parallel=1, pipeline_layers=[])
    trainer = VLMTrainer(cfg.policy.model, trainer_cfg, cfg.policy.lora, cfg.policy.freeze_vision)
    marker = complete_markers(ckpt)[0]
    check_base(ckpt, marker.get("base"), base_identity(trainer), weights=checkpoint_layout(ckpt).world == 1)
    dist_ckpt.load(trainer, ckpt / DIST_DIR, optimizer=False)
    step = marker["step"]
    if trainer.lora is not None and not merge:
        print(f"LoRA adapter of step {step} written to "
              f"{save_adapter_dir(trainer.export_adapter(), trainer.adapter_config(), out)} "
              f"(base: {cfg.policy.model})", flush=True)
    else:  # LoRA's adapters merged in
        print(f"policy of step {step} written to {save_hf_dir(trainer.export_hf(), cfg.policy.model, out)}",
              flush=True)
    return 0


def export_rank(ckpt: Path, out: Path, merge: bool, with_optimizer: bool = False) -> int:
    """One rank's part (`with_optimizer`: a resume's conversion, yatt_mm/rl/relayout.py: the weights
    under `out/model`, the optimizer state beside them)."""
    import torch.distributed as dist

    from models.comm import init_parallel
    from models.hf_io import save_hf_dir
    from models.lora import save_adapter_dir
    from models.trainer import VLMTrainer
    from yatt_mm.rl.checkpoint_files import base_identity, state_digest, verify_files
    from yatt_mm.rl.checkpoint_state import load_trainer_as

    saved, cfg = checkpoint_layout(ckpt), run_config(ckpt)
    ranks = init_parallel(saved.tp, cfg.run.seed, saved.pp, saved.ep, saved.cp)
    # the weights only: the file of the DP rank that holds this rank's place (and expert shard)
    plan = resume_plan(saved, export_layout(saved, True), ranks.rank) if with_optimizer \
        else weights_plan(saved, export_layout(saved), ranks.rank)
    source = plan.trainers[0]
    states, reason = verify_files(ckpt, plan, controller=False)
    if reason is not None:
        raise RuntimeError(f"{ckpt} cannot be exported: {reason}")
    state = states[source]
    # the layout that wrote the checkpoint (config.yaml holds the newest launch's, which may be another)
    trainer_cfg = replace(cfg.policy.trainer, tensor_parallel=saved.tp, pipeline_parallel=saved.pp,
                          context_parallel=saved.cp, expert_parallel=saved.ep,
                          distributed_optimizer=saved.distributed_optimizer,
                          pipeline_layers=list(state.get("pipeline_layers", [])))
    trainer = VLMTrainer(cfg.policy.model, trainer_cfg, cfg.policy.lora, cfg.policy.freeze_vision)
    if with_optimizer:
        load_trainer_as(ckpt, trainer, plan, states)  # the optimizer's shards put together at DP 1 too
    check_base(ckpt, state.get("base"), base_identity(trainer))
    trainer.load_checkpoint_weights(state["model"])
    if state_digest(trainer.checkpoint_weights()) != state_digest(state["model"]):
        raise RuntimeError(f"{ckpt}: the loaded weights do not hash to rank {source}'s as written")
    if with_optimizer:
        from yatt_mm.rl.relayout import write_adapter_state, write_optimizer

        out.mkdir(parents=True, exist_ok=True)
        if trainer.lora is not None:  # the adapter and its optimizer state, in Megatron's whole names
            write_adapter_state(trainer, out)
        else:
            weights = trainer.export_hf()
            if ranks.rank == 0:
                save_hf_dir(weights, cfg.policy.model, out / "model")
            write_optimizer(trainer, out, ranks.rank == 0)
        if dist.is_initialized():
            dist.barrier()
        if ranks.rank == 0:
            (out / "done").write_text(f"step {state['step']}\n")
        return 0
    if trainer.lora is not None and not merge:
        adapter = trainer.export_adapter()  # collective over TP and PP
        if ranks.rank == 0:
            print(f"LoRA adapter of step {state['step']} written to "
                  f"{save_adapter_dir(adapter, trainer.adapter_config(), out)} (base: {cfg.policy.model})", flush=True)
    else:
        weights = trainer.export_hf()  # collective over TP and PP; LoRA's adapters merged in
        if ranks.rank == 0:
            print(f"policy of step {state['step']} written to {save_hf_dir(weights, cfg.policy.model, out)}",
                  flush=True)
    if dist.is_initialized():
        dist.barrier()
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="yatt_mm.rl.export")
    p.add_argument("checkpoint")
    p.add_argument("--out", required=True)
    p.add_argument("--merge", action="store_true")
    p.add_argument("--with-optimizer", action="store_true")
    a = p.parse_args(argv)
    return export_rank(Path(a.checkpoint), Path(a.out), a.merge, a.with_optimizer)


if __name__ == "__main__":
    sys.exit(main())
