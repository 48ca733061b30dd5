"""`yatt-mm sft`: supervised fine-tuning of a Megatron vision-language model on WebDataset shards.

    yatt-mm sft --config configs/tiny_sft.yaml [--nproc N] [key=value ...]

Every DP rank streams its own samples; the ranks of one tensor-parallel group read the same
samples. Samples become examples by the configured builder (yatt_mm/sft/examples.py), examples
become micro-batches (collate.py). The loss is the token mean of -logprob over the target tokens
(prompt masked), normalised over the whole step across DP ranks. Held-out examples (a hash of
the key, never trained on, or separate `eval.shards`) are scored before, during and after
training (evaluate.py). At the end the weights are exported as an HF directory that
transformers and vLLM load.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

import models  # noqa: F401 - CPU runtime hooks before anything imports torchvision or megatron
import torch
import torch.distributed as dist

from dataio.blend import open_reader
from models.hf_io import check_hf_dir, save_hf_dir
from models.comm import init_parallel
from models.trainer import VLMTrainer
from yatt_mm.launch import route_logs, run_command
from yatt_mm.metrics import MetricsWriter
from yatt_mm.sft.collate import Collator
from yatt_mm.sft.config import SFTConfig
from yatt_mm.sft.evaluate import evaluate
from yatt_mm.sft.examples import ExampleStream, get_builder, is_held_out


class SFTRun:
    """Everything one rank holds for the run."""

    def __init__(self, cfg: SFTConfig):
        from transformers import AutoProcessor

        self.cfg = cfg
        self.source = check_hf_dir(cfg.model)
        self.run_dir = cfg.fix_run_dir()
        self.out_dir = Path(cfg.output_dir) if cfg.output_dir else self.run_dir / "hf"
        groups = init_parallel(cfg.trainer.tensor_parallel, cfg.trainer.seed, cfg.trainer.pipeline_parallel,
                               cfg.trainer.expert_parallel, cfg.trainer.context_parallel)
        self.rank, self.dp_rank, self.dp_size = groups.rank, groups.dp_rank, groups.dp_size
        self.dp_cpu, self.world_cpu = groups.dp_cpu, groups.world_cpu  # counts and losses: CPU tensors
        self.trainer = VLMTrainer(str(self.source), cfg.trainer)
        processor = AutoProcessor.from_pretrained(str(self.source))
        processor.tokenizer.padding_side = "right"
        self.collator = Collator(processor, self.trainer.spec)
        self.metrics = MetricsWriter(self.run_dir, self.rank, cfg.metrics.tensorboard, cfg.metrics.wandb, cfg)
        build = get_builder(cfg.examples)
        holdout = cfg.eval.holdout_fraction if not cfg.eval.shards else 0.0
        self.eval_batches = self._held_out(build.eval_builder, holdout)
        self.reader = open_reader(cfg.data, self.dp_rank, self.dp_size)
        self.examples = ExampleStream(self.reader, build, cfg.tasks, cfg.seed + self.dp_rank,
                                      lambda k: not is_held_out(k, holdout))
        self.history: list[dict] = []

    def say(self, msg: str) -> None:
        if self.rank == 0:
            print(msg, flush=True)

    def _held_out(self, build, holdout: float) -> list:
        """Held-out micro-batches, built once: separate shards, or the hashed share of keys."""
        cfg = self.cfg
        if not cfg.eval.samples:
            return []
        data = replace(cfg.data, shards=cfg.eval.shards, index=None, blend=[], shuffle=False) if cfg.eval.shards \
            else replace(cfg.data, shuffle=False)
        reader = open_reader(data, self.dp_rank, self.dp_size)  # a blend: each source's held-out share
        keep = (lambda k: True) if cfg.eval.shards else (lambda k: is_held_out(k, holdout))
        held = ExampleStream(reader.iter_epoch(), build, cfg.tasks, cfg.seed + 10_000 + self.dp_rank, keep) \
            .take(cfg.eval.samples)  # one pass at most
        reader.close()
        n = torch.tensor(float(len(held)))
        dist.all_reduce(n, group=self.dp_cpu)
        if n == 0:
            raise RuntimeError("eval: no held-out example found; raise eval.holdout_fraction, give eval.shards, "
                               "or set eval.samples=0")
        return self.collator.batches(held, cfg.micro_batch_size)

    def evaluate(self, step: int) -> dict:
        if not self.eval_batches:
            return {}
        t = time.perf_counter()
        m = evaluate(self.trainer, self.eval_batches, self.dp_cpu)
        m["eval/seconds"] = time.perf_counter() - t
        self.metrics.log(step, m)
        self.say(f"eval step {step}: loss {m['eval/loss']:.4f}, accuracy {m['eval/accuracy']:.3f} "
                 f"on {int(m['eval/examples'])} held-out examples")
        self.history.append({"step": step, **m})
        return m


def sft_step(run: SFTRun, step: int) -> dict[str, float]:
    cfg, trainer = run.cfg, run.trainer
    t0 = time.perf_counter()
    # identical text-only examples of the step run once, their mask weighted by their count:
    # the same loss for less compute (collate.merge_duplicates_of)
    mbs = run.collator.batches([next(run.examples) for _ in range(cfg.batch_size)], cfg.micro_batch_size,
                               merge_duplicates=True)
    t_data = time.perf_counter() - t0
    counts = torch.tensor([sum(float(mb.extra["mask"].sum()) for mb in mbs),  # target tokens, weighted
                           sum(float(mb.inputs.attention_mask.sum(1).float() @ mb.extra["rows"]) for mb in mbs),
                           float(cfg.batch_size)])
    dist.all_reduce(counts, group=run.dp_cpu)
    target_tokens = counts[0]

    def loss_fn(lp, mb):
        # token mean over the whole step and all DP ranks (DDP averages gradients over DP)
        return -(lp * mb.extra["mask"].to(lp.device)).sum() * run.dp_size / target_tokens, {}

    if cfg.warmup_steps:
        for g in trainer.optimizer.param_groups:
            g["lr"] = cfg.trainer.lr * min(1.0, step / cfg.warmup_steps)
    m = trainer.train_step(mbs, loss_fn)
    dt = time.perf_counter() - t0
    loss = torch.tensor(m["train/loss"] / run.dp_size)  # this rank's share of the step's token-mean loss
    dist.all_reduce(loss, group=run.dp_cpu)
    m.update({"train/loss": float(loss), "train/tokens_per_s": float(counts[1]) / dt,
              "train/samples_per_s": float(counts[2]) / dt, "train/target_tokens": float(target_tokens),
              "train/step_seconds": dt, "train/data_seconds": t_data})
    m.update({f"data/skipped_{k}": float(v) for k, v in run.examples.skipped.items()})
    m.update({f"data/reader_skipped_{k}": float(v) for k, v in run.reader.skips.items()})
    m["data/remote_retries"] = float(run.reader.remote_retries)  # ranged reads of remote shards retried so far
    if run.reader.budget is not None:  # data.max_sample_tokens: samples read with fewer video frames
        m.update({"data/reader_budget_fitted": float(run.reader.budget_fitted),
                  "data/reader_frames_dropped": float(run.reader.frames_dropped)})
    return m


def train(cfg: SFTConfig) -> dict:
    """Train; every rank calls this (under torchrun or as one process). Returns the summary."""
    run = SFTRun(cfg)
    run.say(f"sft: model {run.source}, dp {run.dp_size} x tp {cfg.trainer.tensor_parallel} x pp "
            f"{cfg.trainer.pipeline_parallel}, {cfg.steps} steps of "
            f"{cfg.batch_size} samples/rank, examples={cfg.examples}, run dir {run.run_dir}")
    first_eval = run.evaluate(0)
    losses, reached = [], {}
    start = time.perf_counter()
    for step in range(1, cfg.steps + 1):
        m = sft_step(run, step)
        run.metrics.log(step, m)
        losses.append(m["train/loss"])
        if step % cfg.log_every == 0 or step == cfg.steps:
            run.say(f"step {step}/{cfg.steps}: loss {m['train/loss']:.4f}, {m['train/tokens_per_s']:.0f} tokens/s, "
                    f"{m['train/samples_per_s']:.1f} samples/s, grad norm {m['train/grad_norm']:.3f}")
        if cfg.eval.every and step % cfg.eval.every == 0 and step != cfg.steps:
            held = run.evaluate(step)
            if cfg.eval.stop_at and held["eval/accuracy"] >= cfg.eval.stop_at:
                run.say(f"held-out accuracy {held['eval/accuracy']:.3f} >= eval.stop_at: stopping after step {step}")
                reached = held
                break
    train_seconds = time.perf_counter() - start
    last_eval = reached or run.evaluate(len(losses))
    run.reader.close()
    return finish(run, {
        "steps": len(losses), "dp": run.dp_size, "tp": cfg.trainer.tensor_parallel, "examples": cfg.examples,
        "first_loss": losses[0], "last_loss": losses[-1], "losses": losses,
        "eval_before": first_eval, "eval_after": last_eval, "eval_history": run.history,
        "train_seconds": train_seconds, "skipped": dict(run.examples.skipped), "reader_skipped": dict(run.reader.skips),
        "source_model": str(run.source), "output_dir": str(run.out_dir), "run_dir": str(run.run_dir),
    })


def finish(run: SFTRun, summary: dict) -> dict:
    """Export the weights as an HF directory (its `yatt_sft.json` marks it complete)."""
    tensors = run.trainer.export_hf()  # collective over TP: every rank calls it
    if run.rank == 0:
        info = json.dumps({k: v for k, v in summary.items() if k != "losses"}, indent=1)
        save_hf_dir(tensors, run.source, run.out_dir, extra_files={"yatt_sft.json": info})
        (run.run_dir / "sft_summary.json").write_text(json.dumps(summary, indent=1))
        run.say(f"exported HF model to {run.out_dir}")
    dist.barrier(group=run.world_cpu)
    run.metrics.close()
    return summary


def run_and_report(cfg: SFTConfig) -> int:
    route_logs(cfg.fix_run_dir(), int(os.environ.get("RANK", 0)))
    summary = train(cfg)
    if dist.get_rank() == 0:
        print(json.dumps({k: summary[k] for k in ("first_loss", "last_loss", "eval_before", "eval_after",
                                                  "train_seconds", "skipped", "output_dir")}), flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_command("yatt-mm sft", SFTConfig, "yatt_mm.sft.train", run_and_report, argv)


if __name__ == "__main__":
    sys.exit(main())
