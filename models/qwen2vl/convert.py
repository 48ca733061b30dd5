"""Hugging Face Qwen2-VL and Qwen2.5-VL <-> Megatron weights, at any tensor-parallel size.

Two steps each way, so each stays simple: names and layouts (HF tensors <-> full, unsharded
Megatron tensors: `hf_to_megatron` / `megatron_to_hf`), and tensor parallelism (full <-> this
rank's shard: `shard` / `gather`, driven by the attributes Megatron puts on its parameters).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import torch

from models.convert import copy_into, pipeline_buckets, stage_buckets
from models.qwen2vl.config import Qwen2VLSpec

_LAYER = {
    "input_layernorm.weight": "input_layernorm.weight",
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
    "mlp.fc1.weight": "mlp.linear_fc1.weight",
    "mlp.fc1.bias": "mlp.linear_fc1.bias",
    "mlp.fc2.weight": "mlp.linear_fc2.weight",
    "mlp.fc2.bias": "mlp.linear_fc2.bias",
}
# Qwen2.5-VL's vision blocks: RMSNorm (weight only) and a gated MLP whose gate_proj/up_proj
# (weights and biases) become one linear_fc1 [gate; up], as in the language model.
_VISION_LAYER_25 = {
    "norm1.weight": "input_layernorm.weight",
    "attn.proj.weight": "self_attention.linear_proj.weight",
    "attn.proj.bias": "self_attention.linear_proj.bias",
    "norm2.weight": "pre_mlp_layernorm.weight",
    "mlp.down_proj.weight": "mlp.linear_fc2.weight",
    "mlp.down_proj.bias": "mlp.linear_fc2.bias",
}
_MERGER = {"ln_q": "ln_q", "mlp.0": "fc1", "mlp.2": "fc2"}


def _merger_keys(spec: Qwen2VLSpec):
    """(HF suffix, Megatron suffix) of the merger's tensors; Qwen2.5-VL's ln_q has no bias."""
    for a, b in _MERGER.items():
        for kind in ("weight", "bias"):
            if not (spec.is_qwen25 and a == "ln_q" and kind == "bias"):
                yield f"{a}.{kind}", f"{b}.{kind}"


def hf_prefixes(keys) -> tuple[str, str]:
    """transformers 4.x and 5.x save the text and vision parts under different prefixes."""
    keys = list(keys)
    text = "model.language_model." if any(k.startswith("model.language_model.") for k in keys) else "model."
    vision = "model.visual." if any(k.startswith("model.visual.") for k in keys) else "visual."
    return text, vision


def load_hf_state(path: str | Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path}: no *.safetensors files (an HF Qwen2-VL directory is expected)")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(f)))
    return state


def _qkv_to_megatron(q, k, v, groups: int) -> torch.Tensor:
    """[q; k; v] -> per query group [q heads of the group, k, v]: Megatron's fused QKV layout,
    which tensor parallelism can split into contiguous groups."""
    d = k.shape[0] // groups
    rest = q.shape[1:]
    q = q.reshape(groups, -1, d, *rest)
    return torch.cat([q, k.reshape(groups, 1, d, *rest), v.reshape(groups, 1, d, *rest)], dim=1).reshape(-1, *rest)


def _qkv_from_megatron(qkv, groups: int, heads: int):
    per = heads // groups
    d = qkv.shape[0] // (groups * (per + 2))
    x = qkv.reshape(groups, per + 2, d, *qkv.shape[1:])
    q = x[:, :per].reshape(heads * d, *qkv.shape[1:])
    return q, x[:, per].reshape(groups * d, *qkv.shape[1:]), x[:, per + 1].reshape(groups * d, *qkv.shape[1:])


def hf_to_megatron(hf: dict[str, torch.Tensor], spec: Qwen2VLSpec) -> dict[str, torch.Tensor]:
    """HF tensors -> full Megatron tensors named as in `Qwen2VLModel.state_dict()`."""
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
        for kind in ("weight", "bias"):
            out[f"{dst}self_attention.linear_qkv.{kind}"] = _qkv_to_megatron(
                hf[f"{att}q_proj.{kind}"], hf[f"{att}k_proj.{kind}"], hf[f"{att}v_proj.{kind}"], spec.num_kv_heads)
        out[dst + "mlp.linear_fc1.weight"] = torch.cat([hf[src + "mlp.gate_proj.weight"], hf[src + "mlp.up_proj.weight"]])
    out["vision.patch_embed.weight"] = hf[f"{v}patch_embed.proj.weight"].reshape(spec.vision_embed_dim, -1)
    for i in range(spec.vision_depth):
        src, dst = f"{v}blocks.{i}.", f"vision.decoder.layers.{i}."
        for a, b in (_VISION_LAYER_25 if spec.is_qwen25 else _VISION_LAYER).items():
            out[dst + b] = hf[src + a]
        for kind in ("weight", "bias"):
            q, k, vv = hf[f"{src}attn.qkv.{kind}"].chunk(3)
            out[f"{dst}self_attention.linear_qkv.{kind}"] = _qkv_to_megatron(q, k, vv, spec.vision_heads)
            if spec.is_qwen25:
                out[f"{dst}mlp.linear_fc1.{kind}"] = torch.cat([hf[f"{src}mlp.gate_proj.{kind}"],
                                                               hf[f"{src}mlp.up_proj.{kind}"]])
    for a, b in _merger_keys(spec):
        out[f"vision.merger.{b}"] = hf[f"{v}merger.{a}"]
    return out


def megatron_to_hf(full: dict[str, torch.Tensor], spec: Qwen2VLSpec,
                   prefixes: tuple[str, str] = ("model.", "visual.")) -> dict[str, torch.Tensor]:
    """Full Megatron tensors -> HF names (by default the layout transformers 5 saves). `full` may
    hold only some sync units (see models/convert.py's `sync_unit`), each complete: those are converted."""
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
        for kind in ("weight", "bias"):
            q, k, vv = _qkv_from_megatron(full[f"{src}self_attention.linear_qkv.{kind}"], spec.num_kv_heads, spec.num_heads)
            out[f"{dst}self_attn.q_proj.{kind}"], out[f"{dst}self_attn.k_proj.{kind}"], out[f"{dst}self_attn.v_proj.{kind}"] = q, k, vv
        gate, up = full[src + "mlp.linear_fc1.weight"].chunk(2)
        out[dst + "mlp.gate_proj.weight"], out[dst + "mlp.up_proj.weight"] = gate, up
    if "vision.patch_embed.weight" in full:
        patch = (spec.vision_embed_dim, spec.in_channels, spec.temporal_patch_size, spec.patch_size, spec.patch_size)
        out[f"{v}patch_embed.proj.weight"] = full["vision.patch_embed.weight"].reshape(patch)
    for i in range(spec.vision_depth):
        src, dst = f"vision.decoder.layers.{i}.", f"{v}blocks.{i}."
        if src + "self_attention.linear_qkv.weight" not in full:
            continue
        for a, b in (_VISION_LAYER_25 if spec.is_qwen25 else _VISION_LAYER).items():
            out[dst + a] = full[src + b]
        for kind in ("weight", "bias"):
            q, k, vv = _qkv_from_megatron(full[f"{src}self_attention.linear_qkv.{kind}"], spec.vision_heads, spec.vision_heads)
            out[f"{dst}attn.qkv.{kind}"] = torch.cat([q, k, vv])
            if spec.is_qwen25:
                gate, up = full[f"{src}mlp.linear_fc1.{kind}"].chunk(2)
                out[f"{dst}mlp.gate_proj.{kind}"], out[f"{dst}mlp.up_proj.{kind}"] = gate, up
    if "vision.merger.fc1.weight" in full:
        for a, b in _merger_keys(spec):
            out[f"{v}merger.{a}"] = full[f"vision.merger.{b}"]
    return out


_GATED_FC1 = re.compile(r"^language\.decoder\.layers\.\d+\.mlp\.linear_fc1\.weight$")
# Qwen2.5-VL's vision MLP is gated too, biases included
_GATED_VISION_FC1 = re.compile(r"^vision\.decoder\.layers\.\d+\.mlp\.linear_fc1\.(weight|bias)$")


def _gated(name: str, gated_vision: bool) -> bool:
    return bool(_GATED_FC1.match(name) or (gated_vision and _GATED_VISION_FC1.match(name)))


def shard(name: str, full: torch.Tensor, param: torch.Tensor, rank: int, size: int,
          gated_vision: bool = False) -> torch.Tensor:
    """This TP rank's part of a full tensor, as Megatron partitions `param`. `gated_vision`:
    the vision MLP's fc1 is [gate; up] (Qwen2.5-VL, `spec.is_qwen25`)."""
    if size == 1 or not getattr(param, "tensor_model_parallel", False):
        return full
    dim = param.partition_dim
    if _gated(name, gated_vision):  # [gate; up]: each rank holds [its gate part; its up part]
        return torch.cat([half.chunk(size, dim)[rank] for half in full.chunk(2, dim)], dim)
    return full.chunk(size, dim)[rank]


def gather(name: str, param: torch.Tensor, group=None, gated_vision: bool = False) -> torch.Tensor:
    """The full tensor from every TP rank's shard of `param` (collective over `group`)."""
    import torch.distributed as dist

    size = dist.get_world_size(group) if dist.is_initialized() else 1
    if size == 1 or not getattr(param, "tensor_model_parallel", False):
        return param.detach()
    parts = [torch.empty_like(param) for _ in range(size)]
    dist.all_gather(parts, param.detach().contiguous(), group=group)
    dim = param.partition_dim
    if _gated(name, gated_vision):
        halves = [p.chunk(2, dim) for p in parts]
        return torch.cat([torch.cat([h[0] for h in halves], dim), torch.cat([h[1] for h in halves], dim)], dim)
    return torch.cat(parts, dim)


def load_hf_into(model: torch.nn.Module, hf_dir: str | Path, tp_rank: int = 0, tp_size: int = 1) -> None:
    """Copy an HF checkpoint into a (possibly TP-sharded, possibly one pipeline stage of a)
    Megatron Qwen2VLModel."""
    spec = model.spec
    copy_into(model, hf_to_megatron(load_hf_state(hf_dir), spec),
              lambda name, full, p, rank, size: shard(name, full, p, rank, size, spec.is_qwen25), tp_rank, tp_size)


def export_hf(model: torch.nn.Module, tp_group=None, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """HF-named full tensors of the model (gathered over TP, and over the pipeline stages);
    every rank gets them."""
    return {k: t for bucket in export_hf_buckets(model, tp_group, dtype, bucket_bytes=None) for k, t in bucket.items()}


def export_hf_buckets(model: torch.nn.Module, tp_group=None, dtype: torch.dtype | None = None,
                      bucket_bytes: int | None = None) -> Iterator[dict[str, torch.Tensor]]:
    """The HF-named full tensors of the whole model in buckets of at most `bucket_bytes` (None:
    one bucket per pipeline stage), built one after another: while the caller uses a bucket
    nothing else is gathered, so a weight sync holds one bucket, not a copy of the model. A
    bucket holds whole sync units, so the engine never sees half of a fused weight; a unit
    larger than `bucket_bytes` is a bucket by itself. Under pipeline parallelism the stages
    take turns: each stage's buckets are broadcast over the pipeline group as they are built,
    so every rank sees every bucket. A collective over TP and PP: every rank iterates to the end."""
    spec = model.spec
    return pipeline_buckets(model, stage_buckets(
        model, tp_group, dtype, bucket_bytes,
        lambda params: {name: gather(name, p, tp_group, spec.is_qwen25) for name, p in params},
        lambda full: megatron_to_hf(full, spec)))


_LORA_LAYER = re.compile(r"^(language|vision)\.decoder\.layers\.(\d+)\.(.+)$")


def lora_to_hf(spec, pairs: dict[str, tuple[torch.Tensor, torch.Tensor]],
               text_prefix: str = "model.language_model.") -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """LoRA pairs of the Megatron linears (whole tensors, whole-model names; see models/lora.py)
    -> {HF module path: (A, B)} as transformers 5 lays out Qwen2-VL, Qwen2.5-VL and Qwen3-VL alike.
    A fused layer's B splits as its weight does (QKV by query group, [gate; up] in halves), and
    its one A goes with each projection. The vision tower's blocks (`vision_lora_to_hf`) too."""
    out = {}
    for name, (a, b) in pairs.items():
        if name.startswith("vision.") and ".decoder.layers." not in name:  # a patch merger's linear
            out[vision_merger_to_hf(name)] = (a, b)
            continue
        part, layer, linear = _LORA_LAYER.match(name).groups()
        if part == "vision":
            out |= vision_lora_to_hf(spec, layer, linear, a, b)
            continue
        dst = f"{text_prefix}layers.{layer}."
        if linear == "self_attention.linear_qkv":
            q, k, v = _qkv_from_megatron(b, spec.num_kv_heads, spec.num_heads)
            out |= {f"{dst}self_attn.q_proj": (a, q), f"{dst}self_attn.k_proj": (a, k), f"{dst}self_attn.v_proj": (a, v)}
        elif linear == "self_attention.linear_proj":
            out[f"{dst}self_attn.o_proj"] = (a, b)
        elif linear == "mlp.linear_fc1":
            gate, up = b.chunk(2)
            out |= {f"{dst}mlp.gate_proj": (a, gate), f"{dst}mlp.up_proj": (a, up)}
        elif linear == "mlp.linear_fc2":
            out[f"{dst}mlp.down_proj"] = (a, b)
        else:
            raise KeyError(f"{name}: no HF projection for this adapted linear")
    return out


def vision_merger_to_hf(name: str, prefix: str = "model.visual.") -> str:
    """A patch merger's adapted linear (vision.merger.fc1, vision.deepstack_merger_list.0.linear_fc2,
    ...) -> its HF module: Qwen2-VL's fc1 / fc2 are merger.mlp.0 / mlp.2; Qwen3-VL's keep their names."""
    module, linear = name.removeprefix("vision.").rsplit(".", 1)
    hf_name = {b: a for a, b in _MERGER.items()}  # Megatron's fc1 -> HF's mlp.0
    return f"{prefix}{module}.{hf_name.get(linear, linear) if module == 'merger' else linear}"


def vision_lora_to_hf(spec, layer: str, linear: str, a: torch.Tensor, b: torch.Tensor,
                      prefix: str = "model.visual.") -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """A vision block's adapted linear -> its HF module(s): the fused QKV back to [q; k; v] (one
    query group a head), the MLP by each tower's names (Qwen2-VL fc1/fc2; Qwen2.5-VL's gated
    gate_proj/up_proj/down_proj; Qwen3-VL's and Qwen3.5's linear_fc1/linear_fc2)."""
    dst = f"{prefix}blocks.{layer}."
    if linear == "self_attention.linear_qkv":
        return {dst + "attn.qkv": (a, torch.cat(_qkv_from_megatron(b, spec.vision_heads, spec.vision_heads)))}
    if linear == "self_attention.linear_proj":
        return {dst + "attn.proj": (a, b)}
    if getattr(spec, "is_qwen25", False):
        if linear == "mlp.linear_fc1":
            gate, up = b.chunk(2)
            return {dst + "mlp.gate_proj": (a, gate), dst + "mlp.up_proj": (a, up)}
        return {dst + "mlp.down_proj": (a, b)}
    fc1, fc2 = ("fc1", "fc2") if spec.model_type == "qwen2_vl" else ("linear_fc1", "linear_fc2")
    return {dst + f"mlp.{fc1 if linear == 'mlp.linear_fc1' else fc2}": (a, b)}
