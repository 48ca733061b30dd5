"""Qwen3-VL-MoE's Hugging Face config, read into the Megatron-Core config its language model needs.

Everything but the language model's MLP is Qwen3-VL's (models/qwen3vl/config.py: vision tower,
DeepStack, interleaved M-RoPE, Qwen3 blocks). Every language layer's MLP is a mixture of experts:
- a router (a bias-free linear, hidden -> experts) whose softmax picks the top-k experts of each
  token, their probabilities renormalised to sum to 1 (`norm_topk_prob`; transformers always
  renormalises). Megatron's softmax over the top-k logits is the same function;
- the experts, each a SwiGLU MLP of width `moe_intermediate_size`; no shared expert;
- training only: Megatron's load-balancing loss (Switch Transformer, per layer) weighted by the
  config's `router_aux_loss_coef`, and optionally a router z-loss (`router_z_loss_coef`, not a
  transformers field: 0 or absent = none).

Expert parallelism (`ep`) spreads the experts over `ep` ranks of each data-parallel group
(Megatron's expert-model-parallel groups); the experts' tensor parallelism follows `tp`.
Settings this implementation does not compute are refused by name.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from models.qwen3vl.config import Qwen3VLSpec
from models.qwen3vl.config import check_layout as check_dense_layout
from models.qwen3vl.config import language_config as dense_language_config


@dataclass(frozen=True)
class Qwen3VLMoeSpec(Qwen3VLSpec):
    """Qwen3VLSpec's numbers plus the experts'. `intermediate_size` is the dense MLP width
    transformers keeps in the config (no layer here uses it)."""

    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    router_aux_loss_coef: float = 0.0
    router_z_loss_coef: float = 0.0
    model_type: str = "qwen3_vl_moe"

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> "Qwen3VLMoeSpec":
        return cls.from_hf_config(json.loads((Path(path) / "config.json").read_text()), str(path))

    @classmethod
    def from_hf_config(cls, cfg: dict, where: str = "config") -> "Qwen3VLMoeSpec":
        model_type = cfg.get("model_type")
        if model_type != "qwen3_vl_moe":
            raise ValueError(f"{where}: model_type is {model_type!r}; this loader reads qwen3_vl_moe")
        text = cfg["text_config"]
        experts = read_experts(text, where, "a Qwen3-VL-MoE")
        if text.get("mlp_only_layers") or text.get("decoder_sparse_step", 1) != 1:
            raise ValueError(f"{where}: dense layers between the MoE layers (mlp_only_layers "
                             f"{text.get('mlp_only_layers')}, decoder_sparse_step {text.get('decoder_sparse_step', 1)}) "
                             "are not implemented: every layer must be a MoE layer")
        if text.get("shared_expert_intermediate_size"):
            raise ValueError(f"{where}: shared experts (shared_expert_intermediate_size) are not implemented")
        # the dense reader checks and reads everything else; the MoE config keeps the same fields
        dense_text = {**text, "intermediate_size": text.get("intermediate_size") or text["moe_intermediate_size"]}
        dense = Qwen3VLSpec.from_hf_config({**cfg, "model_type": "qwen3_vl", "text_config": dense_text}, where)
        fields = {f.name: getattr(dense, f.name) for f in dataclasses.fields(Qwen3VLSpec) if f.name != "model_type"}
        return cls(**fields, **experts)


def read_experts(text: dict, where: str, what: str) -> dict:
    """The routed experts' fields of an HF text config (`what` names the model in errors):
    num_experts, num_experts_per_tok, moe_intermediate_size, router_aux_loss_coef,
    router_z_loss_coef. Shared by the MoE families (models/qwen35_moe/config.py)."""
    experts = text.get("num_experts", text.get("num_local_experts"))
    if not experts:
        raise ValueError(f"{where}: text_config has no num_experts ({what} has experts)")
    topk = text.get("num_experts_per_tok", 0)
    if not 1 <= topk <= experts:
        raise ValueError(f"{where}: num_experts_per_tok {topk} must be between 1 and num_experts ({experts})")
    if text.get("norm_topk_prob", True) is not True:
        raise ValueError(f"{where}: norm_topk_prob false is not implemented (transformers renormalises the "
                         "top-k probabilities whatever the flag says, vLLM follows it)")
    return dict(num_experts=int(experts), num_experts_per_tok=int(topk),
                moe_intermediate_size=int(text["moe_intermediate_size"]),
                router_aux_loss_coef=float(text.get("router_aux_loss_coef", 0.001)),
                router_z_loss_coef=float(text.get("router_z_loss_coef") or 0.0))


def check_layout(spec: Qwen3VLMoeSpec, tp: int, pp: int, prefix: str = "", layers=(), ep: int = 1) -> None:
    """Qwen3-VL's tensor/pipeline checks (models/qwen3vl/config.py), and whether the experts
    split evenly over `ep` expert-parallel ranks."""
    check_dense_layout(spec, tp, pp, prefix, *((tuple(layers),) if layers else ()))
    if ep < 1 or spec.num_experts % ep:
        raise ValueError(f"{prefix}expert_parallel={ep}: the model's {spec.num_experts} experts must divide by it")


def language_config(spec: Qwen3VLMoeSpec, dtype: torch.dtype = torch.float32, tp: int = 1, recompute: str = "none",
                    pp: int = 1, layers=(), ep: int = 1):
    """Qwen3-VL's language config with every MLP a mixture of experts."""
    check_layout(spec, tp, pp, "", layers, ep)
    dense = dense_language_config(spec, dtype, tp, recompute, pp, *((tuple(layers),) if layers else ()))
    return dataclasses.replace(dense, **moe_settings(spec, tp, pp, ep))


def moe_settings(spec, tp: int, pp: int, ep: int) -> dict:
    """Megatron's TransformerConfig fields of the routed experts of `spec` (read_experts'
    fields), their router and their dispatcher. Shared by the MoE families."""
    return dict(
        num_moe_experts=spec.num_experts,
        moe_router_topk=spec.num_experts_per_tok,
        moe_ffn_hidden_size=spec.moe_intermediate_size,
        # softmax over the top-k logits = the top-k softmax probabilities renormalised (norm_topk_prob)
        moe_router_score_function="softmax",
        moe_router_pre_softmax=False,
        moe_router_load_balancing_type="aux_loss",
        moe_aux_loss_coeff=spec.router_aux_loss_coef,
        moe_z_loss_coeff=spec.router_z_loss_coef or None,
        # every token reaches its experts (no capacity factor, no dropping), as in transformers
        moe_token_dispatcher_type=token_dispatcher(tp, pp, ep),
        expert_model_parallel_size=ep,
        # grouped GEMM and the fused permute/router kernels need Transformer Engine or CUDA:
        # experts run one after another (SequentialMLP), exactly
        moe_grouped_gemm=False,
        moe_permute_fusion=False,
        moe_router_fusion=False,
    )


def token_dispatcher(tp: int, pp: int, ep: int) -> str:
    """Megatron's MoE token dispatcher for a layout. The all-to-all one moves tokens between
    expert-parallel ranks, and is the one Megatron allows beside pipeline parallelism's variable
    sequence lengths. On one rank there is nothing to move, and there it still splits the
    permuted tokens by expert and concatenates them back in the same order, before and after the
    experts (and again in the backward); the all-gather dispatcher then only permutes. Both
    compute the same function bit for bit (same permutation, same probabilities, same sum)."""
    return "allgather" if tp == pp == ep == 1 else "alltoall"
