"""Supervised fine-tuning of the Megatron Qwen2-VL on WebDataset shards.

    yatt-mm sft --config configs/tiny_sft.yaml [key=value ...] [--nproc N]

Every DP rank streams its own samples (`DataReader(cfg.data, dp_rank, dp_size)`); the ranks of
one tensor-parallel group read the same samples. A sample becomes an example (chat prompt with
its media, and a target) through an example builder chosen by name (`examples:`):
- `answer`: question -> the sample's answer;
- `random_answer`: question -> a random answer of the sample's task (a uniformly drawn colour
  for a colour question): teaches the answer *format* only (the policy warm start);
- `judge`: GenRM judge prompt (question, media, response, reference) -> 'Score: 1' or 'Score: 0'
  by the rule `exact_match(response, answer)`; responses are the true answer or a wrong one of
  the same task, half each, and near misses (see `judge_response`; the judge warm start);
- `judge_compare`: verdicts on text-only prompts holding just the reference and the response
  (`genrm.COMPARE_TEMPLATE`), true or wrong answers only: the judge warm start's first stage.
The loss is the token mean of -logprob over the target tokens (prompt masked), normalised over
the whole step across DP ranks. Held-out samples (a hash of the key, never trained on, or
separate `eval.shards`) are scored by teacher-forced argmax: an example counts as correct when
every target token is the argmax given the true prefix, which is exactly when greedy decoding
would produce the target. At the end the weights are exported as an HF directory (config,
tokenizer and processor copied from the source model) that transformers and vLLM load.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import time
import zlib
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Literal

from dataio.reader import DataConfig
from models.trainer import TrainerConfig

# Answers of each synthetic task (dataio.synth), by the task name's last part: what a random or
# wrong answer of that task is drawn from.
TASK_CHOICES: dict[str, list[str]] = {
    "colour": ["blue", "green", "red", "yellow"],
    "direction": ["down", "left", "right", "up"],
    "count": ["1", "2", "3", "4", "5", "6"],
}


@dataclass
class EvalConfig:
    every: int = 0  # evaluate every N steps (0: only before and after training)
    samples: int = 32  # held-out examples per DP rank
    holdout_fraction: float = 0.1  # share of keys (by hash) held out of training; used when shards is empty
    shards: list[str] = field(default_factory=list)  # separate held-out shards (then nothing is held out)


@dataclass
class SFTConfig:
    model: str = "tiny:policy"  # HF directory, or tiny:policy / tiny:judge (models.tiny.tiny_model_dir)
    data: DataConfig = field(default_factory=DataConfig)
    trainer: TrainerConfig = field(default_factory=lambda: TrainerConfig(lr=1e-3))
    examples: Literal["answer", "random_answer", "judge", "judge_compare"] = "answer"
    tasks: list[str] = field(default_factory=list)  # keep only these sample tasks (e.g. image/colour); empty: all
    steps: int = 50
    batch_size: int = 16  # samples per DP rank per step
    micro_batch_size: int = 8
    warmup_steps: int = 0  # linear learning-rate warmup from 0 to trainer.lr
    eval: EvalConfig = field(default_factory=EvalConfig)
    seed: int = 0  # random answers / judge responses
    run_dir: str | None = None  # default runs/sft-TIME
    output_dir: str | None = None  # the exported HF directory; default RUN_DIR/hf
    log_every: int = 1

    def check(self) -> None:
        for name in ("steps", "batch_size", "micro_batch_size", "log_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.micro_batch_size > self.batch_size:
            raise ValueError(f"micro_batch_size ({self.micro_batch_size}) must be <= batch_size ({self.batch_size})")
        if self.eval.every < 0 or self.eval.samples < 0:
            raise ValueError("eval.every and eval.samples must be >= 0")
        if not 0.0 <= self.eval.holdout_fraction < 1.0:
            raise ValueError(f"eval.holdout_fraction must be in [0, 1), got {self.eval.holdout_fraction}")
        if self.model.startswith("tiny:") and self.model[5:] not in ("policy", "judge"):
            raise ValueError(f"model {self.model!r}: use tiny:policy, tiny:judge or an HF directory")
        self.data.check()


def resolve_model(model: str) -> Path:
    if model.startswith("tiny:"):
        from models.tiny import tiny_model_dir

        return tiny_model_dir(model[5:])
    path = Path(model)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"model {model!r} is not an HF directory (no config.json); "
                                "give a directory or tiny:policy / tiny:judge")
    return path


def load_config(path: str | None, overrides: list[str]) -> SFTConfig:
    from yatt_mm.config_utils import ConfigError, load

    cfg = load(SFTConfig, path, overrides)
    try:
        cfg.check()
    except ValueError as e:
        raise ConfigError(str(e)) from e
    return cfg


# ---------------------------------------------------------------- examples


@dataclass
class Example:
    key: str
    messages: list[dict]
    images: list
    videos: list
    target: str  # text the model must produce, ending with <|im_end|>


def _task_choices(sample) -> list[str] | None:
    task = str(sample.metadata.get("task", ""))
    return TASK_CHOICES.get(task.rsplit("/", 1)[-1])


def _media_parts(sample) -> list[dict]:
    return [{"type": "image"} for _ in sample.images] + [{"type": "video"} for _ in sample.videos]


def answer_example(sample, rng: random.Random) -> Example | str:
    msgs = [{"role": "user", "content": _media_parts(sample) + [{"type": "text", "text": sample.prompt}]}]
    return Example(sample.key, msgs, sample.images, sample.videos, f"{sample.answer}<|im_end|>")


def random_answer_example(sample, rng: random.Random) -> Example | str:
    choices = _task_choices(sample)
    if not choices:
        return "no_answer_choices"
    ex = answer_example(sample, rng)
    ex.target = f"{rng.choice(choices)}<|im_end|>"
    return ex


def judge_response(answer: str, choices: list[str], rng: random.Random, near_misses: bool) -> str:
    """A response for the judge to grade: the true answer or a wrong one of the task, half each;
    with `near_misses`, a third of them instead look like an early policy's slips (a cut-off
    word, a doubled letter, two words run together, a capitalised answer), graded by the same
    rule, so the judge learns where the rule draws its line."""
    wrong = [c for c in choices if c != answer]
    if near_misses and rng.random() < 1 / 3:
        other = rng.choice(wrong or choices)
        return rng.choice([answer[:rng.randint(1, max(1, len(answer) - 1))], answer + answer[-1],
                           answer[:2] + other[2:], other[:2] + answer[2:], answer.capitalize()])
    return answer if rng.random() < 0.5 or not wrong else rng.choice(wrong)


def judge_example(sample, rng: random.Random, compare_only: bool = False) -> Example | str:
    from yatt_mm.reward.genrm import COMPARE_TEMPLATE, JudgeConfig, JudgeItem, judge_messages
    from yatt_mm.reward.rules import exact_match

    choices = _task_choices(sample)
    if not choices:
        return "no_answer_choices"
    response = judge_response(sample.answer, choices, rng, near_misses=not compare_only)
    verdict = int(exact_match(response, sample.answer))
    if compare_only:  # text only: the reference and the response, no question, no media
        item, cfg = JudgeItem("", response, sample.answer), JudgeConfig(template=COMPARE_TEMPLATE)
    else:
        item, cfg = JudgeItem(sample.prompt, response, sample.answer, sample.images, sample.videos), JudgeConfig()
    return Example(sample.key, judge_messages(cfg, item), item.images, item.videos, f"Score: {verdict}<|im_end|>")


def judge_compare_example(sample, rng: random.Random) -> Example | str:
    return judge_example(sample, rng, compare_only=True)


EXAMPLE_BUILDERS: dict[str, Callable] = {
    "answer": answer_example,
    "random_answer": random_answer_example,
    "judge": judge_example,
    "judge_compare": judge_compare_example,
}
# Held-out examples of the format-only warm start are scored against the true answers.
EVAL_BUILDERS = {"answer": "answer", "random_answer": "answer", "judge": "judge", "judge_compare": "judge_compare"}


def is_held_out(key: str, fraction: float) -> bool:
    return fraction > 0 and zlib.crc32(key.encode()) % 10_000 < fraction * 10_000


class ExampleStream:
    """Examples from one rank's DataReader; unusable samples are skipped and counted."""

    def __init__(self, reader, builder: str, tasks: list[str], seed: int, keep: Callable[[str], bool]):
        self.reader = reader
        self.build = EXAMPLE_BUILDERS[builder]
        self.tasks = set(tasks)
        self.rng = random.Random(seed)
        self.keep = keep
        self.skipped: Counter[str] = Counter()
        self._it = iter(reader)

    def _reason(self, s) -> str | None:
        if self.tasks and s.metadata.get("task") not in self.tasks:
            return "other_task"
        if not s.images and not s.videos:
            return "no_media"
        if s.answer is None or not s.answer.strip():
            return "no_answer"
        if s.prompt is None or not s.prompt.strip():
            return "no_question"
        return None

    def __next__(self) -> Example:
        while True:
            s = next(self._it)
            if not self.keep(s.key):
                self.skipped["held_out"] += 1
                continue
            reason = self._reason(s)
            ex = self.build(s, self.rng) if reason is None else reason
            if isinstance(ex, str):
                self.skipped[ex] += 1
                continue
            return ex

    def __iter__(self):
        return self


