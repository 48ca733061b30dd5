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
from pathlib import Path

from yatt_mm.rl.checkpoint import Layout, _complete_markers, _verify_trainer_file, check_base, resume_plan


def checkpoint_layout(ckpt: Path) -> Layout:
    markers = _complete_markers(ckpt)
    if markers is None:
        raise ValueError(f"{ckpt} is not a complete checkpoint (a done_rank{{r}} marker of every rank of one attempt)")
    saved = markers[0].get("layout")
    if saved is None:
        raise ValueError(f"{ckpt} was written before checkpoints recorded their layout: resume the run to export it")
    return Layout(**saved)


def export_layout(saved: Layout) -> Layout:
    """The smallest layout that holds the whole model: DP 1, or one DP rank per expert shard."""
    return Layout(saved.tp, saved.cp, saved.pp, saved.ep, saved.ep, saved.distributed_optimizer)


def run_config(ckpt: Path):
    from yatt_mm.config import load
    from yatt_mm.rl.config import RLConfig

    path = ckpt.parent.parent / "config.yaml"
    if not path.is_file():
        raise ValueError(f"{path} is missing: a checkpoint is exported with its run's config.yaml")
    return load(RLConfig, str(path), [])


def export_checkpoint(ckpt: str | Path, out: str | Path, merge: bool = False) -> int:
    """The launcher: check, then run the export here (one rank) or as ranks under torchrun."""
    from yatt_mm.launch import relaunch, under_torchrun

    ckpt = Path(ckpt)
    saved = checkpoint_layout(ckpt)
    cfg = run_config(ckpt)
    if merge and not cfg.policy.lora.enabled:
        raise ValueError(f"{ckpt} holds every weight (its run had no policy.lora): --merge is for LoRA checkpoints")
    live = export_layout(saved)
    args = [str(ckpt), "--out", str(out)] + (["--merge"] if merge else [])
    if live.world == 1 or under_torchrun():
        return export_rank(ckpt, Path(out), merge)
    return relaunch("yatt_mm.rl.export", live.world, args)


def export_rank(ckpt: Path, out: Path, merge: bool) -> int:
    import torch.distributed as dist

    from models.comm import init_parallel
    from models.hf_io import save_hf_dir
    from models.lora import save_adapter_dir
    from models.trainer import VLMTrainer
    from yatt_mm.rl.checkpoint import base_identity, state_digest

    saved, cfg = checkpoint_layout(ckpt), run_config(ckpt)
    trainer_cfg = cfg.policy.trainer
    ranks = init_parallel(saved.tp, cfg.run.seed, saved.pp, saved.ep, saved.cp)
    live = export_layout(saved)
    source = resume_plan(ckpt, saved, live, ranks.rank).trainers[0]
    state, reason = _verify_trainer_file(ckpt, source)
    if reason is not None:
        raise RuntimeError(f"{ckpt} cannot be exported: {reason}")
    trainer = VLMTrainer(cfg.policy.model, trainer_cfg, cfg.policy.lora, cfg.policy.freeze_vision)
    check_base(ckpt, state.get("base"), base_identity(trainer))
    trainer.load_checkpoint_weights(state["model"])
    if state_digest(trainer.checkpoint_weights()) != state_digest(state["model"]):
        raise RuntimeError(f"{ckpt}: the loaded weights do not hash to rank {source}'s as written")
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
    a = p.parse_args(argv)
    return export_rank(Path(a.checkpoint), Path(a.out), a.merge)


if __name__ == "__main__":
    sys.exit(main())
