"""Hugging Face Qwen3.5 <-> Megatron weights, at any tensor-parallel size.

Embeddings, final norm, head and the vision tower convert as Qwen3-VL's (models/qwen3vl/convert.py,
run with no language layers). The language layers, per layer i (HF under
`model.language_model.layers.i.`, Megatron under `language.decoder.layers.i.`):

    both kinds     input_layernorm / post_attention_layernorm  -> input_layernorm / pre_mlp_layernorm
                   mlp.gate_proj, up_proj / down_proj           -> mlp.linear_fc1 [gate; up] / linear_fc2
    full attention self_attn.q_proj [heads x (q, gate) x d]     -> self_attention.linear_qkv, per query group
                   self_attn.k_proj, v_proj                        [q heads, gate heads, k, v]
                   self_attn.q_norm, k_norm, o_proj             -> q_layernorm, k_layernorm, linear_proj
    linear (DeltaNet) linear_attn.in_proj_qkv, _z, _b, _a       -> self_attention.in_proj [qkv; z; b; a]
                   linear_attn.conv1d.weight, dt_bias, A_log    -> conv1d.weight, dt_bias, A_log
                   linear_attn.norm, out_proj                   -> out_norm, out_proj

Norm weights are copied as stored (Megatron's norms here scale by 1 + weight, as HF's), so the
round trip is exact. Under tensor parallelism a rank's DeltaNet in_proj rows are its share of
each of q, k, v, z, b, a in that order (Megatron splits its local rows that way), and its conv
channels its share of q, k, v: `shard`/`gather` cut and join those sections; dt_bias and A_log
split by value head. Everything else shards as Qwen2-VL's.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterator
from pathlib import Path

import torch

from models.convert import copy_into, pipeline_buckets
from models.convert import stage_buckets as _stage_buckets
from models.qwen2vl.convert import gather as _gather
from models.qwen2vl.convert import hf_prefixes, load_hf_state
from models.qwen2vl.convert import shard as _shard
from models.qwen35.config import Qwen35Spec
from models.qwen3vl import convert as qwen3vl

_COMMON = {
    "input_layernorm.weight": "input_layernorm.weight",
    "post_attention_layernorm.weight": "pre_mlp_layernorm.weight",
    "mlp.down_proj.weight": "mlp.linear_fc2.weight",
}
_FULL = {
    "self_attn.q_norm.weight": "self_attention.q_layernorm.weight",
    "self_attn.k_norm.weight": "self_attention.k_layernorm.weight",
    "self_attn.o_proj.weight": "self_attention.linear_proj.weight",
}
_LINEAR = {
    "linear_attn.conv1d.weight": "self_attention.conv1d.weight",
    "linear_attn.dt_bias": "self_attention.dt_bias",
    "linear_attn.A_log": "self_attention.A_log",
    "linear_attn.norm.weight": "self_attention.out_norm.weight",
    "linear_attn.out_proj.weight": "self_attention.out_proj.weight",
}
_IN_PROJ = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")
_SECTIONED = re.compile(r"^language\.decoder\.layers\.\d+\.self_attention\.(in_proj|conv1d)\.weight$")


def _without_layers(spec: Qwen35Spec) -> Qwen35Spec:
    """The spec Qwen3-VL's converter is run with: everything but the language layers."""
    return dataclasses.replace(spec, num_layers=0)


