"""Activation recompute of the tiny Megatron Qwen2-VL (or the tiny model kind given as the
argument): one long image + text micro-batch, the
same weights built three times (recompute none, selective, full). Prints one JSON line: the
largest gradient difference to no recompute, and the bytes autograd keeps for the backward pass
(tensors saved during the forward, counted once per storage), per setting, the whole model's and
the vision tower's; `run(kind)` returns
it (tests/dist/cases.py runs it beside other cases).

    python tests/dist/recompute.py
"""

from __future__ import annotations

import json
import random
import sys

import models  # noqa: F401 - CPU runtime hooks first
import torch

from dataio.synth import colour_image
from models.comm import init_parallel
from models.family import read_spec
from models.inputs import VLMInputs
from models.tiny import tiny_model_dir
from models.trainer import TrainerConfig, build_module


def saved_bytes_and_grads(path: str, spec, batch, recompute: str) -> tuple[int, int, dict[str, torch.Tensor]]:
    """Bytes autograd keeps for the backward (the whole model's, and the vision tower's of them)
    and the gradients."""
    module = build_module(path, spec, TrainerConfig(recompute=recompute)).train()
    storages: dict[int, int] = {}
    vision: set[int] = set()  # the storages saved while the vision tower runs
    in_vision = []
    module.vision.register_forward_pre_hook(lambda *_: in_vision.append(True))
    module.vision.register_forward_hook(lambda *_: in_vision.clear())  # (None: the output stays)

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        if in_vision:
            vision.add(t.untyped_storage().data_ptr())
        return t

    inputs = VLMInputs.from_processor(spec, batch)
    labels = torch.roll(inputs.input_ids, -1, 1)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logits = module(inputs)
    weights = {p.untyped_storage().data_ptr() for p in module.parameters()}  # saved, but not activations
    kept = sum(n for ptr, n in storages.items() if ptr not in weights)
    vision_kept = sum(n for ptr, n in storages.items() if ptr in vision and ptr not in weights)
    loss = torch.log_softmax(logits.float(), -1).gather(-1, labels[..., None]).sum()
    loss.backward()
    return kept, vision_kept, {n: p.grad.clone() if p.grad is not None else p.main_grad.clone()
                  for n, p in module.named_parameters()}


def run(kind: str = "policy") -> dict:
    """`kind`: a tiny model kind, any family's."""
    from transformers import AutoProcessor

    init_parallel(1)
    path = str(tiny_model_dir(kind))
    spec = read_spec(path)
    processor = AutoProcessor.from_pretrained(path)
    sample = colour_image(random.Random(0))
    long_text = " ".join(["describe the square and its colour in detail"] * 60)
    msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": long_text}]}]
    batch = dict(processor(text=[processor.apply_chat_template(msgs, add_generation_prompt=True)],
                           images=[sample.image], return_tensors="pt"))
    result = {"kind": kind, "tokens": int(batch["input_ids"].shape[1])}
    base_bytes, base_vision, base = saved_bytes_and_grads(path, spec, batch, "none")
    result["saved_bytes"], result["vision_saved_bytes"] = {"none": base_bytes}, {"none": base_vision}
    scale = max(float(g.abs().max()) for g in base.values())
    for mode in ("selective", "full"):
        kept, vision_kept, grads = saved_bytes_and_grads(path, spec, batch, mode)
        result["saved_bytes"][mode], result["vision_saved_bytes"][mode] = kept, vision_kept
        result[f"{mode}_grad_max_diff"] = max(float((grads[n] - base[n]).abs().max()) for n in base) / scale
    return result


if __name__ == "__main__":
    print(json.dumps(run(sys.argv[1] if len(sys.argv) > 1 else "policy")), flush=True)
