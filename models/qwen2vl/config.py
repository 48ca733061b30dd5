"""Qwen2-VL's and Qwen2.5-VL's Hugging Face configs, read into the two Megatron-Core configs the
model needs. The language models are the same; the vision towers differ (see `vision_config`)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

# shared with the other families; imported here under the names they had
from models.megatron_config import common as _common
from models.megatron_config import language_transformer_config


@dataclass(frozen=True)
class Qwen2VLSpec:
    """The architecture numbers of one Qwen2-VL checkpoint (from its config.json)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    mrope_section: tuple[int, int, int]
    tie_word_embeddings: bool
    image_token_id: int
    video_token_id: int
    vision_start_token_id: int
    vision_depth: int
    vision_embed_dim: int
    vision_heads: int
    vision_mlp_ratio: float
    vision_rope_theta: float
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    in_channels: int
    # Qwen2.5-VL only (the defaults describe Qwen2-VL): the vision tower's gated MLP width, its
    # attention windows (in pixels) and the blocks with full (per-frame) attention, and the
    # temporal M-RoPE scale (positions per second of video).
    model_type: str = "qwen2_vl"
    vision_intermediate_size: int = 0
    window_size: int = 0
    fullatt_block_indexes: tuple[int, ...] = ()
    tokens_per_second: float = 1.0

    @property
    def is_qwen25(self) -> bool:
        return self.model_type == "qwen2_5_vl"

    # What the memory plan (yatt_mm/plan) counts of the vision tower (see models/family.py).
    @property
    def vision_ffn(self) -> int:
        """The MLP's width (one half of a gated fc1)."""
        return self.vision_intermediate_size if self.is_qwen25 else int(self.vision_embed_dim * self.vision_mlp_ratio)

    @property
    def vision_gated(self) -> bool:
        return self.is_qwen25

    @property
    def vision_rms_norm(self) -> bool:
        """RMSNorm (a weight) in the blocks and the merger, else LayerNorm (weight and bias)."""
        return self.is_qwen25

    @property
    def vision_windowed(self) -> bool:
        """Qwen2.5-VL attends within windows or frames per block, layer by layer, each unit
        with its own patches' rotary angles (models/qwen2vl/vision.py); Qwen2-VL runs the frames
        as a batch through Megatron's block, one frame's angles for all."""
        return self.is_qwen25

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> "Qwen2VLSpec":
        return cls.from_hf_config(json.loads((Path(path) / "config.json").read_text()), str(path))

    @classmethod
    def from_hf_config(cls, cfg: dict, where: str = "config.json") -> "Qwen2VLSpec":
        model_type = cfg.get("model_type")
        if model_type not in ("qwen2_vl", "qwen2_5_vl"):
            raise ValueError(f"{where}: model_type is {model_type!r}; this loader reads qwen2_vl and qwen2_5_vl")
        text = cfg.get("text_config") or cfg  # transformers 4.x kept text settings at the top
        vision = cfg["vision_config"]
        rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
        heads = text["num_attention_heads"]
        vrope = vision.get("rope_parameters") or {}
        return cls(
            vocab_size=text["vocab_size"],
            hidden_size=text["hidden_size"],
            intermediate_size=text["intermediate_size"],
            num_layers=text["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=text.get("num_key_value_heads") or heads,
            head_dim=text.get("head_dim") or text["hidden_size"] // heads,
            rms_norm_eps=text.get("rms_norm_eps", 1e-6),
            rope_theta=rope.get("rope_theta", text.get("rope_theta", 1e6)),
            mrope_section=tuple(rope["mrope_section"]),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", text.get("tie_word_embeddings", False))),
            image_token_id=cfg["image_token_id"],
            video_token_id=cfg["video_token_id"],
            vision_start_token_id=cfg["vision_start_token_id"],
            vision_depth=vision["depth"],
            # Qwen2.5-VL names the tower's width hidden_size (and the LLM's out_hidden_size)
            vision_embed_dim=vision["embed_dim"] if model_type == "qwen2_vl" else vision["hidden_size"],
            vision_heads=vision["num_heads"],
            vision_mlp_ratio=vision.get("mlp_ratio", 4),
            vision_rope_theta=vrope.get("rope_theta", 10000.0),
            patch_size=vision.get("patch_size", 14),
            temporal_patch_size=vision.get("temporal_patch_size", 2),
            spatial_merge_size=vision.get("spatial_merge_size", 2),
            in_channels=vision.get("in_channels", 3),
            **({} if model_type == "qwen2_vl" else dict(
                model_type=model_type,
                vision_intermediate_size=vision["intermediate_size"],
                window_size=vision.get("window_size", 112),
                fullatt_block_indexes=tuple(vision.get("fullatt_block_indexes", (7, 15, 23, 31))),
                tokens_per_second=vision.get("tokens_per_second", 4),
            )),
        )


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)


def check_layout(spec: Qwen2VLSpec, tp: int, pp: int, prefix: str = "", layers=()) -> None:
    """Whether the model splits into `tp` tensor-parallel shards and `pp` pipeline stages (evenly,
    or `layers` language layers per stage); `prefix` names where the settings live (e.g.
    "policy.trainer.") in the error."""
    from models.stages import check_stage_layers

    if spec.vocab_size % tp or spec.num_kv_heads % tp or spec.vision_heads % tp:
        raise ValueError(f"{prefix}tensor_parallel={tp}: the vocabulary ({spec.vocab_size}), KV heads "
                         f"({spec.num_kv_heads}) and vision heads ({spec.vision_heads}) must divide by it")
    check_stage_layers(spec.num_layers, pp, layers, prefix)


def language_config(spec: Qwen2VLSpec, dtype: torch.dtype = torch.float32, tp: int = 1, recompute: str = "none",
                    pp: int = 1, layers=()):
    check_layout(spec, tp, pp, layers=layers)
    return language_transformer_config(spec, dtype, tp, recompute, pp, layers, add_qkv_bias=True)


def vision_config(spec: Qwen2VLSpec, dtype: torch.dtype = torch.float32, tp: int = 1, recompute: str = "none"):
    """Qwen2-VL: LayerNorm and a quick-GELU MLP; Qwen2.5-VL: RMSNorm and a gated SiLU MLP, both
    with biases on every linear."""
    from megatron.core.transformer import TransformerConfig

    if spec.is_qwen25:
        arch = dict(ffn_hidden_size=spec.vision_intermediate_size, normalization="RMSNorm", gated_linear_unit=True,
                    activation_func=F.silu)
    else:
        arch = dict(ffn_hidden_size=int(spec.vision_embed_dim * spec.vision_mlp_ratio), normalization="LayerNorm",
                    gated_linear_unit=False, activation_func=quick_gelu)
    return TransformerConfig(
        num_layers=spec.vision_depth,
        hidden_size=spec.vision_embed_dim,
        num_attention_heads=spec.vision_heads,
        num_query_groups=spec.vision_heads,
        kv_channels=spec.vision_embed_dim // spec.vision_heads,
        layernorm_epsilon=1e-6,
        add_bias_linear=True,
        add_qkv_bias=True,
        **arch,
        **_common(dtype, tp, recompute),
    )
