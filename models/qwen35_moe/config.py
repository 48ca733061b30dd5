"""Qwen3.5-MoE's mixture-of-experts MLP, read from its Hugging Face text config into Megatron-Core.

Every language layer's MLP (transformers' Qwen3_5MoeSparseMoeBlock) is
- a router (bias-free linear, hidden -> experts) whose softmax picks each token's top-k experts,
  their probabilities renormalised to sum to 1 (transformers always renormalises; the config has
  no `norm_topk_prob`, vLLM reads it when present);
- the routed experts, SwiGLU MLPs of width `moe_intermediate_size`;
- a shared expert every token goes through, a SwiGLU MLP of width
  `shared_expert_intermediate_size`, its output scaled by sigmoid(shared_expert_gate(x)), a
  bias-free hidden -> 1 linear. Megatron-Core 0.16.1's MoE layer has the same piece:
  `moe_shared_expert_intermediate_size` with `moe_shared_expert_gate` (SharedExpertMLP:
  sigmoid(x @ gate_weight.T) * shared MLP(x), added to the routed experts' output).

The routed experts, their router, dispatcher and losses are Qwen3-VL-MoE's
(models/qwen3vl_moe/config.py: `read_experts`, `moe_settings`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from models.qwen3vl_moe.config import moe_settings as routed_settings
from models.qwen3vl_moe.config import read_experts


@dataclass(frozen=True)
class Experts:
    """The MoE numbers of a Qwen3.5-MoE text config (the same field names as the model's spec)."""

    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int
    router_aux_loss_coef: float = 0.001
    router_z_loss_coef: float = 0.0

    @classmethod
    def from_text_config(cls, text: dict, where: str = "config") -> "Experts":
        shared = text.get("shared_expert_intermediate_size")
        if not shared or int(shared) <= 0:
            # transformers would build a shared expert of its default width (512) without it
            raise ValueError(f"{where}: text_config has no shared_expert_intermediate_size (every Qwen3.5-MoE layer "
                             "has a shared expert; its width must be in the config)")
        return cls(**read_experts(text, where, "a Qwen3.5-MoE"), shared_expert_intermediate_size=int(shared))


def fields(experts: Experts) -> dict:
    """`experts` as keyword arguments (for a spec that carries the same fields)."""
    return dataclasses.asdict(experts)


def moe_settings(spec, tp: int, pp: int, ep: int) -> dict:
    """Megatron's TransformerConfig fields of the MoE MLP: Qwen3-VL-MoE's routed experts, plus the
    gated shared expert. `spec` has Experts' fields."""
    return dict(routed_settings(spec, tp, pp, ep),
                moe_shared_expert_intermediate_size=spec.shared_expert_intermediate_size,
                moe_shared_expert_gate=True,  # sigmoid(shared_expert_gate(x)) * shared_expert(x)
                # computed on its own, not overlapped with the dispatcher (that needs a CUDA stream)
                moe_shared_expert_overlap=False)