def _gated_qkv_to_megatron(q_gate: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int, groups: int):
    """HF's q_proj (per head: its query rows, then its gate rows), k_proj, v_proj -> Megatron's
    gated linear_qkv: per query group [its query heads, their gates, k, v]."""
    d, cols = k.shape[0] // groups, k.shape[1:]
    per_head = q_gate.reshape(groups, heads // groups, 2, d, *cols)
    q, gate = per_head[:, :, 0].reshape(groups, -1, *cols), per_head[:, :, 1].reshape(groups, -1, *cols)
    return torch.cat([q, gate, k.reshape(groups, d, *cols), v.reshape(groups, d, *cols)], 1).reshape(-1, *cols)


def _gated_qkv_from_megatron(qkv: torch.Tensor, heads: int, groups: int):
    per, cols = heads // groups, qkv.shape[1:]
    d = qkv.shape[0] // (groups * (2 * per + 2))
    x = qkv.reshape(groups, 2 * per + 2, d, *cols)
    q_gate = torch.stack([x[:, :per], x[:, per:2 * per]], 2).reshape(heads * 2 * d, *cols)
    return q_gate, x[:, 2 * per].reshape(groups * d, *cols), x[:, 2 * per + 1].reshape(groups * d, *cols)


def hf_to_megatron(hf: dict[str, torch.Tensor], spec: Qwen35Spec) -> dict[str, torch.Tensor]:
    """HF tensors -> full Megatron tensors named as in `Qwen35Model.state_dict()` (the DeltaNet's
    in_proj and conv1d in their one-rank layout)."""
    t, _ = hf_prefixes(hf)
    out = qwen3vl.hf_to_megatron(hf, _without_layers(spec))
    for i, linear in enumerate(spec.linear_layers):
        src, dst = f"{t}layers.{i}.", f"language.decoder.layers.{i}."
        for a, b in {**_COMMON, **(_LINEAR if linear else _FULL)}.items():
            out[dst + b] = hf[src + a]
        out[dst + "mlp.linear_fc1.weight"] = torch.cat([hf[src + "mlp.gate_proj.weight"], hf[src + "mlp.up_proj.weight"]])
        if linear:
            out[dst + "self_attention.in_proj.weight"] = torch.cat([hf[f"{src}linear_attn.{p}.weight"] for p in _IN_PROJ])
        else:
            att = src + "self_attn."
            out[dst + "self_attention.linear_qkv.weight"] = _gated_qkv_to_megatron(
                hf[att + "q_proj.weight"], hf[att + "k_proj.weight"], hf[att + "v_proj.weight"],
                spec.num_heads, spec.num_kv_heads)
    return out


def megatron_to_hf(full: dict[str, torch.Tensor], spec: Qwen35Spec,
                   prefixes: tuple[str, str] = ("model.language_model.", "model.visual.")) -> dict[str, torch.Tensor]:
    """Full Megatron tensors -> HF names (the layout transformers 5 saves). `full` may hold only
    some sync units (models/convert.py's sync_unit), each complete: those are converted."""
    out = qwen3vl.megatron_to_hf(full, _without_layers(spec), prefixes)
    for i, linear in enumerate(spec.linear_layers):
        src, dst = f"language.decoder.layers.{i}.", f"{prefixes[0]}layers.{i}."
        if src + "mlp.linear_fc1.weight" not in full:
            continue
        for a, b in {**_COMMON, **(_LINEAR if linear else _FULL)}.items():
            out[dst + a] = full[src + b]
        out[dst + "mlp.gate_proj.weight"], out[dst + "mlp.up_proj.weight"] = full[src + "mlp.linear_fc1.weight"].chunk(2)
        if linear:
            q, k, v, z, b, a = _in_proj_sections(spec)
            parts = full[src + "self_attention.in_proj.weight"].split([q + k + v, z, b, a])
            out.update({f"{dst}linear_attn.{p}.weight": part for p, part in zip(_IN_PROJ, parts)})
        else:
            q_gate, k, v = _gated_qkv_from_megatron(full[src + "self_attention.linear_qkv.weight"], spec.num_heads,
                                                    spec.num_kv_heads)
            out[dst + "self_attn.q_proj.weight"], out[dst + "self_attn.k_proj.weight"] = q_gate, k
            out[dst + "self_attn.v_proj.weight"] = v
    return out


def _in_proj_sections(spec: Qwen35Spec) -> list[int]:
    """Rows of the DeltaNet's in_proj: [q, k, v, z, b, a] (in_proj_qkv is [q, k, v])."""
    qk = spec.linear_key_head_dim * spec.linear_num_key_heads
    v = spec.linear_value_head_dim * spec.linear_num_value_heads
    heads = spec.linear_num_value_heads
    return [qk, qk, v, v, heads, heads]


def _sections(name: str, spec: Qwen35Spec) -> list[int] | None:
    """The row sections each TP rank holds a share of, in order, for the DeltaNet's in_proj
    ([q, k, v, z, b, a]) and conv1d ([q, k, v]); None for any other parameter."""
    match = _SECTIONED.match(name)
    if match is None:
        return None
    sections = _in_proj_sections(spec)
    return sections if match.group(1) == "in_proj" else sections[:3]


def shard(name: str, full: torch.Tensor, param: torch.Tensor, rank: int, size: int, spec: Qwen35Spec) -> torch.Tensor:
    """This TP rank's part of a full tensor: its share of each section of the DeltaNet's fused
    weights, its value heads of dt_bias and A_log, else as Qwen2-VL shards."""
    if size == 1 or not getattr(param, "tensor_model_parallel", False):
        return full
    sections = _sections(name, spec)
    if sections is not None:
        return torch.cat([part.chunk(size)[rank] for part in full.split(sections)])
    if name.endswith(("self_attention.dt_bias", "self_attention.A_log")):  # Megatron sets no partition_dim
        return full.chunk(size)[rank]
    return _shard(name, full, param, rank, size)


def gather(name: str, param: torch.Tensor, group, spec: Qwen35Spec) -> torch.Tensor:
    """The full tensor from every TP rank's shard of `param` (collective over `group`)."""
    import torch.distributed as dist

    size = dist.get_world_size(group) if dist.is_initialized() else 1
    sections = _sections(name, spec)
    if size == 1 or (sections is None and not name.endswith(("self_attention.dt_bias", "self_attention.A_log"))):
        return _gather(name, param, group)
    parts = [torch.empty_like(param) for _ in range(size)]
    dist.all_gather(parts, param.detach().contiguous(), group=group)
    if sections is None:
        return torch.cat(parts)
    local = [s // size for s in sections]
    pieces = [p.split(local) for p in parts]  # per rank, its share of each section
    return torch.cat([piece[s] for s in range(len(sections)) for piece in pieces])


def load_hf_into(model: torch.nn.Module, hf_dir: str | Path, tp_rank: int = 0, tp_size: int = 1) -> None:
    """Copy an HF checkpoint into a (possibly TP-sharded, possibly one pipeline stage of a)
    Megatron Qwen35Model."""
    spec = model.spec
    copy_into(model, hf_to_megatron(load_hf_state(hf_dir), spec),
              lambda name, full, p, rank, size: shard(name, full, p, rank, size, spec), tp_rank, tp_size)


def stage_buckets(model: torch.nn.Module, tp_group=None, dtype: torch.dtype | None = None,
                  bucket_bytes: int | None = None) -> Iterator[dict[str, torch.Tensor]]:
    """This pipeline stage's HF-named full tensors (gathered over TP) in buckets of whole sync
    units (models/convert.py's stage_buckets). A collective over TP."""
    spec = model.spec
    return _stage_buckets(model, tp_group, dtype, bucket_bytes,
                          lambda params: {name: gather(name, p, tp_group, spec) for name, p in params},
                          lambda full: megatron_to_hf(full, spec))


def export_hf_buckets(model: torch.nn.Module, tp_group=None, dtype: torch.dtype | None = None,
                      bucket_bytes: int | None = None) -> Iterator[dict[str, torch.Tensor]]:
    """The whole model's HF-named full tensors in buckets; under pipeline parallelism the stages
    take turns (models/convert.py's `pipeline_buckets`). A collective over TP and PP."""
    return pipeline_buckets(model, stage_buckets(model, tp_group, dtype, bucket_bytes))


def lora_to_hf(spec: Qwen35Spec, pairs: dict[str, tuple[torch.Tensor, torch.Tensor]],
               text_prefix: str = "model.language_model.") -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """LoRA pairs of the language model's Megatron linears (whole, whole-model names; see
    models/lora.py) -> {HF module path: (A, B)}. The full-attention layers' gated linear_qkv B
    splits as its weight does (q_proj: each head's query rows, then its gate rows); the rest
    (o_proj, the MLPs, the vision tower's) as Qwen2-VL's. A gated DeltaNet layer's in_proj B splits
    into in_proj_qkv, _z, _b and _a (one A shared), its out_proj as it is."""
    from models.qwen2vl.convert import lora_to_hf as plain

    out = {}
    for name, (a, b) in pairs.items():
        layer = f"{text_prefix}layers.{name.split('.')[3]}." if name.startswith("language.") else None
        if layer and name.endswith(".self_attention.linear_qkv"):
            q_gate, k, v = _gated_qkv_from_megatron(b, spec.num_heads, spec.num_kv_heads)
            out |= {layer + "self_attn.q_proj": (a, q_gate), layer + "self_attn.k_proj": (a, k),
                    layer + "self_attn.v_proj": (a, v)}
        elif layer and name.endswith(".self_attention.in_proj"):  # [q, k, v, z, b, a]: in_proj_qkv is q, k, v
            q, k, v, z, beta, alpha = _in_proj_sections(spec)
            parts = b.split([q + k + v, z, beta, alpha])
            out |= {f"{layer}linear_attn.{p}": (a, part) for p, part in zip(_IN_PROJ, parts)}
        elif layer and name.endswith(".self_attention.out_proj"):
            out[f"{layer}linear_attn.out_proj"] = (a, b)
        else:
            out |= plain(spec, {name: (a, b)}, text_prefix)
    return out
