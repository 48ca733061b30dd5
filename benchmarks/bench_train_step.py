"""Training tokens/s of a tiny VLM (the tiny Qwen2-VL, or with --kind qwen25vl / qwen3vl / qwen3vlmoe / qwen35
/ qwen35moe the tiny Qwen2.5-VL / Qwen3-VL / Qwen3-VL-MoE / Qwen3.5 / Qwen3.5-MoE, whose gated DeltaNet layers
run Megatron's pure-torch chunked rule on CPU):
yatt-mm's VLMTrainer (Megatron-Core, DDP, Megatron's optimizer) vs what a user would otherwise
write: transformers' model class (Qwen2VLForConditionalGeneration, Qwen3VLForConditionalGeneration,
Qwen3VLMoeForConditionalGeneration, Qwen3_5ForConditionalGeneration,
Qwen3_5MoeForConditionalGeneration) + torch.optim.AdamW. Same
weights, same batch (right-padded colour-question images, loss on the answer tokens), same loss,
same clipping, one process, same cores, measured in the same run in interleaved rounds; the best
round of each is reported (other processes on a shared machine only ever slow a round down, so
the best round is the least disturbed), medians beside it.

    python benchmarks/bench_train_step.py [--kind qwen2vl|qwen25vl|qwen3vl|qwen3vlmoe|qwen35|qwen35moe] [--rounds 5] [--steps-per-round 3] [--batch 16]

The last line is one JSON object: kind, tokens_per_s, transformers_tokens_per_s,
ratio_to_transformers (best rounds), median_round_ratio (the median over rounds of the two
back-to-back steps' ratio), and first_step_loss_gap: how far apart the two first steps' losses are
(same weights, same batch: the same function computed twice).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import models  # noqa: F401 - CPU runtime hooks first
import torch
from _common import full_or_smoke


def make_batch(processor, spec, n: int, micro: int):
    from dataio.synth import colour_image
    from yatt_mm.sft.collate import Collator
    from yatt_mm.sft.examples import Example

    rng = random.Random(0)
    examples = []
    for i in range(n):
        s = colour_image(rng)
        msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": s.question}]}]
        examples.append(Example(f"k{i}", msgs, [s.image], [], f"{s.answer}<|im_end|>"))
    col = Collator(processor, spec)  # one processor call per micro-batch (it no longer encodes one by one)
    return [col.collate(examples[i:i + micro]) for i in range(0, n, micro)]


# --kind -> (the tiny model's kind, transformers' class for it)
KINDS = {"qwen2vl": ("policy", "Qwen2VLForConditionalGeneration"),
         "qwen25vl": ("policy25", "Qwen2_5_VLForConditionalGeneration"),
         "qwen3vl": ("qwen3vl", "Qwen3VLForConditionalGeneration"),
         "qwen3vlmoe": ("qwen3vlmoe", "Qwen3VLMoeForConditionalGeneration"),
         "qwen35": ("qwen35", "Qwen3_5ForConditionalGeneration"),
         "qwen35moe": ("qwen35moe", "Qwen3_5MoeForConditionalGeneration")}


def main() -> int:
    import transformers
    from transformers import AutoProcessor

    from models.tiny import tiny_model_dir
    from models.comm import init_parallel
    from models.trainer import TrainerConfig, VLMTrainer

    ap = argparse.ArgumentParser()
    ap.add_argument("--kind", choices=sorted(KINDS), default="qwen2vl", help="which tiny model family")
    ap.add_argument("--rounds", type=int, default=full_or_smoke(6, 1))
    ap.add_argument("--steps-per-round", type=int, default=full_or_smoke(3, 1))
    ap.add_argument("--batch", type=int, default=full_or_smoke(16, 4))
    ap.add_argument("--micro", type=int, default=full_or_smoke(8, 2))
    args = ap.parse_args()

    tiny_kind, hf_class = KINDS[args.kind]
    path = str(tiny_model_dir(tiny_kind))
    lr = 1e-4
    init_parallel(1)
    trainer = VLMTrainer(path, TrainerConfig(lr=lr, clip_grad=1.0))
    processor = AutoProcessor.from_pretrained(path)
    processor.tokenizer.padding_side = "right"
    mbs = make_batch(processor, trainer.spec, args.batch, args.micro)
    tokens = sum(int(mb.inputs.attention_mask.sum()) for mb in mbs)
    target = sum(float(mb.extra["mask"].sum()) for mb in mbs)

    def megatron_step():
        return trainer.train_step(mbs, lambda lp, mb: (-(lp * mb.extra["mask"]).sum() / target, {}))["train/loss"]

    hf = getattr(transformers, hf_class).from_pretrained(path, dtype=torch.float32)
    hf.train()
    opt = torch.optim.AdamW(hf.parameters(), lr=lr, weight_decay=0.0)

    def hf_step():
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for mb in mbs:
            x = mb.inputs
            types = (x.input_ids == trainer.spec.image_token_id).int()  # what the processor returns
            logits = hf(input_ids=x.input_ids, attention_mask=x.attention_mask, pixel_values=x.pixel_values,
                        image_grid_thw=x.image_grid_thw, mm_token_type_ids=types).logits
            lp = torch.log_softmax(logits.float(), -1).gather(-1, mb.labels.unsqueeze(-1)).squeeze(-1)
            loss = -(lp * mb.extra["mask"]).sum() / target
            loss.backward()
            total += float(loss.detach())
        torch.nn.utils.clip_grad_norm_(hf.parameters(), 1.0)
        opt.step()
        return total

    def timed(step) -> float:
        t0 = time.perf_counter()
        for _ in range(args.steps_per_round):
            step()
        return tokens * args.steps_per_round / (time.perf_counter() - t0)

    loss_gap = abs(megatron_step() - hf_step())  # warm up both, from the same weights on the same batch
    ours, theirs = [], []
    for r in range(args.rounds):  # interleaved, alternating which goes first
        pair = [(ours, megatron_step), (theirs, hf_step)]
        for out, step in (pair if r % 2 == 0 else pair[::-1]):
            out.append(timed(step))
        print(f"round {r + 1}/{args.rounds}: VLMTrainer {ours[-1]:.0f} tokens/s, transformers {theirs[-1]:.0f} tokens/s",
              flush=True)
    a, b = max(ours), max(theirs)
    print(json.dumps({"kind": args.kind, "tokens_per_s": round(a, 1), "transformers_tokens_per_s": round(b, 1),
                      "ratio_to_transformers": round(a / b, 3),
                      # each round's pair ran back to back: the median of their ratios is the
                      # least sensitive to another job starting or stopping between rounds
                      "median_round_ratio": round(statistics.median(x / y for x, y in zip(ours, theirs)), 3),
                      "median_tokens_per_s": round(statistics.median(ours), 1),
                      "median_transformers_tokens_per_s": round(statistics.median(theirs), 1),
                      "first_step_loss_gap": loss_gap, "tokens_per_step": tokens, "batch": args.batch,
                      "micro_batch": args.micro, "rounds": args.rounds, "steps_per_round": args.steps_per_round,
                      "threads": torch.get_num_threads(), "statistic": "best round"}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
