"""Qwen3.5-MoE on Megatron-Core: models/qwen35/model.py's Qwen35Model (vision tower, the hybrid
decoder of gated DeltaNet and gated attention layers, partial M-RoPE, packed rows) with Megatron's
MoE layer as every language layer's MLP, as Qwen3-VL-MoE has it (models/qwen3vl_moe/model.py:
expert parallelism, the routers' padding mask, the token split under TP), plus the gated shared
expert (`mlp.shared_experts`: models/qwen35_moe/config.py)."""

from __future__ import annotations

import torch

from models.qwen35.model import Qwen35Model
from models.qwen35_moe.config import Qwen35MoeSpec, language_config
from models.qwen3vl_moe.model import Qwen3VLMoeModel


class Qwen35MoeModel(Qwen3VLMoeModel, Qwen35Model):
    """Qwen3VLMoeModel's expert handling (EP offsets, padding hooks, token split) over
    Qwen35Model's layers (method order: this class, Qwen3VLMoeModel, Qwen35Model, Qwen3VLModel).
    `ep` is the expert-parallel size (models.comm.init_parallel(expert_parallel=ep) first)."""

    spec: Qwen35MoeSpec

    moe_language_config = staticmethod(language_config)  # Qwen3.5's layers, experts, shared expert

    def _decoder_spec(self):
        """Qwen3.5's per-layer specs with the MLP swapped for Megatron's MoE layer (routed
        experts, router, shared expert: the spec its GPT layer uses for MoE)."""
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

        block = Qwen35Model._decoder_spec(self)
        moe = get_gpt_layer_local_spec(num_experts=self.spec.num_experts, moe_grouped_gemm=False,
                                       normalization="RMSNorm", qk_layernorm=True).submodules.mlp
        for layer in block.layer_specs:
            layer.submodules.mlp = moe
        return block
