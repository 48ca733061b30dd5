"""Qwen3.5 (dense)'s Hugging Face config, read into the Megatron-Core config its language model needs.

Qwen3.5 is Qwen3-VL's vision tower (without DeepStack) in front of a hybrid language model whose
layers are of two kinds, as `layer_types` lists them (released: three linear, then one full):
- "linear_attention": a gated DeltaNet (Megatron's `GatedDeltaNet`): q, k, v through a
  depthwise causal conv (kernel `linear_conv_kernel_dim`) and SiLU, q and k L2-normalised, a
  recurrent state per value head updated by the gated delta rule (decay from `A_log`, `dt_bias`),
  the output RMS-normed per head and gated by SiLU(z). Grouped: `linear_num_value_heads` value
  heads share `linear_num_key_heads` key heads;
- "full_attention": Qwen3 attention (per-head q/k RMSNorm, no bias) whose output is gated by
  sigmoid of a second per-head query projection (Megatron's `attention_output_gate`), with
  interleaved M-RoPE on only the first `partial_rotary_factor` of each head.
Every RMSNorm but the DeltaNet's gated one scales by (1 + weight) ("zero-centred": the weights
start at 0). Every layer has a dense SwiGLU MLP.

Settings this implementation does not compute are refused by name (`ValueError`).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from models.qwen3vl.config import Qwen3VLSpec
from models.qwen3vl.config import check_layout as check_qwen3vl_layout

LAYER_TYPES = ("linear_attention", "full_attention")


@dataclass(frozen=True)
class Qwen35Spec(Qwen3VLSpec):
    """Qwen3VLSpec's numbers (no DeepStack) plus the hybrid layers'. `mrope_section` sums to
    rotary_dim / 2."""

    layer_types: tuple[str, ...] = ()
    partial_rotary_factor: float = 1.0
    linear_conv_kernel_dim: int = 4
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    model_type: str = "qwen3_5"

    @property
    def rotary_dim(self) -> int:
        """The leading part of each attention head that the rotary embedding turns."""
        return int(self.head_dim * self.partial_rotary_factor)

    # every full-attention layer's output is gated by sigmoid of a second query projection
    # (checked in from_hf_config); the plan's activations read it
    attention_output_gate = True

    @property
    def linear_layers(self) -> tuple[bool, ...]:
        """Per language layer: whether it is a gated DeltaNet (else gated full attention)."""
        return tuple(t == "linear_attention" for t in self.layer_types)

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> "Qwen35Spec":
        return cls.from_hf_config(json.loads((Path(path) / "config.json").read_text()), str(path))

    @classmethod
    def from_hf_config(cls, cfg: dict, where: str = "config") -> "Qwen35Spec":
        model_type = cfg.get("model_type")
        if model_type != "qwen3_5":
            hint = " (the MoE variant is models/qwen35_moe)" if model_type == "qwen3_5_moe" else ""
            raise ValueError(f"{where}: model_type is {model_type!r}; this loader reads qwen3_5{hint}")
        text = cfg["text_config"]
        fields = cls._hybrid_fields(text, where)
        # Qwen3-VL's reader checks and reads the rest. It knows no partial rotary: it sees the
        # rope parameters without the factor and the rotary part of a head as its head_dim (so
        # its check that mrope_section sums to head_dim / 2 applies to that part), and no
        # DeepStack (Qwen3.5's vision config has no deepstack_visual_indexes)
        # transformers' Qwen3.5 defaults where a config leaves a field out: head_dim 256, partial
        # rotary 0.25, M-RoPE sections [11, 11, 10]; and its text rotary always interleaves the
        # sections, whatever mrope_interleaved says
        rope = dict(text.get("rope_parameters") or text.get("rope_scaling") or {})
        factor = float(rope.pop("partial_rotary_factor", text.get("partial_rotary_factor", 0.25)))
        rope.setdefault("mrope_section", [11, 11, 10])
        rope["mrope_interleaved"] = True
        head_dim = text.get("head_dim") or 256
        rotary_dim = int(head_dim * factor)
        if not 0 < factor <= 1 or rotary_dim % 2:
            raise ValueError(f"{where}: partial_rotary_factor {factor} must give an even rotary part of "
                             f"head_dim {head_dim} (got {head_dim * factor})")
        as_qwen3vl = {**cfg, "model_type": "qwen3_vl",
                      "text_config": {**text, "rope_parameters": rope, "head_dim": rotary_dim},
                      "vision_config": {**cfg["vision_config"], "deepstack_visual_indexes": []}}
        dense = Qwen3VLSpec.from_hf_config(as_qwen3vl, where)
        base = {f.name: getattr(dense, f.name) for f in dataclasses.fields(Qwen3VLSpec) if f.name != "model_type"}
        return cls(**{**base, "head_dim": head_dim}, partial_rotary_factor=factor, **fields)

    @staticmethod
    def _hybrid_fields(text: dict, where: str) -> dict:
        """The layer pattern and the DeltaNet's sizes, checked."""
        layers = text["num_hidden_layers"]
        types = text.get("layer_types")
        if types is None:  # transformers' default: full attention every `full_attention_interval` layers
            interval = text.get("full_attention_interval", 4)
            types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(layers)]
        types = tuple(types)
        if len(types) != layers or set(types) - set(LAYER_TYPES):
            raise ValueError(f"{where}: layer_types {list(types)} must name one of {list(LAYER_TYPES)} for each of "
                             f"the {layers} layers")
        if not text.get("attn_output_gate", True):
            raise ValueError(f"{where}: attn_output_gate false is not implemented (Qwen3.5 gates its attention)")
        key_heads, value_heads = text.get("linear_num_key_heads", 16), text.get("linear_num_value_heads", 32)
        if value_heads % key_heads:
            raise ValueError(f"{where}: linear_num_value_heads {value_heads} must be a multiple of "
                             f"linear_num_key_heads {key_heads}")
        return dict(layer_types=types, linear_conv_kernel_dim=text.get("linear_conv_kernel_dim", 4),
                    linear_key_head_dim=text.get("linear_key_head_dim", 128),
                    linear_value_head_dim=text.get("linear_value_head_dim", 128),
                    linear_num_key_heads=key_heads, linear_num_value_heads=value_heads)


