"""Qwen3.5-MoE's Hugging Face config, read into the Megatron-Core config its language model needs.

Everything but the language model's MLP is Qwen3.5's (models/qwen35/config.py: vision tower, the
gated DeltaNet and gated attention layers by `layer_types`, partial interleaved M-RoPE). Every
language layer's MLP (transformers' Qwen3_5MoeSparseMoeBlock) is
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
(models/qwen3vl_moe/config.py: `read_experts`, `moe_settings`); expert parallelism (`ep`)
spreads them over `ep` ranks of each data-parallel group. Settings this implementation does not
compute are refused by name.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from models.qwen35.config import Qwen35Spec
from models.qwen35.config import check_layout as check_dense_layout
from models.qwen35.config import language_config as dense_language_config
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


@dataclass(frozen=True)
class Qwen35MoeSpec(Qwen35Spec):
    """Qwen35Spec's numbers plus Experts' (models/qwen35/config.py: the hybrid layers, partial
    rotary, the vision tower). `intermediate_size` is the experts' width (no layer is dense)."""

    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    router_aux_loss_coef: float = 0.0
    router_z_loss_coef: float = 0.0
    model_type: str = "qwen3_5_moe"

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> "Qwen35MoeSpec":
        return cls.from_hf_config(json.loads((Path(path) / "config.json").read_text()), str(path))

    @classmethod
    def from_hf_config(cls, cfg: dict, where: str = "config") -> "Qwen35MoeSpec":
        model_type = cfg.get("model_type")
        if model_type != "qwen3_5_moe":
            raise ValueError(f"{where}: model_type is {model_type!r}; this loader reads qwen3_5_moe")
        text = cfg["text_config"]
        experts = Experts.from_text_config(text, where)
        # the dense reader checks and reads everything else (Qwen3.5-MoE has no dense MLP width)
        dense_text = {**text, "intermediate_size": text.get("intermediate_size") or experts.moe_intermediate_size}
        dense = Qwen35Spec.from_hf_config({**cfg, "model_type": "qwen3_5", "text_config": dense_text}, where)
        base = {f.name: getattr(dense, f.name) for f in dataclasses.fields(Qwen35Spec) if f.name != "model_type"}
        return cls(**base, **fields(experts))


def check_layout(spec: Qwen35MoeSpec, tp: int, pp: int, prefix: str = "", layers=(), ep: int = 1) -> None:
    """Qwen3.5's tensor/pipeline checks, and whether the experts split evenly over `ep`
    expert-parallel ranks. EP beside TP runs as Qwen3-VL-MoE's (models/runtime.py's uneven
    gather on gloo); the tiny model's logits at EP 2 x TP 2 equal transformers' as at TP 2."""
    check_dense_layout(spec, tp, pp, prefix, layers)
    if ep < 1 or spec.num_experts % ep:
        raise ValueError(f"{prefix}expert_parallel={ep}: the model's {spec.num_experts} experts must divide by it")


def language_config(spec: Qwen35MoeSpec, dtype: torch.dtype = torch.float32, tp: int = 1, recompute: str = "none",
                    pp: int = 1, layers=(), ep: int = 1):
    """Qwen3.5's language config (the hybrid layers) with every MLP a mixture of experts and a
    gated shared expert."""
    check_layout(spec, tp, pp, "", layers, ep)
    return dataclasses.replace(dense_language_config(spec, dtype, tp, recompute, pp, layers),
                               **moe_settings(spec, tp, pp, ep))
