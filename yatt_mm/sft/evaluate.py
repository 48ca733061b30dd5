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
    def per_token(logits, mb):  # where the logits are (the last pipeline stage)
        labels = mb.labels.to(logits.device)
        return {"lp": token_logprobs(logits, labels), "is_max": label_is_argmax(logits, labels)}

    sums = torch.zeros(4, dtype=torch.float64)  # -logprob sum, target tokens, correct examples, examples
    for mb, scores in zip(micro_batches, trainer.score(micro_batches, per_token)):
        lp, is_max, mask = scores["lp"], scores["is_max"].float(), mb.extra["mask"]
        tokens_ok = (is_max * mask).sum(1) == mask.sum(1)
        sums += torch.tensor([float(-(lp * mask).sum()), float(mask.sum()), float(tokens_ok.sum()),
                              float(mask.shape[0])], dtype=torch.float64)
    dist.all_reduce(sums, group=dp_cpu)
    return {"eval/loss": float(sums[0] / max(sums[1], 1)), "eval/accuracy": float(sums[2] / max(sums[3], 1)),
            "eval/examples": float(sums[3])}
