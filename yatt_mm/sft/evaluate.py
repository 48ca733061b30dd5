"""Held-out loss and teacher-forced exact-answer accuracy of the SFT model.

An example counts as correct when every target token is the argmax given the true prefix,
which is exactly when greedy decoding would produce the target.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from models.logprobs import token_logprobs


def evaluate(trainer, micro_batches, dp_cpu) -> dict[str, float]:
    """Held-out loss and teacher-forced exact-answer accuracy, summed over DP ranks (`dp_cpu`:
    the CPU DP group of `models.comm`; the TP reductions of the logits stay on the device)."""
    from megatron.core import parallel_state

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
    dist.all_reduce(sums, group=dp_cpu)
    return {"eval/loss": float(sums[0] / max(sums[1], 1)), "eval/accuracy": float(sums[2] / max(sums[3], 1)),
            "eval/examples": float(sums[3])}
