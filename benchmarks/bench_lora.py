"""LoRA against full-weight training of the same tiny policy on the same batch: what the trainer
holds at its peak, how long a training step takes, and what a weight sync and a checkpoint carry.

Each mode runs in its own child process (so its peak resident memory is its own): the tiny
Qwen2-VL policy on one rank (Megatron-Core, DDP, Megatron's Adam), right-padded colour-question
images, loss on the answer tokens; with LoRA, rank-8 adapters on every projection of the
language model and the base frozen (models/lora.py). Measured per mode:
- train peak: the process's peak resident memory while it builds the trainer and trains, less
  its resident memory before (the imports);
- step time: the median training step after a warm-up step;
- sync: what a weight sync sends (every weight as the full sync exports it, or the adapter as
  PEFT names it) and the seconds to export it on this rank (vLLM's load is not in it);
- checkpoint: the bytes of what a checkpoint holds of the trainer (its weights, or the adapter,
  and the optimizer state), serialised as the checkpointer writes it.

    python benchmarks/bench_lora.py [--rank 8] [--steps 5] [--batch 16]

Last line: JSON with sync_bytes_ratio, checkpoint_bytes_ratio, train_peak_ratio and
step_time_ratio (LoRA over full weights), and each mode's figures.
"""

from __future__ import annotations

import argparse
import io
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

from _common import full_or_smoke


def child(mode: str, rank: int, steps: int, batch: int, micro: int) -> dict:
    import models  # noqa: F401 - CPU runtime hooks first
    import psutil
    import torch
    from transformers import AutoProcessor

    from bench_train_step import make_batch
    from models.comm import init_parallel
    from models.lora import LoRAConfig, adapter_bytes
    from models.tiny import tiny_model_dir
    from models.trainer import TrainerConfig, VLMTrainer

    path = str(tiny_model_dir("policy"))
    init_parallel(1)
    processor = AutoProcessor.from_pretrained(path)
    processor.tokenizer.padding_side = "right"
    before = psutil.Process().memory_info().rss
    lora = LoRAConfig(rank=rank, alpha=2 * rank) if mode == "lora" else None
    trainer = VLMTrainer(path, TrainerConfig(lr=1e-4, clip_grad=1.0), lora=lora)
    mbs = make_batch(processor, trainer.spec, batch, micro)
    target = sum(float(mb.extra["mask"].sum()) for mb in mbs)

    def step() -> float:
        t0 = time.perf_counter()
        trainer.train_step(mbs, lambda lp, mb: (-(lp * mb.extra["mask"]).sum() / target, {}))
        return time.perf_counter() - t0

    step()  # warm-up: the optimizer's state is made here
    times = [step() for _ in range(steps)]
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before  # Linux: KiB
    t0 = time.perf_counter()
    sent = adapter_bytes(trainer.export_adapter()) if lora else sum(
        adapter_bytes(bucket) for bucket in trainer.export_hf_buckets(64))
    sync_s = time.perf_counter() - t0
    buf = io.BytesIO()
    torch.save({"model": trainer.checkpoint_weights(), "optimizer": trainer.optimizer_state()}, buf)
    return {"train_peak_bytes": peak, "step_s": statistics.median(times), "sync_bytes": sent,
            "sync_export_s": sync_s, "checkpoint_bytes": buf.tell(),
            "trainable_params": sum(p.numel() for p in trainer.module.parameters() if p.requires_grad)}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rank", type=int, default=8, help="LoRA rank")
    ap.add_argument("--steps", type=int, default=full_or_smoke(5, 1), help="timed training steps per mode")
    ap.add_argument("--batch", type=int, default=full_or_smoke(16, 4))
    ap.add_argument("--micro", type=int, default=full_or_smoke(8, 2))
    ap.add_argument("--child", choices=["full", "lora"], default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.rank, args.steps, args.batch, args.micro)))
        return 0
    got = {}
    for mode in ("full", "lora"):
        proc = subprocess.run([sys.executable, __file__, "--child", mode, "--rank", str(args.rank), "--steps",
                               str(args.steps), "--batch", str(args.batch), "--micro", str(args.micro)],
                              capture_output=True, text=True, timeout=900, cwd=Path(__file__).parent)
        if proc.returncode != 0:
            sys.exit(f"{mode} run failed:\n{proc.stderr[-3000:]}")
        got[mode] = json.loads(proc.stdout.strip().splitlines()[-1])
    full, lora = got["full"], got["lora"]
    ratio = {key: lora[key] / full[key] for key in ("sync_bytes", "checkpoint_bytes", "train_peak_bytes", "step_s")}
    print(f"tiny Qwen2-VL policy, batch {args.batch} (micro {args.micro}), LoRA rank {args.rank} on every projection")
    for key, unit in (("trainable_params", ""), ("train_peak_bytes", " B"), ("step_s", " s"), ("sync_bytes", " B"),
                      ("sync_export_s", " s"), ("checkpoint_bytes", " B")):
        print(f"  {key:18s} full {full[key]:>14.4g}{unit}   LoRA {lora[key]:>14.4g}{unit}   "
              f"LoRA / full {lora[key] / full[key]:.3f}")
    print(json.dumps({"sync_bytes_ratio": round(ratio["sync_bytes"], 4),
                      "checkpoint_bytes_ratio": round(ratio["checkpoint_bytes"], 4),
                      "train_peak_ratio": round(ratio["train_peak_bytes"], 4),
                      "step_time_ratio": round(ratio["step_s"], 4),
                      "sync_export_s_ratio": round(lora["sync_export_s"] / full["sync_export_s"], 4),
                      "lora_rank": args.rank, "full": full, "lora": lora}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
