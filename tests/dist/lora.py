"""LoRA on the Megatron trainer against transformers + peft, under torchrun (gloo) at any TP x PP
(x EP for an MoE) (`run()` returns its result: tests/dist/cases.py runs it beside other cases).

The trainer gets adapters on every language projection (rank 8), B set to seeded random values
(B starts at zero: the model would equal the base), and its adapter is exported whole as a PEFT
directory that peft loads onto transformers' model:
- logits: the Megatron model with the adapter against transformers + peft, per parity probe;
- gradients (without PP): of a fixed random projection of the logits, every B's against peft's,
  every A's against the sum of peft's over the projections that share it (q/k/v, gate/up);
- the merged export (W + alpha/r B A, what the full weight sync sends) loaded into transformers
  alone gives peft's logits;
- frozen base: the optimizer and DDP's gradient buffers hold the adapter's parameters only, and
  a training step moves the adapter and leaves every base weight bit for bit as it was;
- the reference policy (adapters off) gives the base model's logprobs.
"""

from __future__ import annotations

import random
import tempfile
from pathlib import Path

import models  # noqa: F401 - CPU runtime hooks first
import torch
import torch.distributed as dist

from dataio.synth import colour_image
from models.comm import init_parallel
from models.convert import whole_pairs
from models.lora import LoRAConfig, adapter_state, frozen_state, lora_linears, save_adapter_dir
from models.tiny import tiny_model_dir
from models.trainer import BaseWithoutAdapter, TrainerConfig, VLMTrainer
from vlm_train_steps import sft_batch


def _randomise_b(module, seed: int) -> None:
    """Every B to seeded random values, by its linear's whole-model name (a routed expert's by its
    global number): a row-parallel layer's B, whole on every TP rank, the same on each; a
    column-parallel layer's, split over TP, this TP rank's part (the export gathers them). Every
    DP replica alike."""
    from models.lora import _name_seed
    from models.stages import global_name

    with torch.no_grad():
        for name, linear in lora_linears(module):
            split = linear.lora_B.tensor_model_parallel
            tp_rank = dist.get_rank(linear.tp_group) if split else 0
            gen = torch.Generator().manual_seed(_name_seed(seed, global_name(name, module)) + tp_rank)
            linear.lora_B.copy_(0.05 * torch.randn(linear.lora_B.shape, generator=gen))


def _hf_models(path: str, adapter_dir: Path, merged_dir: Path):
    from peft import PeftModel
    from transformers import AutoModelForImageTextToText

    peft = PeftModel.from_pretrained(AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32),
                                     str(adapter_dir), is_trainable=True)
    merged = AutoModelForImageTextToText.from_pretrained(str(merged_dir), dtype=torch.float32).eval()
    return peft.eval(), merged


def _grad_diffs(trainer, peft, processor, spec) -> dict[str, float]:
    """Gradients of sum(logits x R) (R fixed, random) on the image probe: the trainer's adapter
    gradients (gathered over TP) against peft's; relative to the largest."""
    from models.family import family_of
    from models.inputs import VLMInputs
    from models.qwen2vl.parity import gather_vocab, probes

    messages, media = probes()["image"]
    text = processor.apply_chat_template(messages, add_generation_prompt=True)
    batch = processor(text=[text], return_tensors="pt", **media)
    ref_logits = peft(**batch).logits.float()
    weights = torch.randn(ref_logits.shape, generator=torch.Generator().manual_seed(7))
    (ref_logits * weights).sum().backward()
    trainer.model.zero_grad_buffer()
    logits = gather_vocab(trainer.module(VLMInputs.from_processor(spec, dict(batch))))
    # under EP an expert-parallel rank's experts compute every rank's tokens: the other ranks'
    # copies of the probe carry no gradient, so the experts' gradients are the probe's once
    from megatron.core import parallel_state as ps

    (logits.float() * weights * float(ps.get_data_parallel_rank() == 0)).sum().backward()
    ours = family_of(spec).lora_to_hf(spec, whole_pairs(trainer.module, trainer.tp_group, grads=True))
    theirs = {n.replace(".default", "").removeprefix("base_model.model."): p.grad
              for n, p in peft.named_parameters() if p.grad is not None}
    shared: dict[int, list[str]] = {}  # a fused layer's one A, by identity: the projections it serves
    for path, (a, _) in ours.items():
        shared.setdefault(id(a), []).append(path)
    scale = max(float(t.abs().max()) for t in theirs.values())
    b = max(float((ours[p][1] - theirs[f"{p}.lora_B.weight"]).abs().max()) for p in ours)
    a = max(float((ours[paths[0]][0] - sum(theirs[f"{p}.lora_A.weight"] for p in paths)).abs().max())
            for paths in shared.values())
    return {"grad_b_max_diff": b / scale, "grad_a_max_diff": a / scale, "grads_compared": len(ours)}


