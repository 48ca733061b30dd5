"""Qwen3-VL (dense)'s Hugging Face config, read into the two Megatron-Core configs the model needs.

What differs from Qwen2.5-VL (models/qwen2vl/config.py):
- text: Qwen3 blocks, i.e. an RMSNorm over each query and key head before the rotary embedding
  (Megatron's `qk_layernorm`) and no QKV bias; M-RoPE with the three axes' frequencies
  interleaved (t, h, w, t, h, w, ...) rather than in three contiguous sections;
- DeepStack: the outputs of the vision blocks in `deepstack_visual_indexes` go through their own
  mergers and are added to the hidden states of the visual tokens after each of the first
  len(indexes) language layers;
- vision: patch 16, a learned position table bilinearly resampled to each grid, LayerNorm and a
  GELU(tanh) MLP, attention within each frame (no windows).

Settings this implementation does not compute are refused by name (`ValueError`) rather than
silently run differently from transformers.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

from models.megatron_config import common as _common
from models.megatron_config import language_transformer_config


@dataclass(frozen=True)
class Qwen3VLSpec:
    """The architecture numbers of one Qwen3-VL checkpoint (from its config.json). Field names
    follow Qwen2VLSpec where the meaning is the same, so shared code reads either."""

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
    vision_intermediate_size: int
    vision_rope_theta: float
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    in_channels: int
    num_position_embeddings: int
    deepstack_visual_indexes: tuple[int, ...]
    model_type: str = "qwen3_vl"

    # Qwen2.5-VL's switches, read by code shared with models/qwen2vl: neither applies here.
    is_qwen25 = False

    # What the memory plan (yatt_mm/plan) counts of the vision tower (see models/family.py):
    # a plain (not gated) MLP, LayerNorm, frames run as a batch (no mask).
    @property
    def vision_ffn(self) -> int:
        return self.vision_intermediate_size

    vision_gated = False
    vision_rms_norm = False
    vision_windowed = False
    # ... and of the rest (yatt_mm/plan/params.py, activations.py): Qwen3 blocks' q/k norms
    # without QKV bias, a biased patch embedding, the vision MLP's one-op GELU (it keeps only its
    # input); num_position_embeddings and num_deepstack are read as they are
    qkv_bias = False
    qk_norm = True
    vision_patch_bias = True
    vision_act = "gelu_pytorch_tanh"

    @property
    def num_deepstack(self) -> int:
        """How many language layers (the first ones) receive DeepStack features."""
        return len(self.deepstack_visual_indexes)

    @property
    def position_grid_side(self) -> int:
        return math.isqrt(self.num_position_embeddings)

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> "Qwen3VLSpec":
        return cls.from_hf_config(json.loads((Path(path) / "config.json").read_text()), str(path))

    @classmethod
    def from_hf_config(cls, cfg: dict, where: str = "config") -> "Qwen3VLSpec":
        model_type = cfg.get("model_type")
        if model_type != "qwen3_vl":
            hint = " (the MoE variant is not implemented)" if model_type == "qwen3_vl_moe" else ""
            raise ValueError(f"{where}: model_type is {model_type!r}; this loader reads qwen3_vl{hint}")
        text, vision = cfg["text_config"], cfg["vision_config"]
        # transformers 5 writes rope_parameters; the released checkpoints (4.x) rope_scaling + rope_theta
        rope = dict(text.get("rope_parameters") or text.get("rope_scaling") or {})
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise ValueError(f"{where}: text rope_type {rope_type!r} is not implemented (only 'default')")
        if "mrope_section" not in rope:
            raise ValueError(f"{where}: the text rope parameters have no mrope_section")
        if not rope.get("mrope_interleaved", False):
            raise ValueError(f"{where}: mrope_interleaved is false; only Qwen3-VL's interleaved M-RoPE is implemented")
        if rope.get("partial_rotary_factor", 1.0) != 1.0:
            raise ValueError(f"{where}: partial_rotary_factor {rope['partial_rotary_factor']} is not implemented")
        if text.get("attention_bias", False):
            raise ValueError(f"{where}: attention_bias true is not implemented (Qwen3 blocks have no QKV bias)")
        if text.get("hidden_act", "silu") != "silu":
            raise ValueError(f"{where}: text hidden_act {text['hidden_act']!r} is not implemented (only silu)")
        if vision.get("hidden_act", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
            raise ValueError(f"{where}: vision hidden_act {vision['hidden_act']!r} is not implemented "
                             "(only gelu_pytorch_tanh)")
        vrope = vision.get("rope_parameters") or {}
        if vrope.get("rope_type", "axial") != "axial":
            raise ValueError(f"{where}: vision rope_type {vrope['rope_type']!r} is not implemented (only 'axial')")
        heads = text["num_attention_heads"]
        head_dim = text.get("head_dim") or text["hidden_size"] // heads
        section = tuple(rope["mrope_section"])
        if len(section) != 3 or sum(section) != head_dim // 2:
            raise ValueError(f"{where}: mrope_section {list(section)} must be 3 numbers summing to head_dim/2 "
                             f"({head_dim // 2})")
        positions = vision.get("num_position_embeddings", 2304)
        if math.isqrt(positions) ** 2 != positions:
            raise ValueError(f"{where}: num_position_embeddings {positions} is not a square grid")
        depth = vision["depth"]
        deepstack = tuple(vision.get("deepstack_visual_indexes", (8, 16, 24)))
        if list(deepstack) != sorted(set(deepstack)) or any(not 0 <= i < depth for i in deepstack):
            raise ValueError(f"{where}: deepstack_visual_indexes {list(deepstack)} must be increasing vision "
                             f"block indexes below depth {depth}")
        if len(deepstack) > text["num_hidden_layers"]:
            raise ValueError(f"{where}: {len(deepstack)} DeepStack features for {text['num_hidden_layers']} layers")
        return cls(
            vocab_size=text["vocab_size"],
            hidden_size=text["hidden_size"],
            intermediate_size=text["intermediate_size"],
            num_layers=text["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=text.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            rms_norm_eps=text.get("rms_norm_eps", 1e-6),
            rope_theta=rope.get("rope_theta", text.get("rope_theta", 5e6)),
            mrope_section=section,
            # the top-level flag is what transformers ties by; older configs keep it in text_config
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", text.get("tie_word_embeddings", False))),
            image_token_id=cfg["image_token_id"],
            video_token_id=cfg["video_token_id"],
            vision_start_token_id=cfg["vision_start_token_id"],
            vision_depth=depth,
            vision_embed_dim=vision["hidden_size"],
            vision_heads=vision["num_heads"],
            vision_intermediate_size=vision["intermediate_size"],
            vision_rope_theta=vrope.get("rope_theta", 10000.0),
            patch_size=vision.get("patch_size", 16),
            temporal_patch_size=vision.get("temporal_patch_size", 2),
            spatial_merge_size=vision.get("spatial_merge_size", 2),
            in_channels=vision.get("in_channels", 3),
            num_position_embeddings=positions,
            deepstack_visual_indexes=deepstack,
        )


def check_layout(spec: Qwen3VLSpec, tp: int, pp: int, prefix: str = "", layers=()) -> None:
    """Whether the model splits into `tp` tensor-parallel shards and `pp` pipeline stages (evenly,
    or `layers` language layers per stage). The vision tower runs on the first stage only, so
    every layer that takes DeepStack features must be there too."""
    from models.stages import check_stage_layers, stage_layers

    if spec.vocab_size % tp or spec.num_kv_heads % tp or spec.vision_heads % tp:
        raise ValueError(f"{prefix}tensor_parallel={tp}: the vocabulary ({spec.vocab_size}), KV heads "
                         f"({spec.num_kv_heads}) and vision heads ({spec.vision_heads}) must divide by it")
    check_stage_layers(spec.num_layers, pp, layers, prefix)
    first = stage_layers(spec.num_layers, pp, layers)[0]
    if spec.num_deepstack > first:
        setting = f"{prefix}pipeline_layers={list(layers)}" if layers else f"{prefix}pipeline_parallel={pp}"
        raise ValueError(f"{setting}: the first stage holds {first} layers but "
                         f"{spec.num_deepstack} take DeepStack features from the vision tower (first stage only)")


def language_config(spec: Qwen3VLSpec, dtype: torch.dtype = torch.float32, tp: int = 1, recompute: str = "none",
                    pp: int = 1, layers=()):
    check_layout(spec, tp, pp, layers=layers)
    if recompute == "full" and spec.num_deepstack and pp > 1:
        # DeepStack adds this micro-batch's features after a layer through a forward hook; a
        # full-layer recompute reruns the layer in the backward pass, when the model still holds
        # the features of the last forward. Without a pipeline that is the same micro-batch (its
        # backward follows its forward); with one, later micro-batches' forwards come between.
        raise ValueError("recompute 'full' with pipeline_parallel > 1 is not implemented for Qwen3-VL (DeepStack); "
                         "use 'selective', or full without a pipeline")
    return language_transformer_config(spec, dtype, tp, recompute, pp, layers, add_qkv_bias=False, qk_layernorm=True)


def vision_config(spec: Qwen3VLSpec, dtype: torch.dtype = torch.float32, tp: int = 1, recompute: str = "none"):
    """LayerNorm and a GELU(tanh) MLP, biases on every linear."""
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(
        num_layers=spec.vision_depth,
        hidden_size=spec.vision_embed_dim,
        ffn_hidden_size=spec.vision_intermediate_size,
        num_attention_heads=spec.vision_heads,
        num_query_groups=spec.vision_heads,
        kv_channels=spec.vision_embed_dim // spec.vision_heads,
        normalization="LayerNorm",
        layernorm_epsilon=1e-6,
        gated_linear_unit=False,
        activation_func=partial(F.gelu, approximate="tanh"),
        add_bias_linear=True,
        add_qkv_bias=True,
        **_common(dtype, tp, recompute),  # full: each block checkpointed (models/vision_blocks.py)
    )
