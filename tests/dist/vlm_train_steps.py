"""A few training steps of the tiny Megatron Qwen2-VL under torchrun (gloo): different image
samples on each DP rank, a supervised loss on the answer tokens. Rank 0 prints one JSON line:
losses per step, whether DP replicas agree bit for bit, and the TP-gathered HF export's shapes
(`train_case` returns it: tests/dist/cases.py runs it beside other cases).

    torchrun --nproc-per-node 2 tests/dist/vlm_train_steps.py --tp 1   # DP=2
    torchrun --nproc-per-node 2 tests/dist/vlm_train_steps.py --tp 2   # TP=2
"""

from __future__ import annotations

import argparse
import json
import random
import sys

import models  # noqa: F401 - CPU runtime hooks first
import torch
import torch.distributed as dist

from dataio.synth import colour_image
from models.qwen2vl.convert import load_hf_state
from models.inputs import VLMInputs
from models.tiny import tiny_model_dir
from models.comm import comm, destroy_parallel, init_parallel
from models.offload import optimizer_tensors
from models.trainer import MicroBatch, TrainerConfig, VLMTrainer


def sft_batch(processor, spec, samples):
    """Right-padded prompt + answer; loss on the answer tokens."""
    texts, prompts = [], []
    for s in samples:
        msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": s.question}]}]
        prompt = processor.apply_chat_template(msgs, add_generation_prompt=True)
        prompts.append(prompt)
        texts.append(prompt + s.answer + "<|im_end|>")
    batch = dict(processor(text=texts, images=[s.image for s in samples], return_tensors="pt", padding=True))
    mask = torch.zeros_like(batch["input_ids"], dtype=torch.float32)
    for row, (prompt, s) in enumerate(zip(prompts, samples)):
        p = len(processor(text=[prompt], images=[s.image], return_tensors="pt")["input_ids"][0])
        n = int(batch["attention_mask"][row].sum())
        mask[row, p - 1 : n - 1] = 1.0  # logits at t predict token t + 1
    return MicroBatch(VLMInputs.from_processor(spec, batch), {"mask": mask})


def offload_round_trip(trainer) -> dict:
    """Release the trainer to the host in two stages (optimizer state first, then the weights,
    as a step's placement does) and back: device bytes at each stage, and whether every weight
    and optimizer tensor came back bit for bit."""
    def snapshot():
        return [t.detach().clone() for t in list(trainer.module.parameters()) + optimizer_tensors(trainer.optimizer)]

    before, resident = snapshot(), trainer.device_bytes()
    trainer.release("weights")
    weights_only = trainer.device_bytes()
    trainer.release("none")
    released = trainer.device_bytes()
    trainer.acquire("all")
    after = snapshot()
    return {"resident_bytes": resident, "weights_only_bytes": weights_only, "released_bytes": released,
            "bitwise": len(before) == len(after) and all(torch.equal(a, b) for a, b in zip(before, after))}


def replicated_weights_diff(module, tp_group) -> dict[str, float]:
    """The weights every TP rank holds whole (not marked `tensor_model_parallel`): each one's
    largest relative difference between TP ranks after training. They stay equal only if their
    gradients are the same on every rank: a weight applied to this rank's heads alone (a norm
    shared by all heads) needs its gradient summed over TP."""
    out = {}
    for name, p in module.named_parameters():
        if getattr(p, "tensor_model_parallel", False):
            continue
        mine = p.detach().float()
        gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size(tp_group))]
        dist.all_gather(gathered, mine, group=tp_group)
        out[name] = max(float((g - mine).abs().max()) for g in gathered) / max(float(mine.abs().max()), 1e-12)
    return {k: v for k, v in out.items() if v > 0}  # the ones that differ