def run(tp: int = 1, pp: int = 1, kind: str = "policy", ep: int = 1) -> dict:
    from transformers import AutoProcessor

    from models.hf_io import save_hf_dir
    from models.qwen2vl.parity import logit_diffs

    from models.family import family_for_tiny_kind
    from models.lora import DEFAULT_TARGETS

    groups = init_parallel(tp, seed=0, pipeline_parallel=pp, expert_parallel=ep)
    path = str(tiny_model_dir(kind))
    # every projection the family's adapters reach (an MoE's: the attention's), and the vision tower's blocks
    targets = family_for_tiny_kind(kind).lora_targets or DEFAULT_TARGETS
    lora = LoRAConfig(rank=8, alpha=16.0, target_modules=list(targets),
                      vision_tower=True)
    trainer = VLMTrainer(path, TrainerConfig(tensor_parallel=tp, pipeline_parallel=pp, expert_parallel=ep, lr=1e-2,
                                             seed=3), lora=lora)
    module, spec = trainer.module, trainer.spec
    _randomise_b(module, 11)
    adapter = trainer.export_adapter()
    merged = trainer.export_hf()
    with tempfile.TemporaryDirectory() as tmp:
        adapter_dir = save_adapter_dir(adapter, trainer.adapter_config(), Path(tmp) / "adapter")
        merged_dir = save_hf_dir(merged, path, Path(tmp) / "merged")
        peft, merged_hf = _hf_models(path, adapter_dir, merged_dir)
        processor = AutoProcessor.from_pretrained(path)
        out = {"tp": tp, "pp": pp, "ep": ep, "kind": kind, "adapter_tensors": len(adapter),
               "adapter_bytes": sum(t.numel() * t.element_size() for t in adapter.values()),
               "logits_max_diff": logit_diffs(module, peft, processor, spec, groups),
               "merged_vs_peft_max_diff": _hf_diff(merged_hf, peft, processor)}
        if pp == 1:
            out |= _grad_diffs(trainer, peft, processor, spec)
    out |= _frozen_base(trainer, processor)
    if (tp, pp, ep) == (1, 1, 1):
        out["freeze_vision"] = _frozen_vision(path, processor)
    if tp > 1:  # what every TP rank holds whole (a column layer's A, a row layer's B) stayed alike
        from vlm_train_steps import replicated_weights_diff

        from models.convert import split_adapter_tensors, whole_adapter_tensors

        out["replicated_differ"] = replicated_weights_diff(module, trainer.tp_group)
        # a resume at another layout's whole form (yatt_mm/rl/relayout.py), cut again: this rank's part
        mine = {n: p.detach() for n, p in module.named_parameters() if p.requires_grad}
        back = split_adapter_tensors(module, whole_adapter_tensors(module, mine, trainer.tp_group), trainer.tp_group)
        out["whole_form_roundtrip_bitwise"] = back.keys() == mine.keys() and all(torch.equal(back[n], mine[n])
                                                                                 for n in mine)
    return out


