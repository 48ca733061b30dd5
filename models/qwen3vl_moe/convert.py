"""Hugging Face Qwen3-VL-MoE <-> Megatron weights, at any tensor- and expert-parallel size.

Everything but the MoE blocks converts as Qwen3-VL (models/qwen3vl/convert.py). A layer's MoE
block, per layer i:

    HF (released layout, what vLLM loads)           Megatron (full, global expert e)
    mlp.gate.weight              [E, H]             mlp.router.weight                               [E, H]
    mlp.experts.gate_up_proj     [E, H, 2I]         mlp.experts.local_experts.e.linear_fc1.weight   [2I, H] = [gate; up]
    mlp.experts.down_proj        [E, I, H]          mlp.experts.local_experts.e.linear_fc2.weight   [H, I]

transformers 5.19 keeps the experts transposed in memory ([E, 2I, H], [E, H, I]) and its
save_pretrained writes that layout; it transposes the released layout on load. The loader here
reads either (told apart by shape; a square ambiguity is read as released) and the export
writes the released one. Under expert parallelism each rank holds `local_experts` experts,
numbered from 0 (`local_experts.j` is global expert expert_offset + j); the export gathers them
from every expert-parallel rank, so each bucket holds the whole tensors.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import torch

from models.convert import copy_into, over_experts, pipeline_buckets
from models.convert import stage_buckets as _stage_buckets
from models.qwen2vl.convert import gather, hf_prefixes, load_hf_state, shard
from models.qwen3vl import convert as dense
from models.qwen3vl_moe.config import Qwen3VLMoeSpec
from models.stages import EXPERT as _EXPERT
from models.stages import global_name

# an expert's fc1, [gate; up] (a shared expert's too: Qwen3.5-MoE, models/qwen35_moe/convert.py)
_EXPERT_FC1 = re.compile(r"^language\.decoder\.layers\.\d+\.mlp\.(experts\.local_experts\.\d+|shared_experts)"
                         r"\.linear_fc1\.weight$")
# a routed expert's adapted linear; peft's module for each: it adapts the stacked experts as
# parameters (target_parameters), gate_up_proj wrapped first as experts.base_layer
_EXPERT_LORA = re.compile(r"^language\.decoder\.layers\.(\d+)\.mlp\.experts\.local_experts\.(\d+)\.(linear_fc1|linear_fc2)$")
_PEFT_EXPERTS = {"linear_fc1": "mlp.experts.base_layer", "linear_fc2": "mlp.experts"}
_DENSE_MLP = ("mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")
_MOE_HF = ("mlp.gate.weight", "mlp.experts.gate_up_proj", "mlp.experts.down_proj")


def hf_to_megatron(hf: dict[str, torch.Tensor], spec: Qwen3VLMoeSpec) -> dict[str, torch.Tensor]:
    """HF tensors -> full Megatron tensors named as in the whole `Qwen3VLMoeModel.state_dict()`
    (global expert numbers)."""
    t, _ = hf_prefixes(hf)
    placeholder = torch.empty(0)
    # Qwen3-VL's converter for all but the MoE blocks: give it empty dense-MLP tensors to skip
    base = {k: v for k, v in hf.items()}
    for i in range(spec.num_layers):
        for key in _DENSE_MLP:
            base[f"{t}layers.{i}.{key}"] = placeholder
    out = dense.hf_to_megatron(base, spec)
    E, H, I = spec.num_experts, spec.hidden_size, spec.moe_intermediate_size
    for i in range(spec.num_layers):
        src, dst = f"{t}layers.{i}.", f"language.decoder.layers.{i}.mlp."
        del out[dst + "linear_fc1.weight"], out[dst + "linear_fc2.weight"]
        out[dst + "router.weight"] = hf[src + "mlp.gate.weight"]
        gate_up, down = hf[src + "mlp.experts.gate_up_proj"], hf[src + "mlp.experts.down_proj"]
        released = tuple(gate_up.shape) == (E, H, 2 * I)
        if not released and tuple(gate_up.shape) != (E, 2 * I, H):
            raise ValueError(f"{src}mlp.experts.gate_up_proj has shape {tuple(gate_up.shape)}; expected "
                             f"[{E}, {H}, {2 * I}] (released) or [{E}, {2 * I}, {H}] (transformers' in-memory)")
        if tuple(down.shape) != ((E, I, H) if released else (E, H, I)):
            raise ValueError(f"{src}mlp.experts.down_proj has shape {tuple(down.shape)}, which does not match "
                             f"gate_up_proj's {'released' if released else 'in-memory'} layout")
        for e in range(E):
            expert = f"{dst}experts.local_experts.{e}."
            out[expert + "linear_fc1.weight"] = gate_up[e].t() if released else gate_up[e]
            out[expert + "linear_fc2.weight"] = down[e].t() if released else down[e]
    return out


def megatron_to_hf(full: dict[str, torch.Tensor], spec: Qwen3VLMoeSpec,
                   prefixes: tuple[str, str] = ("model.language_model.", "model.visual.")) -> dict[str, torch.Tensor]:
    """Full Megatron tensors (global expert numbers, every expert of a layer present) -> HF
    names in the released layout. `full` may hold only some sync units, each complete."""
    t, _ = prefixes
    base = dict(full)
    layers = []
    for i in range(spec.num_layers):
        src = f"language.decoder.layers.{i}."
        if src + "mlp.router.weight" not in full:
            continue
        layers.append(i)
        base[src + "mlp.linear_fc1.weight"] = torch.empty(2, 0)  # Qwen3-VL's converter splits it in halves
        base[src + "mlp.linear_fc2.weight"] = torch.empty(0)
    out = dense.megatron_to_hf(base, spec, prefixes)
    for i in layers:
        src, dst = f"language.decoder.layers.{i}.mlp.", f"{t}layers.{i}."
        for key in _DENSE_MLP:
            del out[dst + key]
        experts = [f"{src}experts.local_experts.{e}." for e in range(spec.num_experts)]
        out[dst + "mlp.gate.weight"] = full[src + "router.weight"]
        out[dst + "mlp.experts.gate_up_proj"] = torch.stack([full[e + "linear_fc1.weight"].t() for e in experts])
        out[dst + "mlp.experts.down_proj"] = torch.stack([full[e + "linear_fc2.weight"].t() for e in experts])
    return out


def experts_lora_to_hf(pairs: dict[str, tuple[torch.Tensor, torch.Tensor]], num_experts: int,
                       text_prefix: str = "model.language_model.") -> tuple[dict, dict]:
    """The routed experts' LoRA pairs (whole, one per global expert) as peft's target_parameters
    adapter holds a layer's stacked experts, and the other pairs as they are. peft keeps one A
    [E * r, in] with the expert slowest and one B [out, r * E] with the expert fastest (peft 0.21,
    ParamWrapper); fc1's B rows stay [gate; up], as gate_up_proj's are."""
    experts: dict[tuple[str, str], dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}
    rest = {}
    for name, pair in pairs.items():
        if match := _EXPERT_LORA.match(name):
            experts.setdefault((match.group(1), match.group(3)), {})[int(match.group(2))] = pair
        else:
            rest[name] = pair
    out = {}
    for (layer, linear), by_expert in experts.items():
        if sorted(by_expert) != list(range(num_experts)):
            raise KeyError(f"layer {layer}'s {linear} adapters: experts {sorted(by_expert)}, not all {num_experts}")
        a = torch.cat([by_expert[e][0] for e in range(num_experts)])
        b = torch.stack([by_expert[e][1] for e in range(num_experts)], dim=-1).flatten(1)
        out[f"{text_prefix}layers.{layer}.{_PEFT_EXPERTS[linear]}"] = (a, b)
    return out, rest


def lora_to_hf(spec, pairs: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """LoRA pairs (whole, whole-model names; models/lora.py) -> {HF module path: (A, B)}: the
    attention and the vision tower as Qwen3-VL's, the routed experts as peft stacks them."""
    from models.qwen2vl.convert import lora_to_hf as dense_lora_to_hf

    experts, rest = experts_lora_to_hf(pairs, spec.num_experts)
    return dense_lora_to_hf(spec, rest) | experts


