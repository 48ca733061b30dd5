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
numbering are Qwen3-VL-MoE's (models/qwen3vl_moe/convert.py).
"""

from __future__ import annotations

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