# ---------------------------------------------------------------- batches


class Collator:
    """Examples -> right-padded MicroBatch with a mask on the target tokens (one processor call
    per example, so the prompt/target boundary is exact)."""

    def __init__(self, processor, spec):
        self.processor = processor
        self.spec = spec
        self.pad_id = processor.tokenizer.pad_token_id

    def encode(self, ex: Example) -> dict:
        import torch

        prompt = self.processor.apply_chat_template(ex.messages, add_generation_prompt=True, tokenize=False)
        kw = {}
        if ex.images:
            kw["images"] = ex.images
        if ex.videos:
            kw["videos"] = ex.videos
        enc = self.processor(text=[prompt], return_tensors="pt", **kw)
        target = self.processor.tokenizer(ex.target, add_special_tokens=False, return_tensors="pt")["input_ids"][0]
        enc = dict(enc)
        enc["prompt_len"] = enc["input_ids"].shape[1]
        enc["input_ids"] = torch.cat([enc["input_ids"][0], target])
        return enc

    def collate(self, encoded: list[dict]):
        import torch

        from models.qwen2vl.model import VLMInputs
        from models.trainer import MicroBatch

        n = max(e["input_ids"].shape[0] for e in encoded)
        ids = torch.full((len(encoded), n), self.pad_id, dtype=torch.long)
        attn = torch.zeros((len(encoded), n), dtype=torch.long)
        mask = torch.zeros((len(encoded), n), dtype=torch.float32)
        for row, e in enumerate(encoded):
            length = e["input_ids"].shape[0]
            ids[row, :length] = e["input_ids"]
            attn[row, :length] = 1
            mask[row, e["prompt_len"] - 1: length - 1] = 1.0  # logits at t predict token t + 1
        batch = {"input_ids": ids, "attention_mask": attn}
        for k in ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw",
                  "second_per_grid_ts"):  # Qwen2.5-VL processors: temporal M-RoPE spacing per video
            parts = [e[k] for e in encoded if k in e]
            if parts:
                batch[k] = torch.cat(parts)
        return MicroBatch(VLMInputs.from_processor(self.spec, batch), {"mask": mask})