def _shard(name: str, full: torch.Tensor, param: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """This TP rank's part; an expert's fc1 is [gate; up] (each rank: [its gate part; its up part])."""
    if size > 1 and getattr(param, "tensor_model_parallel", False) and _EXPERT_FC1.match(name):
        return torch.cat([half.chunk(size, param.partition_dim)[rank] for half in full.chunk(2, param.partition_dim)],
                         param.partition_dim)
    return shard(name, full, param, rank, size)


def _gather(name: str, param: torch.Tensor, group) -> torch.Tensor:
    """The full tensor over TP (an expert's fc1 as [gate; up])."""
    import torch.distributed as dist

    size = dist.get_world_size(group) if dist.is_initialized() else 1
    if size > 1 and getattr(param, "tensor_model_parallel", False) and _EXPERT_FC1.match(name):
        parts = [torch.empty_like(param) for _ in range(size)]
        dist.all_gather(parts, param.detach().contiguous(), group=group)
        dim = param.partition_dim
        halves = [p.chunk(2, dim) for p in parts]
        return torch.cat([torch.cat([h[0] for h in halves], dim), torch.cat([h[1] for h in halves], dim)], dim)
    return gather(name, param, group)


def load_hf_into(model: torch.nn.Module, hf_dir: str | Path, tp_rank: int = 0, tp_size: int = 1) -> None:
    """Copy an HF checkpoint into a (TP-sharded, one pipeline stage of, this EP rank's experts of
    a) Megatron Qwen3VLMoeModel."""
    copy_into(model, hf_to_megatron(load_hf_state(hf_dir), model.spec), _shard, tp_rank, tp_size, global_name)


def stage_buckets(model: torch.nn.Module, tp_group=None, dtype: torch.dtype | None = None,
                  bucket_bytes: int | None = None, gather=None, to_hf=None) -> Iterator[dict[str, torch.Tensor]]:
    """This pipeline stage's HF-named full tensors, gathered over TP and (the experts) over EP,
    in buckets of whole sync units (a layer, router and every expert included) of at most
    `bucket_bytes` (None: one bucket). A collective over TP and EP: every rank iterates to the end.
    Another MoE family gives its own `gather` (name, param, tp_group) -> full tensor over TP and
    `to_hf` (full Megatron tensors) -> HF tensors (models/qwen35_moe/convert.py)."""
    gather = gather or _gather
    to_hf = to_hf or (lambda full: megatron_to_hf(full, model.spec))
    ep = getattr(model, "ep", 1)

    def gather_unit(params):  # every EP rank's experts, by global number
        return {k: t for name, p in params for k, t in over_experts(model, name, gather(name, p, tp_group)).items()}

    yield from _stage_buckets(model, tp_group, dtype, bucket_bytes, gather_unit, to_hf,
                              lambda name: ep if _EXPERT.match(name) else 1)


def export_hf(model: torch.nn.Module, tp_group=None, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """HF-named full tensors of the model (one pipeline stage's part under PP)."""
    return {k: t for bucket in stage_buckets(model, tp_group, dtype) for k, t in bucket.items()}


def export_hf_buckets(model: torch.nn.Module, tp_group=None, dtype: torch.dtype | None = None,
                      bucket_bytes: int | None = None) -> Iterator[dict[str, torch.Tensor]]:
    """The whole model's HF-named full tensors in buckets, every expert in them on every rank;
    under pipeline parallelism the stages take turns (models/convert.py's `pipeline_buckets`).
    A collective over TP, EP and PP."""
    return pipeline_buckets(model, stage_buckets(model, tp_group, dtype, bucket_bytes))