def check_layout(spec: Qwen35Spec, tp: int, pp: int, prefix: str = "", layers=()) -> None:
    """Qwen3-VL's tensor/pipeline checks, and whether the DeltaNet's key and value heads split
    over `tp` (each rank runs whole heads)."""
    check_qwen3vl_layout(spec, tp, pp, prefix, *((tuple(layers),) if layers else ()))
    if any(spec.linear_layers) and (spec.linear_num_key_heads % tp or spec.linear_num_value_heads % tp):
        raise ValueError(f"{prefix}tensor_parallel={tp}: the DeltaNet's key heads ({spec.linear_num_key_heads}) "
                         f"and value heads ({spec.linear_num_value_heads}) must divide by it")


def check_context_parallel(spec: Qwen35Spec, tp: int, cp: int, prefix: str = "") -> None:
    """Under context parallelism each rank runs whole DeltaNet heads of its TP share over the
    whole sequence (models/qwen35/model.py): key and value heads must divide by TP x CP."""
    if any(spec.linear_layers) and (spec.linear_num_key_heads % (tp * cp) or spec.linear_num_value_heads % (tp * cp)):
        raise ValueError(f"{prefix}context_parallel={cp}: the DeltaNet's key heads ({spec.linear_num_key_heads}) and "
                         f"value heads ({spec.linear_num_value_heads}) must divide by tensor_parallel x "
                         f"context_parallel = {tp} x {cp}")


def language_config(spec: Qwen35Spec, dtype: torch.dtype = torch.float32, tp: int = 1, recompute: str = "none",
                    pp: int = 1, layers=()):
    """Qwen3-VL's language config (models/megatron_config.py) with gated attention and the
    DeltaNet layers where `layer_types` puts them."""
    from models.megatron_config import language_transformer_config

    check_layout(spec, tp, pp, "", layers)
    return language_transformer_config(
        spec, dtype, tp, recompute, pp, layers, add_qkv_bias=False, qk_layernorm=True,
        attention_output_gate=True,
        # Megatron's pattern: 1 = linear attention, 0 = softmax attention
        experimental_attention_variant="gated_delta_net",
        linear_attention_freq=[int(linear) for linear in spec.linear_layers],
        linear_conv_kernel_dim=spec.linear_conv_kernel_dim,
        linear_key_head_dim=spec.linear_key_head_dim, linear_value_head_dim=spec.linear_value_head_dim,
        linear_num_key_heads=spec.linear_num_key_heads, linear_num_value_heads=spec.linear_num_value_heads)
