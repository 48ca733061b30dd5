"""Hugging Face Qwen3-VL <-> Megatron weights, at any tensor-parallel size.

As models/qwen2vl/convert.py: names and layouts (HF tensors <-> full Megatron tensors:
`hf_to_megatron` / `megatron_to_hf`), then tensor parallelism (full <-> a rank's shard: that
module's `shard` / `gather`, driven by the attributes Megatron puts on its parameters; the
language MLP's [gate; up] is the only fused-by-halves weight, the vision MLP is not gated).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch

from models.convert import copy_into, pipeline_buckets
from models.convert import stage_buckets as _stage_buckets
from models.qwen2vl.convert import _qkv_from_megatron, _qkv_to_megatron, gather, hf_prefixes, load_hf_state, shard
from models.qwen3vl.config import Qwen3VLSpec

_LAYER = {
    "input_layernorm.weight": "input_layernorm.weight",
    "self_attn.q_norm.weight": "self_attention.q_layernorm.weight",
    "self_attn.k_norm.weight": "self_attention.k_layernorm.weight",
    "self_attn.o_proj.weight": "self_attention.linear_proj.weight",
    "post_attention_layernorm.weight": "pre_mlp_layernorm.weight",
    "mlp.down_proj.weight": "mlp.linear_fc2.weight",
}
_VISION_LAYER = {
    "norm1.weight": "input_layernorm.weight",
    "norm1.bias": "input_layernorm.bias",
    "attn.proj.weight": "self_attention.linear_proj.weight",
    "attn.proj.bias": "self_attention.linear_proj.bias",
    "norm2.weight": "pre_mlp_layernorm.weight",
    "norm2.bias": "pre_mlp_layernorm.bias",
    "mlp.linear_fc1.weight": "mlp.linear_fc1.weight",
    "mlp.linear_fc1.bias": "mlp.linear_fc1.bias",
    "mlp.linear_fc2.weight": "mlp.linear_fc2.weight",
    "mlp.linear_fc2.bias": "mlp.linear_fc2.bias",
}
_MERGER = [f"{m}.{k}" for m in ("norm", "linear_fc1", "linear_fc2") for k in ("weight", "bias")]


def _mergers(spec: Qwen3VLSpec) -> list[str]:
    """The mergers' module names (the same in HF, under the visual prefix, and in Megatron under vision.)."""
    return ["merger"] + [f"deepstack_merger_list.{i}" for i in range(spec.num_deepstack)]


def hf_to_megatron(hf: dict[str, torch.Tensor], spec: Qwen3VLSpec) -> dict[str, torch.Tensor]:
    """HF tensors -> full Megatron tensors named as in `Qwen3VLModel.state_dict()`."""
    t, v = hf_prefixes(hf)
    out = {"language.embedding.word_embeddings.weight": hf[f"{t}embed_tokens.weight"],
           "language.decoder.final_layernorm.weight": hf[f"{t}norm.weight"]}
    if not spec.tie_word_embeddings:
        out["language.output_layer.weight"] = hf["lm_head.weight"]
    for i in range(spec.num_layers):
        src, dst = f"{t}layers.{i}.", f"language.decoder.layers.{i}."
        for a, b in _LAYER.items():
            out[dst + b] = hf[src + a]
        att = src + "self_attn."
        out[f"{dst}self_attention.linear_qkv.weight"] = _qkv_to_megatron(
            hf[f"{att}q_proj.weight"], hf[f"{att}k_proj.weight"], hf[f"{att}v_proj.weight"], spec.num_kv_heads)
        out[dst + "mlp.linear_fc1.weight"] = torch.cat([hf[src + "mlp.gate_proj.weight"], hf[src + "mlp.up_proj.weight"]])
    out["vision.patch_embed.weight"] = hf[f"{v}patch_embed.proj.weight"].reshape(spec.vision_embed_dim, -1)
    out["vision.patch_embed.bias"] = hf[f"{v}patch_embed.proj.bias"]
    out["vision.pos_embed.weight"] = hf[f"{v}pos_embed.weight"]
    for i in range(spec.vision_depth):
        src, dst = f"{v}blocks.{i}.", f"vision.decoder.layers.{i}."
        for a, b in _VISION_LAYER.items():
            out[dst + b] = hf[src + a]
        for kind in ("weight", "bias"):
            q, k, vv = hf[f"{src}attn.qkv.{kind}"].chunk(3)
            out[f"{dst}self_attention.linear_qkv.{kind}"] = _qkv_to_megatron(q, k, vv, spec.vision_heads)
    for m in _mergers(spec):
        for key in _MERGER:
            out[f"vision.{m}.{key}"] = hf[f"{v}{m}.{key}"]
    return out