# ---------------------------------------------------------------- evaluation


def evaluate(trainer, micro_batches, dp_group) -> dict[str, float]:
    """Held-out loss and teacher-forced exact-answer accuracy, summed over DP ranks."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state

    from models.logprobs import token_logprobs

    tp_group = parallel_state.get_tensor_model_parallel_group()
    tp = parallel_state.get_tensor_model_parallel_world_size()
    sums = torch.zeros(4, dtype=torch.float64)  # -logprob sum, target tokens, correct examples, examples
    trainer.model.eval()
    with torch.no_grad():
        for mb in micro_batches:
            inputs = mb.inputs.to(trainer.device)
            logits = trainer.model(inputs).float()
            lp = token_logprobs(logits, mb.labels.to(trainer.device)).cpu()
            # the label is the argmax iff its logprob is the largest: max logprob = -log sum exp(x - max)
            m = logits.max(-1, keepdim=True).values
            if tp > 1:
                dist.all_reduce(m, op=dist.ReduceOp.MAX, group=tp_group)
            z = torch.exp(logits - m).sum(-1)
            if tp > 1:
                dist.all_reduce(z, group=tp_group)
            is_max = (lp >= -torch.log(z).cpu() - 1e-5).float()
            mask = mb.extra["mask"]
            tokens_ok = (is_max * mask).sum(1) == mask.sum(1)
            sums += torch.tensor([float(-(lp * mask).sum()), float(mask.sum()), float(tokens_ok.sum()),
                                  float(mask.shape[0])], dtype=torch.float64)
    trainer.model.train()
    dist.all_reduce(sums, group=dp_group)
    return {"eval/loss": float(sums[0] / max(sums[1], 1)), "eval/accuracy": float(sums[2] / max(sums[3], 1)),
            "eval/examples": float(sums[3])}


# ---------------------------------------------------------------- export


_WEIGHT_FILES = (".safetensors", ".bin", ".pt", ".safetensors.index.json", ".bin.index.json")


def save_hf(tensors, source_dir: Path, out_dir: Path, info: dict) -> Path:
    """model.safetensors + every non-weight file of the source model (config, tokenizer,
    processor, chat template), written to a temporary sibling and renamed into place."""
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.with_name(f".{out_dir.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    for f in sorted(Path(source_dir).iterdir()):
        if f.is_file() and not f.name.endswith(_WEIGHT_FILES) and f.name != "yatt_tiny.json":
            shutil.copy2(f, tmp / f.name)
    save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, str(tmp / "model.safetensors"),
              metadata={"format": "pt"})
    (tmp / "yatt_sft.json").write_text(json.dumps(info, indent=1))
    if out_dir.exists():
        shutil.rmtree(out_dir)
    os.rename(tmp, out_dir)
    return out_dir


# ---------------------------------------------------------------- the loop


def run_sft(cfg: SFTConfig) -> dict:
    """Train; every rank calls this (under torchrun or as one process). Returns the summary."""
    import models  # noqa: F401 - CPU runtime hooks first
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from transformers import AutoProcessor

    from dataio.reader import DataReader
    from models.trainer import VLMTrainer, init_parallel
    from yatt_mm.metrics import MetricsWriter

    cfg.check()
    src = resolve_model(cfg.model)
    run_dir = Path(cfg.run_dir or f"runs/sft-{time.strftime('%Y%m%d-%H%M%S')}")
    out_dir = Path(cfg.output_dir) if cfg.output_dir else run_dir / "hf"
    init_parallel(cfg.trainer.tensor_parallel, cfg.trainer.seed)
    rank = dist.get_rank()
    dp_rank, dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    dp_group = ps.get_data_parallel_group()
    say = (lambda msg: print(msg, flush=True)) if rank == 0 else (lambda msg: None)

    trainer = VLMTrainer(str(src), cfg.trainer)
    processor = AutoProcessor.from_pretrained(str(src))
    processor.tokenizer.padding_side = "right"
    collator = Collator(processor, trainer.spec)
    metrics = MetricsWriter(run_dir, rank=rank, tensorboard=False)
    say(f"sft: model {src}, dp {dp_size} x tp {cfg.trainer.tensor_parallel}, {cfg.steps} steps of "
        f"{cfg.batch_size} samples/rank, examples={cfg.examples}, run dir {run_dir}")

    # held-out examples, built once
    holdout = cfg.eval.holdout_fraction if not cfg.eval.shards else 0.0
    eval_mbs = []
    if cfg.eval.samples:
        eval_data = DataConfig(**{**vars(cfg.data), "shards": cfg.eval.shards, "index": None, "shuffle": False}) \
            if cfg.eval.shards else DataConfig(**{**vars(cfg.data), "shuffle": False})
        eval_reader = DataReader(eval_data, dp_rank, dp_size)
        keep = (lambda k: True) if cfg.eval.shards else (lambda k: is_held_out(k, holdout))
        stream = ExampleStream(eval_reader, EVAL_BUILDERS[cfg.examples], cfg.tasks, cfg.seed + 10_000 + dp_rank, keep)
        held = []
        for s in eval_reader.iter_epoch():  # one pass at most
            if len(held) >= cfg.eval.samples:
                break
            if not keep(s.key) or stream._reason(s):
                continue
            ex = stream.build(s, stream.rng)
            if not isinstance(ex, str):
                held.append(ex)
        eval_reader.close()
        encoded = [collator.encode(e) for e in held]
        eval_mbs = [collator.collate(encoded[i:i + cfg.micro_batch_size])
                    for i in range(0, len(encoded), cfg.micro_batch_size)]
        n_held = torch.tensor(float(len(held)))
        dist.all_reduce(n_held, group=dp_group)
        if n_held == 0:
            raise RuntimeError("eval: no held-out example found; raise eval.holdout_fraction, give eval.shards, "
                               "or set eval.samples=0")

    reader = DataReader(cfg.data, dp_rank, dp_size)
    train = ExampleStream(reader, cfg.examples, cfg.tasks, cfg.seed + dp_rank,
                          lambda k: not is_held_out(k, holdout))

    history: list[dict] = []

    def run_eval(step: int) -> dict:
        if not eval_mbs:
            return {}
        t = time.perf_counter()
        m = evaluate(trainer, eval_mbs, dp_group)
        m["eval/seconds"] = time.perf_counter() - t
        metrics.log(step, m)
        say(f"eval step {step}: loss {m['eval/loss']:.4f}, accuracy {m['eval/accuracy']:.3f} "
            f"on {int(m['eval/examples'])} held-out examples")
        history.append({"step": step, **m})
        return m

    first_eval = run_eval(0)
    losses = []
    t_start = time.perf_counter()
    for step in range(1, cfg.steps + 1):
        t0 = time.perf_counter()
        examples = [next(train) for _ in range(cfg.batch_size)]
        encoded = [collator.encode(e) for e in examples]
        mbs = [collator.collate(encoded[i:i + cfg.micro_batch_size])
               for i in range(0, len(encoded), cfg.micro_batch_size)]
        t_data = time.perf_counter() - t0
        counts = torch.tensor([sum(float(mb.extra["mask"].sum()) for mb in mbs),
                               sum(float(mb.inputs.attention_mask.sum()) for mb in mbs), float(len(examples))])
        dist.all_reduce(counts, group=dp_group)
        target_tokens = counts[0]

        def loss_fn(lp, mb):
            # token mean over the whole step and all DP ranks (DDP averages gradients over DP)
            return -(lp * mb.extra["mask"].to(lp.device)).sum() * dp_size / target_tokens, {}

        if cfg.warmup_steps:
            for g in trainer.optimizer.param_groups:
                g["lr"] = cfg.trainer.lr * min(1.0, step / cfg.warmup_steps)
        m = trainer.train_step(mbs, loss_fn)
        dt = time.perf_counter() - t0
        loss = m["train/loss"] / dp_size  # this rank's share of the step's token-mean loss
        loss_t = torch.tensor(loss)
        dist.all_reduce(loss_t, group=dp_group)
        m["train/loss"] = float(loss_t)
        m.update({"train/tokens_per_s": float(counts[1]) / dt, "train/samples_per_s": float(counts[2]) / dt,
                  "train/target_tokens": float(target_tokens), "train/step_seconds": dt,
                  "train/data_seconds": t_data})
        for k, v in train.skipped.items():
            m[f"data/skipped_{k}"] = float(v)
        for k, v in reader.skips.items():
            m[f"data/reader_skipped_{k}"] = float(v)
        metrics.log(step, m)
        losses.append(m["train/loss"])
        if step % cfg.log_every == 0 or step == cfg.steps:
            say(f"step {step}/{cfg.steps}: loss {m['train/loss']:.4f}, {m['train/tokens_per_s']:.0f} tokens/s, "
                f"{m['train/samples_per_s']:.1f} samples/s, grad norm {m['train/grad_norm']:.3f}")
        if cfg.eval.every and step % cfg.eval.every == 0 and step != cfg.steps:
            run_eval(step)
    train_seconds = time.perf_counter() - t_start
    last_eval = run_eval(cfg.steps)
    reader.close()

    tensors = trainer.export_hf()  # collective over TP: every rank calls it
    summary = {
        "steps": cfg.steps, "dp": dp_size, "tp": cfg.trainer.tensor_parallel, "examples": cfg.examples,
        "first_loss": losses[0], "last_loss": losses[-1], "losses": losses,
        "eval_before": first_eval, "eval_after": last_eval, "eval_history": history,
        "train_seconds": train_seconds, "skipped": dict(train.skipped), "reader_skipped": dict(reader.skips),
        "source_model": str(src), "output_dir": str(out_dir), "run_dir": str(run_dir),
    }
    if rank == 0:
        save_hf(tensors, src, out_dir, {k: v for k, v in summary.items() if k != "losses"})
        (run_dir / "sft_summary.json").write_text(json.dumps(summary, indent=1))
        say(f"exported HF model to {out_dir}")
    dist.barrier()
    metrics.close()
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="yatt-mm sft", description="supervised fine-tuning of the Megatron Qwen2-VL")
    parser.add_argument("--config", default=None, help="YAML config (e.g. configs/tiny_sft.yaml)")
    parser.add_argument("--nproc", type=int, default=None,
                        help="relaunch under torchrun with N processes (DP x TP = N); default: this process only")
    parser.add_argument("overrides", nargs="*", help="key=value settings, e.g. steps=100 trainer.lr=1e-4")
    args = parser.parse_args(argv)
    from yatt_mm.config_utils import ConfigError

    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as e:
        print(f"yatt-mm sft: config error: {e}", file=sys.stderr)
        return 2
    if args.nproc is not None:
        if args.nproc < 1 or args.nproc % cfg.trainer.tensor_parallel:
            print(f"yatt-mm sft: --nproc {args.nproc} must be a positive multiple of trainer.tensor_parallel="
                  f"{cfg.trainer.tensor_parallel}", file=sys.stderr)
            return 2
        from yatt_mm.launch import relaunch

        return relaunch("yatt_mm.sft", args.nproc, (["--config", args.config] if args.config else []) + args.overrides)
    if cfg.trainer.tensor_parallel > 1 and "RANK" not in os.environ:
        print(f"yatt-mm sft: trainer.tensor_parallel={cfg.trainer.tensor_parallel} needs several processes: "
              f"add --nproc {cfg.trainer.tensor_parallel}", file=sys.stderr)
        return 2
    summary = run_sft(cfg)
    if int(os.environ.get("RANK", 0)) == 0:
        print(json.dumps({k: summary[k] for k in ("first_loss", "last_loss", "eval_before", "eval_after",
                                                  "train_seconds", "skipped", "output_dir")}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
