"""The family-neutral half of HF <-> Megatron weight conversion (models/<family>/convert.py has
the rest: names, layouts and tensor-parallel shapes).

Here: a parameter's name in the checkpoint (`checkpoint_name`: tied embeddings; its name in the
whole model, `whole_model_name`, is models/stages.py's), the sync unit (`sync_unit`: what
converts to HF tensors on its own), copying converted tensors into a stage (`copy_into`), one
stage's export in buckets (`stage_buckets`, LoRA's adapted weights merged), the pipeline
hand-over that gives every rank the whole model's buckets (`pipeline_buckets`), and a LoRA
adapter's export beside them (`adapter_buckets`). A family calls these with its own converter,
shard and gather.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from itertools import groupby

import torch

from models.lora import PEFT_PREFIX, is_adapter, lora_linears, merged
from models.stages import EXPERT, global_name, whole_model_name

_LAYER_PREFIX = re.compile(r"^(language|vision)\.decoder\.layers\.\d+\.")
TIED_OUTPUT = "language.output_layer.weight"


def sync_unit(name: str) -> str:
    """The group of Megatron parameters that converts to HF tensors on its own: a transformer
    layer (its fused QKV and [gate; up] split into several HF tensors that vLLM loads into one
    fused weight), or one top-level module (embeddings, final norm, head, patch embed, merger)."""
    layer = _LAYER_PREFIX.match(name)
    return layer.group(0) if layer else ".".join(name.split(".")[:2])


def checkpoint_name(name: str, model: torch.nn.Module,
                    whole_name: Callable[[str, torch.nn.Module], str] = whole_model_name) -> str:
    """Where a parameter's value is in the (whole model's) checkpoint. With tied embeddings and
    pipeline stages the last stage has its own copy of the word embeddings as its output layer
    (Megatron keeps the two in step through the embedding group)."""
    if name == TIED_OUTPUT and model.spec.tie_word_embeddings:
        return "language.embedding.word_embeddings.weight"
    return whole_name(name, model)


def copy_into(model: torch.nn.Module, full: dict[str, torch.Tensor], shard: Callable[..., torch.Tensor],
              tp_rank: int, tp_size: int,
              whole_name: Callable[[str, torch.nn.Module], str] = whole_model_name) -> None:
    """Copy full Megatron tensors (the whole model's, named by `whole_name`) into a (possibly
    TP-sharded, possibly one pipeline stage or expert-parallel rank of a) model, each parameter
    its part: shard(name, full tensor, param, tp_rank, tp_size)."""
    params = {checkpoint_name(n, model, whole_name): (n, p) for n, p in model.named_parameters()}
    missing = sorted(set(params) - set(full))
    whole = getattr(model, "pre_process", True) and getattr(model, "post_process", True) \
        and getattr(model, "ep", 1) == 1
    unexpected = sorted(set(full) - set(params)) if whole else []  # a stage / EP rank holds only its part
    if missing or unexpected:
        raise KeyError(f"weight names do not line up: missing {missing[:5]}, unexpected {unexpected[:5]}")
    with torch.no_grad():
        for key, (name, p) in params.items():
            part = shard(name, full[key], p, tp_rank, tp_size)
            if part.shape != p.shape:
                raise ValueError(f"{name}: checkpoint shard {tuple(part.shape)} vs model {tuple(p.shape)}")
            p.copy_(part.to(p.dtype))


def stage_buckets(model: torch.nn.Module, tp_group, dtype: torch.dtype | None, bucket_bytes: int | None,
                  gather: Callable[[list[tuple[str, torch.Tensor]]], dict[str, torch.Tensor]],
                  to_hf: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]],
                  spread: Callable[[str], int] = lambda name: 1) -> Iterator[dict[str, torch.Tensor]]:
    """This pipeline stage's HF-named full tensors in buckets of whole sync units of at most
    `bucket_bytes` (None: one bucket), built one after another: while the caller uses a bucket
    nothing else is gathered. A unit larger than `bucket_bytes` is a bucket by itself.
    gather([(whole-model name, param)] of a unit) -> its full Megatron tensors (a collective
    over TP, and EP for experts); to_hf: the family's converter; spread(name): over how many
    ranks beyond TP a parameter is spread (its unit's size counts the whole). Every rank of
    the collective iterates to the end. Without PP this is the whole model."""
    import torch.distributed as dist

    tp = dist.get_world_size(tp_group) if dist.is_initialized() else 1
    bucket: dict[str, torch.Tensor] = {}
    size, done = 0, set()
    named = [(whole_model_name(n, model), p) for n, p in model.named_parameters()
             if not (n == TIED_OUTPUT and model.spec.tie_word_embeddings)  # the last stage's copy of the embeddings
             and not is_adapter(n)]  # LoRA: the adapters are merged into their weights below
    for unit, params in groupby(named, key=lambda item: sync_unit(item[0])):
        if unit in done:  # a unit split across the module order would be converted half
            raise RuntimeError(f"parameters of {unit} are not contiguous in the model")
        done.add(unit)
        params = list(params)
        unit_bytes = sum(p.numel() * (tp if getattr(p, "tensor_model_parallel", False) else 1) * spread(n)
                         * (dtype or p.dtype).itemsize for n, p in params)
        if bucket and bucket_bytes is not None and size + unit_bytes > bucket_bytes:
            yield bucket  # before gathering the next unit: the two never sit side by side
            bucket, size = {}, 0
        full = gather(merged(model, params))  # one unit's merged weights at a time
        for k, t in to_hf(full).items():
            bucket[k] = (t.to(dtype) if dtype else t).contiguous()
        size += unit_bytes
        del full
    if bucket:
        yield bucket


def pipeline_buckets(model: torch.nn.Module,
                     local: Iterator[dict[str, torch.Tensor]]) -> Iterator[dict[str, torch.Tensor]]:
    """The whole model's buckets on every rank, from this stage's `local` ones (`stage_buckets`).
    Under pipeline parallelism the stages take turns: each stage's buckets are broadcast over
    the pipeline group as they are built (a bucket's description over gloo, its tensors over the
    accelerator group), so every rank sees every bucket. Without PP: `local` as it is. A
    collective over PP (and whatever `local` is a collective over): every rank iterates to the end."""
    from megatron.core import parallel_state as ps

    pp = ps.get_pipeline_model_parallel_world_size() if ps.model_parallel_is_initialized() else 1
    if pp == 1 or (getattr(model, "pre_process", True) and getattr(model, "post_process", True)):
        yield from local
        return
    from models.comm import broadcast_packed, comm

    me, group = ps.get_pipeline_model_parallel_rank(), ps.get_pipeline_model_parallel_group()
    ranks = torch.distributed.get_process_group_ranks(group)
    device = next(model.parameters()).device
    for stage, src in enumerate(ranks):
        while True:  # the stage's buckets, then an empty description that ends them
            bucket = next(local, None) if stage == me else None
            described = {k: [str(t.dtype).removeprefix("torch."), list(t.shape)] for k, t in (bucket or {}).items()}
            _, meta = broadcast_packed(({}, {"bucket": json.dumps(described)}) if stage == me else None, src,
                                       comm().pp_cpu)
            described = json.loads(meta["bucket"])
            if not described:
                break
            if stage != me:
                bucket = {k: torch.empty(shape, dtype=getattr(torch, dt), device=device)
                          for k, (dt, shape) in described.items()}
            for t in bucket.values():  # over the accelerator group: NCCL on GPUs
                torch.distributed.broadcast(t, src, group=group)
            yield bucket


# -- LoRA adapters (models/lora.py), exported beside the weights ------------------------------
def _gather_adapter(t: torch.Tensor, dim: int, sections: list[int] | None, group) -> torch.Tensor:
    """The whole tensor from every TP rank's part, split on `dim`; `sections` (whole sizes): each
    part is its share of every section in turn ([gate; up], a DeltaNet's in_proj), reassembled
    section by section."""
    import torch.distributed as dist

    size = dist.get_world_size(group) if dist.is_initialized() else 1
    if size == 1:
        return t.detach()
    parts = [torch.empty_like(t) for _ in range(size)]
    dist.all_gather(parts, t.detach().contiguous(), group=group)
    if sections:
        pieces = [p.split([s // size for s in sections], dim) for p in parts]
        return torch.cat([piece[i] for i in range(len(sections)) for piece in pieces], dim)
    return torch.cat(parts, dim)


def whole_pairs(module: torch.nn.Module, tp_group, grads: bool = False) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """{whole-model name of an adapted linear: (A, B)} of this pipeline stage, whole (gathered
    over TP, and a routed expert's over EP: a collective); with `grads`, their gradients instead (Megatron's main_grad, else grad)."""
    def value(p):
        if not grads:
            return p
        return getattr(p, "main_grad", None) if getattr(p, "main_grad", None) is not None else p.grad

    whole = whole_adapter_tensors(module, {f"{name}.{which}": value(getattr(linear, which))
                                           for name, linear in lora_linears(module) for which in ("lora_A", "lora_B")},
                                  tp_group)
    return {name.removesuffix(".lora_A"): (a, whole[name.removesuffix("_A") + "_B"]) for name, a in whole.items()
            if name.endswith(".lora_A")}


def split_dim(linear: torch.nn.Module, which: str) -> int | None:
    """The dimension an adapter tensor is split on over TP (models/lora.py): a column layer's B on
    its rows, a row layer's A on its columns; None: whole on every TP rank (a plain Linear's both)."""
    if linear.lora_kind == "plain":
        return None
    if linear.lora_kind == "column":
        return 0 if which == "lora_B" else None
    return 1 if which == "lora_A" else None


def whole_adapter_tensors(module: torch.nn.Module, values: dict[str, torch.Tensor], tp_group) -> dict[str, torch.Tensor]:
    """`values` ({this stage's adapter parameter name: a tensor of its shape}: the adapter itself,
    its gradients or its optimizer state) whole over TP, by whole-model name (a routed expert's
    by its global number, every expert-parallel rank's experts on each): the same at every TP, PP
    and EP layout. A collective over TP (and EP)."""
    out = {}
    for name, linear in lora_linears(module):
        for which in ("lora_A", "lora_B"):
            t, dim = values[f"{name}.{which}"], split_dim(linear, which)
            sections = linear.lora_sections if which == "lora_B" else None  # [gate; up], in_proj's
            group = linear.tp_group if EXPERT.match(name) else tp_group  # an expert's: the expert-TP group
            t = t.detach() if dim is None else _gather_adapter(t, dim, sections, group)
            out |= over_experts(module, whole_model_name(f"{name}.{which}", module), t)
    return out


def over_experts(model: torch.nn.Module, name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
    """{whole-model name: tensor} of a tensor of `model` named by its whole-model name (`name`, a
    routed expert's with this rank's local number): a routed expert's from every expert-parallel
    rank, by global number (rank r's local expert j is global expert r * local_experts + j); any
    other as it is. A collective over EP for an expert's."""
    import torch.distributed as dist

    expert, ep = EXPERT.match(name), getattr(model, "ep", 1)
    if expert is None:
        return {name: tensor}
    parts = [tensor]
    if ep > 1:
        from models.comm import comm

        parts = [torch.empty_like(tensor) for _ in range(ep)]
        dist.all_gather(parts, tensor.contiguous(), group=comm().ep)
    local = int(expert.group(2))
    return {f"{expert.group(1)}{r * model.local_experts + local}{expert.group(3)}": part for r, part in enumerate(parts)}


def split_adapter_tensors(module: torch.nn.Module, whole: dict[str, torch.Tensor], tp_group) -> dict[str, torch.Tensor]:
    """The inverse of `whole_adapter_tensors` at this module's layout: {this stage's adapter
    parameter name: this TP rank's part} of the whole tensors in `whole` (other stages' ignored)."""
    import torch.distributed as dist

    tp = dist.get_world_size(tp_group) if dist.is_initialized() else 1
    rank = dist.get_rank(tp_group) if tp > 1 else 0
    out = {}
    for name, linear in lora_linears(module):
        for which in ("lora_A", "lora_B"):
            t, dim = whole[global_name(f"{name}.{which}", module)], split_dim(linear, which)
            if dim is not None and linear.lora_sections and which == "lora_B":  # each section split
                t = torch.cat([part.chunk(tp, dim)[rank] for part in t.split(linear.lora_sections, dim)], dim)
            elif dim is not None:
                t = t.chunk(tp, dim)[rank]
            out[f"{name}.{which}"] = t.contiguous()
    return out


def adapter_buckets(module: torch.nn.Module, family, tp_group, dtype: torch.dtype | None = None
                    ) -> Iterator[dict[str, torch.Tensor]]:
    """The whole adapter as PEFT names it ({base_model.model.<HF module>.lora_A/B.weight: tensor}),
    one bucket per pipeline stage, on every rank: a collective over TP and PP."""
    def local():
        pairs = family.lora_to_hf(module.spec, whole_pairs(module, tp_group))
        out = {}
        for path, (a, b) in pairs.items():
            for which, t in (("lora_A", a), ("lora_B", b)):
                out[f"{PEFT_PREFIX}{path}.{which}.weight"] = (t.to(dtype) if dtype else t).contiguous()
        yield out

    yield from pipeline_buckets(module, local())
