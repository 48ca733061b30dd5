"""Hugging Face Qwen3.5-MoE <-> Megatron weights of the MoE MLP, one layer at a time.

transformers 5.19 keeps the routed experts fused in memory ([E, 2I, H] / [E, H, I]) but saves
them, as the released checkpoints hold them, one Linear per expert (its conversion mapping
splits and merges them); vLLM loads those names. Per layer, under `src` (HF, e.g.
"model.language_model.layers.0.mlp.") and `dst` (Megatron, "language.decoder.layers.0.mlp."):

    HF                                  Megatron (full, global expert e)
    gate.weight              [E, H]     router.weight                                [E, H]
    experts.e.gate_proj.weight [I, H]   experts.local_experts.e.linear_fc1.weight    [2I, H] = [gate; up]
    experts.e.up_proj.weight   [I, H]
    experts.e.down_proj.weight [H, I]   experts.local_experts.e.linear_fc2.weight    [H, I]
    shared_expert.gate_proj.weight [S, H]  shared_experts.linear_fc1.weight          [2S, H] = [gate; up]
    shared_expert.up_proj.weight   [S, H]
    shared_expert.down_proj.weight [H, S]  shared_experts.linear_fc2.weight          [H, S]
    shared_expert_gate.weight      [1, H]  shared_experts.gate_weight                [1, H]

Sharding over TP (both fc1's as [gate; up] halves), gathering, and the experts' expert-parallel
numbering are Qwen3-VL-MoE's (models/qwen3vl_moe/convert.py); everything else converts and shards
as Qwen3.5's (models/qwen35/convert.py).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import torch


def moe_to_megatron(hf: dict[str, torch.Tensor], src: str, dst: str, num_experts: int) -> dict[str, torch.Tensor]:
    """One layer's MoE block, HF names under `src` -> full Megatron tensors under `dst`."""
    if src + "experts.gate_up_proj" in hf:
        raise ValueError(f"{src}experts.gate_up_proj: a fused expert layout in a Qwen3.5-MoE checkpoint is not "
                         "implemented (transformers and the released checkpoints save one Linear per expert, "
                         f"{src}experts.0.gate_proj.weight ...)")
    out = {dst + "router.weight": hf[src + "gate.weight"]}
    for e in range(num_experts):
        expert, local = f"{src}experts.{e}.", f"{dst}experts.local_experts.{e}."
        out[local + "linear_fc1.weight"] = torch.cat([hf[expert + "gate_proj.weight"], hf[expert + "up_proj.weight"]])
        out[local + "linear_fc2.weight"] = hf[expert + "down_proj.weight"]
    shared = src + "shared_expert."
    out[dst + "shared_experts.linear_fc1.weight"] = torch.cat([hf[shared + "gate_proj.weight"],
                                                               hf[shared + "up_proj.weight"]])
    out[dst + "shared_experts.linear_fc2.weight"] = hf[shared + "down_proj.weight"]
    out[dst + "shared_experts.gate_weight"] = hf[src + "shared_expert_gate.weight"]
    return out


def moe_to_hf(full: dict[str, torch.Tensor], src: str, dst: str, num_experts: int) -> dict[str, torch.Tensor]:
    """One layer's MoE block, full Megatron tensors under `src` (every expert present, global
    numbers) -> HF names under `dst`, one Linear per expert."""
    out = {dst + "gate.weight": full[src + "router.weight"]}
    for e in range(num_experts):
        expert, local = f"{dst}experts.{e}.", f"{src}experts.local_experts.{e}."
        gate, up = full[local + "linear_fc1.weight"].chunk(2)
        out |= {expert + "gate_proj.weight": gate, expert + "up_proj.weight": up,
                expert + "down_proj.weight": full[local + "linear_fc2.weight"]}
    gate, up = full[src + "shared_experts.linear_fc1.weight"].chunk(2)
    shared = dst + "shared_expert."
    out |= {shared + "gate_proj.weight": gate, shared + "up_proj.weight": up,
            shared + "down_proj.weight": full[src + "shared_experts.linear_fc2.weight"],
            dst + "shared_expert_gate.weight": full[src + "shared_experts.gate_weight"]}
    return out


# The whole model: Qwen3.5's conversion (models/qwen35/convert.py) for everything but the MoE
# MLPs, run with empty dense-MLP tensors in their place, then the MoE blocks above.
_DENSE_MLP = ("mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")


def hf_to_megatron(hf: dict[str, torch.Tensor], spec) -> dict[str, torch.Tensor]:
    """HF tensors -> full Megatron tensors named as in the whole `Qwen35MoeModel.state_dict()`
    (global expert numbers)."""
    from models.qwen2vl.convert import hf_prefixes
    from models.qwen35 import convert as dense

    t, _ = hf_prefixes(hf)
    base = dict(hf)
    for i in range(spec.num_layers):
        base |= {f"{t}layers.{i}.{key}": torch.empty(0) for key in _DENSE_MLP}
    out = dense.hf_to_megatron(base, spec)
    for i in range(spec.num_layers):
        dst = f"language.decoder.layers.{i}.mlp."
        del out[dst + "linear_fc1.weight"], out[dst + "linear_fc2.weight"]
        out |= moe_to_megatron(hf, f"{t}layers.{i}.mlp.", dst, spec.num_experts)
    return out


