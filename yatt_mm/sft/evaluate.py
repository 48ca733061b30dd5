"""Held-out loss and teacher-forced exact-answer accuracy of the SFT model.

An example counts as correct when every target token is the argmax given the true prefix,
which is exactly when greedy decoding would produce the target.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from models.logprobs import label_is_argmax, token_logprobs


def evaluate(trainer, micro_batches, dp_cpu) -> dict[str, float]:
    """Held-out loss and teacher-forced exact-answer accuracy, summed over DP ranks (`dp_cpu`:
    the CPU DP group of `models.comm`; the vocab-parallel reductions happen in models/logprobs)."""
    sums = torch.zeros(4, dtype=torch.float64)  # -logprob sum, target tokens, correct examples, examples
    trainer.model.eval()
    with torch.no_grad():
        for mb in micro_batches:
            inputs = mb.inputs.to(trainer.device)
            logits = trainer.model(inputs)
            labels = mb.labels.to(trainer.device)
            lp = token_logprobs(logits, labels).cpu()
            is_max = label_is_argmax(logits, labels).cpu().float()
            mask = mb.extra["mask"]
            tokens_ok = (is_max * mask).sum(1) == mask.sum(1)
            sums += torch.tensor([float(-(lp * mask).sum()), float(mask.sum()), float(tokens_ok.sum()),
                                  float(mask.shape[0])], dtype=torch.float64)
    trainer.model.train()
    dist.all_reduce(sums, group=dp_cpu)
    return {"eval/loss": float(sums[0] / max(sums[1], 1)), "eval/accuracy": float(sums[2] / max(sums[3], 1)),
            "eval/examples": float(sums[3])}