def train_case(path: str, tp: int, dtype: str, steps: int) -> dict:
    from megatron.core import parallel_state as ps
    from transformers import AutoProcessor

    init_parallel(tp)
    trainer = VLMTrainer(path, TrainerConfig(tensor_parallel=tp, lr=1e-3, dtype=dtype, offload="always"))
    processor = AutoProcessor.from_pretrained(path)
    processor.tokenizer.padding_side = "right"
    dp_rank = ps.get_data_parallel_rank()
    rng = random.Random(100 + dp_rank)  # different data per DP rank
    batches = [sft_batch(processor, trainer.spec, [colour_image(rng) for _ in range(2)]) for _ in range(2)]
    tokens = torch.tensor(sum(float(b.extra["mask"].sum()) for b in batches))
    dist.all_reduce(tokens, group=comm().dp_cpu)

    def loss_fn(lp, mb):
        # token mean over the whole step and all DP ranks (DDP averages gradients over DP)
        return -(lp * mb.extra["mask"]).sum() * trainer.dp_size / tokens, {}

    losses = []
    for _ in range(steps):
        m = trainer.train_step(batches, loss_fn)
        losses.append(m["train/loss"])
    offload = offload_round_trip(trainer)
    losses.append(trainer.train_step(batches, loss_fn)["train/loss"])  # trains on after the reload
    # vocab-parallel entropy and logprobs agree with the full-vocabulary computation
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    from models.logprobs import label_is_argmax, token_entropy, token_logprobs

    with torch.no_grad():
        logits = trainer.model(batches[0].inputs)
        full = gather_from_tensor_model_parallel_region(logits).float()
        ref_lp = torch.log_softmax(full, -1).gather(-1, batches[0].labels[..., None])[..., 0]
        ref_ent = -(torch.softmax(full, -1) * torch.log_softmax(full, -1)).sum(-1)
        entropy_diff = float((token_entropy(logits).float() - ref_ent).abs().max())
        logprob_diff = float((token_logprobs(logits, batches[0].labels).float() - ref_lp).abs().max())
        # ~10x the figures measured (entropy 6.6e-6 to 8.0e-6, logprobs 1.9e-6: TP 1 and 2 in
        # fp32, TP 1 in bf16; the sums over the vocabulary in another order)
        entropy_ok = bool(entropy_diff < 5e-5 and logprob_diff < 2e-5
                          # the label is a most likely token (in bf16 logits tie: argmax picks one of them)
                          and torch.equal(label_is_argmax(logits, batches[0].labels),
                                          full.gather(-1, batches[0].labels[..., None])[..., 0] >= full.max(-1).values))
    # the differentiable entropy (an entropy bonus) has the full vocabulary's gradient on this
    # rank's slice of it
    from megatron.core import parallel_state

    start = parallel_state.get_tensor_model_parallel_rank() * logits.shape[-1]
    own = logits.detach().float().requires_grad_(True)
    (grad,) = torch.autograd.grad(token_entropy(own, differentiable=True).sum(), own)
    full_leaf = full.detach().requires_grad_(True)
    (ref_grad,) = torch.autograd.grad((-(torch.softmax(full_leaf, -1) * torch.log_softmax(full_leaf, -1)).sum(-1)).sum(),
                                      full_leaf)
    entropy_grad_diff = float((grad - ref_grad[..., start:start + logits.shape[-1]]).abs().max())
    flat = torch.cat([p.detach().reshape(-1) for p in trainer.module.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(ps.get_data_parallel_world_size())]
    dist.all_gather(gathered, flat, group=ps.get_data_parallel_group())
    identical = all(torch.equal(g, gathered[0]) for g in gathered)
    tp_replica_diff = replicated_weights_diff(trainer.module, ps.get_tensor_model_parallel_group())
    exported = trainer.export_hf()
    reference = load_hf_state(path)
    shapes_ok = exported.keys() == reference.keys() and all(exported[k].shape == reference[k].shape for k in reference)
    return {"model_type": trainer.spec.model_type, "tp": tp, "dp": trainer.dp_size, "dtype": dtype,
            "losses": losses, "dp_identical": identical, "tp_replica_diff": tp_replica_diff,
            "entropy_tp_consistent": entropy_ok, "entropy_tp_max_diff": entropy_diff,
            "logprob_tp_max_diff": logprob_diff, "entropy_grad_max_diff": entropy_grad_diff,
            "export_shapes_ok": shapes_ok, "offload": offload,
            "param_dtypes": sorted({str(p.dtype) for p in trainer.module.parameters()})}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--kind", default="policy", help="the tiny model (models/tiny.py's kinds)")
    args = parser.parse_args()
    result = {"kind": args.kind, **train_case(str(tiny_model_dir(args.kind)), args.tp, args.dtype, args.steps)}
    if dist.get_rank() == 0:
        print(json.dumps(result), flush=True)
    destroy_parallel()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