def _frozen_vision(path: str, processor) -> dict:
    """policy.freeze_vision without LoRA: the tower gets no gradient buffer and no optimizer
    state, and a training step moves the language model only."""
    trainer = VLMTrainer(path, TrainerConfig(lr=1e-2, distributed_optimizer=False), freeze_vision=True)
    vision = {k: v.detach().clone() for k, v in trainer.module.vision.named_parameters()}
    language = {k: v.detach().clone() for k, v in trainer.module.language.named_parameters()}
    buffers = sum(buf.grad_data.numel() for buf in trainer.model.buffers)
    batch = sft_batch(processor, trainer.spec, [colour_image(random.Random(6)) for _ in range(2)])
    trainer.train_step([batch], lambda lp, mb: (-(lp * mb.extra["mask"]).sum() / mb.extra["mask"].sum(), {}))
    optimized = sum(p.numel() for g in trainer.optimizer.optimizer.param_groups for p in g["params"])
    return {"vision_unchanged": all(torch.equal(v, trainer.module.vision.get_parameter(k)) for k, v in vision.items()),
            "language_moved": any(not torch.equal(v, trainer.module.language.get_parameter(k))
                                  for k, v in language.items()),
            "vision_numel": sum(v.numel() for v in vision.values()),
            "language_numel": sum(v.numel() for v in language.values()),
            "grad_buffer_numel": buffers, "optimizer_numel": optimized}


def _hf_diff(a, b, processor) -> float:
    from models.qwen2vl.parity import probes

    worst = 0.0
    for messages, media in probes().values():
        batch = processor(text=[processor.apply_chat_template(messages, add_generation_prompt=True)],
                          return_tensors="pt", **media)
        with torch.no_grad():
            worst = max(worst, float((a(**batch).logits - b(**batch).logits).abs().max()))
    return worst


def _frozen_base(trainer, processor) -> dict:
    """What the optimizer and DDP hold, and what a training step moves; the reference policy."""
    processor.tokenizer.padding_side = "right"
    adapters, base = adapter_state(trainer.module), frozen_state(trainer.module)
    optimized = [p for opt in (getattr(trainer.optimizer, "chained_optimizers", None) or [trainer.optimizer])
                 for g in opt.optimizer.param_groups for p in g["params"]]
    buffers = sum(buf.grad_data.numel() for buf in trainer.model.buffers + trainer.model.expert_parallel_buffers)
    rng = random.Random(5)
    batch = sft_batch(processor, trainer.spec, [colour_image(rng) for _ in range(2)])
    reference = BaseWithoutAdapter(trainer)
    ref_before = reference.logprobs([batch])[0]
    with_adapter = trainer.logprobs([batch])[0]
    base_before = {k: v.detach().clone() for k, v in base.items()}
    adapters_before = {k: v.detach().clone() for k, v in adapters.items()}
    trainer.train_step([batch], lambda lp, mb: (-(lp * mb.extra["mask"]).sum() / mb.extra["mask"].sum(), {}))
    return {
        "trainable": sorted({p.requires_grad for p in trainer.module.parameters()}) == [False, True],
        "optimizer_tensors": len(optimized), "adapter_tensors_local": len(adapters),
        "optimizer_numel": sum(p.numel() for p in optimized),
        "adapter_numel": sum(p.numel() for p in adapters.values()),
        "grad_buffer_numel": buffers,
        "base_unchanged": all(torch.equal(base_before[k], v) for k, v in base.items()),
        # a routed expert that no token of the step reached gets no gradient, and stays
        "adapters_all_moved": all(not torch.equal(adapters_before[k], v) for k, v in adapters.items()
                                  if ".local_experts." not in k),
        "expert_adapters_moved": sum(not torch.equal(adapters_before[k], v) for k, v in adapters.items()
                                     if ".local_experts." in k),
        "expert_adapters": sum(".local_experts." in k for k in adapters),
        # the reference (adapters off) scores as the base, not as the adapted policy
        "reference_vs_policy_max_diff": float((ref_before - with_adapter).abs().max()),
        "reference_after_step_max_diff": float((reference.logprobs([batch])[0] - ref_before).abs().max()),
    }