def megatron_to_hf(full: dict[str, torch.Tensor], spec,
                   prefixes: tuple[str, str] = ("model.language_model.", "model.visual.")) -> dict[str, torch.Tensor]:
    """Full Megatron tensors (every expert of a layer present) -> HF names, one Linear per expert.
    `full` may hold only some sync units, each complete."""
    from models.qwen35 import convert as dense

    base = dict(full)
    layers = [i for i in range(spec.num_layers) if f"language.decoder.layers.{i}.mlp.router.weight" in full]
    for i in layers:  # Qwen3.5's converter halves a dense fc1: give it an empty one to skip
        base |= {f"language.decoder.layers.{i}.mlp.linear_fc1.weight": torch.empty(2, 0),
                 f"language.decoder.layers.{i}.mlp.linear_fc2.weight": torch.empty(0)}
    out = dense.megatron_to_hf(base, spec, prefixes)
    for i in layers:
        dst = f"{prefixes[0]}layers.{i}."
        for key in _DENSE_MLP:
            del out[dst + key]
        out |= moe_to_hf(full, f"language.decoder.layers.{i}.mlp.", dst + "mlp.", spec.num_experts)
    return out


def shard(name: str, full: torch.Tensor, param: torch.Tensor, rank: int, size: int, spec) -> torch.Tensor:
    """This TP rank's part: an expert's or the shared expert's fc1 as [gate; up] halves
    (Qwen3-VL-MoE's), everything else as Qwen3.5 shards it (the DeltaNet's sections)."""
    from models.qwen35 import convert as dense
    from models.qwen3vl_moe import convert as moe

    if moe._EXPERT_FC1.match(name):
        return moe._shard(name, full, param, rank, size)
    return dense.shard(name, full, param, rank, size, spec)


def gather(name: str, param: torch.Tensor, group, spec) -> torch.Tensor:
    """The full tensor over TP (collective over `group`), the inverse of `shard`."""
    from models.qwen35 import convert as dense
    from models.qwen3vl_moe import convert as moe

    if moe._EXPERT_FC1.match(name):
        return moe._gather(name, param, group)
    return dense.gather(name, param, group, spec)


def load_hf_into(model: torch.nn.Module, hf_dir: str | Path, tp_rank: int = 0, tp_size: int = 1) -> None:
    """Copy an HF checkpoint into a (TP-sharded, one pipeline stage of, this EP rank's experts of
    a) Megatron Qwen35MoeModel."""
    from models.convert import copy_into
    from models.qwen2vl.convert import load_hf_state
    from models.stages import global_name

    spec = model.spec
    copy_into(model, hf_to_megatron(load_hf_state(hf_dir), spec),
              lambda name, full, p, rank, size: shard(name, full, p, rank, size, spec), tp_rank, tp_size, global_name)


def stage_buckets(model: torch.nn.Module, tp_group=None, dtype: torch.dtype | None = None,
                  bucket_bytes: int | None = None) -> Iterator[dict[str, torch.Tensor]]:
    """This pipeline stage's HF-named full tensors, gathered over TP and the experts over EP
    (Qwen3-VL-MoE's stage_buckets with this family's gather and names). A collective."""
    from models.qwen3vl_moe.convert import stage_buckets as moe_stage_buckets

    spec = model.spec
    return moe_stage_buckets(model, tp_group, dtype, bucket_bytes,
                             gather=lambda name, p, group: gather(name, p, group, spec),
                             to_hf=lambda full: megatron_to_hf(full, spec))


def export_hf_buckets(model: torch.nn.Module, tp_group=None, dtype: torch.dtype | None = None,
                      bucket_bytes: int | None = None) -> Iterator[dict[str, torch.Tensor]]:
    """The whole model's HF-named full tensors in buckets, every expert in them on every rank;
    under pipeline parallelism the stages take turns. A collective over TP, EP and PP."""
    from models.convert import pipeline_buckets

    return pipeline_buckets(model, stage_buckets(model, tp_group, dtype, bucket_bytes))


_SHARED_LORA = re.compile(r"^language\.decoder\.layers\.(\d+)\.mlp\.shared_experts\.(linear_fc1|linear_fc2)$")


def lora_to_hf(spec, pairs: dict[str, tuple[torch.Tensor, torch.Tensor]],
               text_prefix: str = "model.language_model.") -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """LoRA pairs (whole, whole-model names; models/lora.py) -> {HF module path: (A, B)}: the
    attention, DeltaNet and vision tower as Qwen3.5's, the shared expert's fc1 as gate_proj and
    up_proj (B in halves, one A) and fc2 as down_proj, the routed experts as peft stacks them."""
    from models.qwen35.convert import lora_to_hf as dense_lora_to_hf
    from models.qwen3vl_moe.convert import experts_lora_to_hf

    out, rest = experts_lora_to_hf(pairs, spec.num_experts, text_prefix)
    for name in [n for n in rest if _SHARED_LORA.match(n)]:
        layer, linear = _SHARED_LORA.match(name).groups()
        (a, b), dst = rest.pop(name), f"{text_prefix}layers.{layer}.mlp.shared_expert."
        if linear == "linear_fc1":
            gate, up = b.chunk(2)
            out |= {f"{dst}gate_proj": (a, gate), f"{dst}up_proj": (a, up)}
        else:
            out[f"{dst}down_proj"] = (a, b)
    return dense_lora_to_hf(spec, rest) | out