def megatron_to_hf(full: dict[str, torch.Tensor], spec: Qwen3VLSpec,
                   prefixes: tuple[str, str] = ("model.language_model.", "model.visual.")) -> dict[str, torch.Tensor]:
    """Full Megatron tensors -> HF names (by default the layout transformers 5 saves). `full` may
    hold only some sync units (models/convert.py's sync_unit), each complete: those are converted."""
    t, v = prefixes
    out = {}
    for src, dst in (("language.embedding.word_embeddings.weight", f"{t}embed_tokens.weight"),
                     ("language.decoder.final_layernorm.weight", f"{t}norm.weight")):
        if src in full:
            out[dst] = full[src]
    if not spec.tie_word_embeddings and "language.output_layer.weight" in full:
        out["lm_head.weight"] = full["language.output_layer.weight"]
    for i in range(spec.num_layers):
        src, dst = f"language.decoder.layers.{i}.", f"{t}layers.{i}."
        if src + "self_attention.linear_qkv.weight" not in full:
            continue
        for a, b in _LAYER.items():
            out[dst + a] = full[src + b]
        q, k, vv = _qkv_from_megatron(full[f"{src}self_attention.linear_qkv.weight"], spec.num_kv_heads, spec.num_heads)
        out[f"{dst}self_attn.q_proj.weight"], out[f"{dst}self_attn.k_proj.weight"] = q, k
        out[f"{dst}self_attn.v_proj.weight"] = vv
        gate, up = full[src + "mlp.linear_fc1.weight"].chunk(2)
        out[dst + "mlp.gate_proj.weight"], out[dst + "mlp.up_proj.weight"] = gate, up
    if "vision.patch_embed.weight" in full:
        patch = (spec.vision_embed_dim, spec.in_channels, spec.temporal_patch_size, spec.patch_size, spec.patch_size)
        out[f"{v}patch_embed.proj.weight"] = full["vision.patch_embed.weight"].reshape(patch)
        out[f"{v}patch_embed.proj.bias"] = full["vision.patch_embed.bias"]
    if "vision.pos_embed.weight" in full:
        out[f"{v}pos_embed.weight"] = full["vision.pos_embed.weight"]
    for i in range(spec.vision_depth):
        src, dst = f"vision.decoder.layers.{i}.", f"{v}blocks.{i}."
        if src + "self_attention.linear_qkv.weight" not in full:
            continue
        for a, b in _VISION_LAYER.items():
            out[dst + a] = full[src + b]
        for kind in ("weight", "bias"):
            q, k, vv = _qkv_from_megatron(full[f"{src}self_attention.linear_qkv.{kind}"], spec.vision_heads,
                                          spec.vision_heads)
            out[f"{dst}attn.qkv.{kind}"] = torch.cat([q, k, vv])
    for m in _mergers(spec):
        if f"vision.{m}.linear_fc1.weight" in full:
            for key in _MERGER:
                out[f"{v}{m}.{key}"] = full[f"vision.{m}.{key}"]
    return out


def load_hf_into(model: torch.nn.Module, hf_dir: str | Path, tp_rank: int = 0, tp_size: int = 1) -> None:
    """Copy an HF checkpoint into a (possibly TP-sharded, possibly one pipeline stage of a)
    Megatron Qwen3VLModel."""
    copy_into(model, hf_to_megatron(load_hf_state(hf_dir), model.spec), shard, tp_rank, tp_size)


def stage_buckets(model: torch.nn.Module, tp_group=None, dtype: torch.dtype | None = None,
                  bucket_bytes: int | None = None) -> Iterator[dict[str, torch.Tensor]]:
    """This pipeline stage's HF-named full tensors (gathered over TP) in buckets of whole sync
    units of at most `bucket_bytes` (None: one bucket), built one after another. A collective
    over TP: every rank iterates to the end. Without PP this is the whole model."""
    return _stage_buckets(model, tp_group, dtype, bucket_bytes,
                          lambda params: {name: gather(name, p, tp_group) for name, p in params},
                          lambda full: megatron_to_hf(full, model.spec))


def export_hf(model: torch.nn.Module, tp_group=None, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """HF-named full tensors of the model (one pipeline stage's part under PP), gathered over TP."""
    return {k: t for bucket in stage_buckets(model, tp_group, dtype) for k, t in bucket.items()}


def export_hf_buckets(model: torch.nn.Module, tp_group=None, dtype: torch.dtype | None = None,
                      bucket_bytes: int | None = None) -> Iterator[dict[str, torch.Tensor]]:
    """The whole model's HF-named full tensors in buckets (see qwen2vl.convert.export_hf_buckets):
    under pipeline parallelism the stages take turns (models/convert.py's `pipeline_buckets`),
    so every rank sees every bucket. A collective over TP and PP."""
    return pipeline_buckets(model, stage_buckets(model, tp_group, dtype, bucket_bytes))
