"""The trainer's state in a form that does not depend on the layout: Megatron-Core's distributed
checkpointing (`dist_checkpointing`, its `torch_dist` format, written by torch.distributed.checkpoint).

Every tensor is saved as its part of one global tensor (Megatron's ShardedTensor: the TP split, the
pipeline stage's global layer numbers, the global expert number), so any layout reads the parts it
needs: another DP, TP, PP, CP or EP size. The Megatron blocks describe their own tensors (fused QKV,
SwiGLU's [gate; up], GatedDeltaNet's sections); `model_sharded_state` walks the plain torch modules
around them (the vision tower's patch embedding and merger) and asks each Megatron module it meets.
The optimizer's state is saved per parameter in the parameter's own global shape, under Megatron's
names (`optimizer.state.{param,exp_avg,exp_avg_sq}.<model tensor>`: the fp32 main weight and Adam's
moments), whatever optimizer wrote it. A LoRA run saves its adapter alone (the frozen base is its
HF checkpoint): each adapter tensor by its whole-model name, split over TP as its weight is
(`AdapterPlace`), and its optimizer state likewise.

Saving has two halves, so that the training loop waits only for copies:
- `snapshot` (the loop's thread): the model's sharded state dict and the optimizer's state (the
  distributed optimizer's: this rank's 1-D shards, as models/reshard.py names them), copied to
  host memory, no collective;
- `write` (a background thread): the distributed optimizer's shards gathered onto each optimizer's
  first DP rank and put together per parameter, then torch.distributed.checkpoint writes every
  rank's part. Its collectives run on process groups of the checkpoint's own (`CheckpointGroups`),
  so they never interleave with the loop's.
The directory is Megatron's own format (`metadata.json`, `common.pt`, DCP's `.metadata` and
`__{rank}_{i}.distcp`), which `dist_checkpointing.load` reads.

`load` reads the model through Megatron and the optimizer's tensors by their names, then puts them
into this run's optimizer as models/reshard.py does for any layout: so the distributed optimizer
may be switched on or off, and the experts' optimizer (their own only under EP) may come and go.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path

import torch

_MAIN_WEIGHT = "param"  # the fp32 main weight's name among the optimizer's tensors
_KEYS = ("exp_avg", "exp_avg_sq")


def model_sharded_state(module: torch.nn.Module) -> dict:
    """Megatron's sharded state dict of a model that mixes Megatron blocks with plain torch
    modules: a plain module's own tensors are replicated over TP and DP (with each rank's replica
    id, so one copy is written), a Megatron module describes its own."""
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

    tp = ps.get_tensor_model_parallel_group()
    dp_cp = ps.get_data_parallel_group(with_context_parallel=True)

    def walk(m: torch.nn.Module, prefix: str) -> dict:
        if hasattr(m, "sharded_state_dict"):
            return m.sharded_state_dict(prefix=prefix, sharded_offsets=(), metadata={"dp_cp_group": dp_cp})
        own: dict = {}
        m._save_to_state_dict(own, "", keep_vars=True)
        out = make_sharded_tensors_for_checkpoint(own, prefix, {}, (), tp_group=tp, dp_cp_group=dp_cp)
        for name, child in m.named_children():
            out.update(walk(child, f"{prefix}{name}."))
        return out

    return walk(module, "")


@dataclass
class AdapterPlace:
    """Where one rank's LoRA tensor (models/lora.py) lies in the whole adapter: its whole-model
    name (global layer and expert numbers), the dimension split over TP (a column layer's B, a row
    layer's A; None: whole on every TP rank), this rank's place in that split, its replica over DP,
    and B's fused sections ([gate; up], a DeltaNet's in_proj), each split over TP on its own and so
    saved as a global tensor of its own."""

    key: str
    dim: int | None
    rank: int
    size: int
    dp_rank: int
    sections: list[int] | None  # this rank's rows of each section

    def describe(self, t: torch.Tensor, prefix: str = "") -> dict:
        """{key: ShardedTensor} of this rank's tensor `t` (the adapter's, or its optimizer state)."""
        from megatron.core.dist_checkpointing.mapping import ShardedTensor

        key = f"{prefix}{self.key}"
        if self.dim is None:
            return {key: ShardedTensor.from_rank_offsets(key, t, replica_id=(0, self.rank, self.dp_rank))}
        pieces = [t] if not self.sections else [x.clone() for x in t.split(self.sections, self.dim)]
        keys = [key] if not self.sections else [f"{key}.section{i}" for i in range(len(pieces))]
        split = (self.dim, self.rank, self.size)
        return {k: ShardedTensor.from_rank_offsets(k, x, split, replica_id=(0, 0, self.dp_rank))
                for k, x in zip(keys, pieces)}

    def assemble(self, loaded: dict) -> torch.Tensor:
        """This rank's tensor from what `describe`'s entries loaded."""
        return torch.cat(list(loaded.values()), self.dim) if len(loaded) > 1 else next(iter(loaded.values()))


def adapter_places(module: torch.nn.Module) -> dict[str, AdapterPlace]:
    """{adapter parameter name: its place} of this rank's LoRA tensors."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from models.convert import split_dim
    from models.lora import lora_linears
    from models.stages import EXPERT, global_name

    places = {}
    for name, linear in lora_linears(module):
        expert = EXPERT.match(name) is not None
        group = linear.tp_group if expert else ps.get_tensor_model_parallel_group()
        size = dist.get_world_size(group) if dist.is_initialized() else 1
        rank = dist.get_rank(group) if size > 1 else 0
        dp_rank = ps.get_expert_data_parallel_rank() if expert \
            else ps.get_data_parallel_rank(with_context_parallel=True)
        for which in ("lora_A", "lora_B"):
            dim = split_dim(linear, which)
            sections = linear.lora_sections if which == "lora_B" and dim is not None else None
            places[f"{name}.{which}"] = AdapterPlace(global_name(f"{name}.{which}", module), dim, rank, size,
                                                     dp_rank, [n // size for n in sections] if sections else None)
    return places


@dataclass
class Snapshot:
    """What one rank writes, in host memory: the model's sharded state dict (its entries by
    parameter name, for the optimizer's tensors), the optimizer's state (`whole`: per parameter,
    1-D, as a plain optimizer holds it; or `shards`: the distributed optimizer's, per inner
    optimizer, put together at write time) and the common part (Adam's step, how the optimizer
    was built)."""

    model: dict
    entries: dict  # parameter name -> its model entry (ShardedTensor or factory); with LoRA, its AdapterPlace
    shapes: dict[str, torch.Size]
    whole: dict | None
    shards: list[dict] | None
    common: dict


def snapshot(trainer) -> Snapshot:
    """This rank's state copied to host memory: what `write` saves. No collective."""
    from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, ShardedTensorFactory

    from models.optimizer import inner_optimizers
    from models.reshard import plain_whole

    module, optimizer = trainer.module, trainer.optimizer
    trainable = {n: p for n, p in module.named_parameters() if p.requires_grad}
    shapes = {n: p.shape for n, p in trainable.items()}
    model, entries = _model_entries(trainer, trainable, _host_copy)
    if getattr(trainer, "lora", None) is None:
        def to_host(x):  # a factory (SwiGLU's [gate; up], DeltaNet's sections) holds its parameter too
            if isinstance(x, ShardedTensor | ShardedObject | ShardedTensorFactory):
                x.data = _host_copy(x.data)
            return x

        dict_list_map_inplace(to_host, model)  # the entries above are these objects: host copies too
    whole = shards = None
    if trainer.cfg.distributed_optimizer:
        shards = _host_copy(trainer.optimizer_state()["shards"])
    else:
        whole = {}
        for opt in inner_optimizers(optimizer):
            whole.update(_host_copy(plain_whole(opt, module)[0]))
    common = {"optimizer_kind": _host_copy({
        "distributed": trainer.cfg.distributed_optimizer, "inner": len(inner_optimizers(optimizer)),
        "step": _adam_step(optimizer),
        "megatron": optimizer.state_dict() if trainer.cfg.distributed_optimizer else None})}
    return Snapshot(model, entries, shapes, whole, shards, common)


def _adam_step(optimizer) -> torch.Tensor | None:
    """Adam's step count, one for every parameter (Megatron steps them together)."""
    from models.optimizer import inner_optimizers

    for inner in inner_optimizers(optimizer):
        for state in inner.optimizer.state.values():
            if "step" in state:
                return torch.as_tensor(state["step"], dtype=torch.float32).detach().to("cpu", copy=True)
        for group in inner.optimizer.param_groups:  # Transformer Engine's and Apex's Adam keep it here
            if "step" in group:
                return torch.tensor(float(group["step"]))
    return None


def _host_copy(obj):
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _host_copy(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(_host_copy(v) for v in obj)
    return copy.deepcopy(obj)


class CheckpointGroups:
    """Gloo process groups of the checkpoint writer's own: one over every rank (the write's
    collectives) and, with the distributed optimizer, one per DP group of each inner optimizer (the
    gather of its shards). Made by every rank together, in the loop's thread, at the first save."""

    def __init__(self, trainer):
        import torch.distributed as dist

        from models.optimizer import inner_optimizers

        self.world = dist.new_group(backend="gloo")
        self.optimizers = []
        if trainer.cfg.distributed_optimizer:
            mine = [tuple(dist.get_process_group_ranks(opt.data_parallel_group))
                    for opt in inner_optimizers(trainer.optimizer)]
            every: list = [None] * dist.get_world_size()
            dist.all_gather_object(every, mine, group=self.world)
            made = {ranks: dist.new_group(list(ranks), backend="gloo")  # the same order on every rank
                    for ranks in sorted({r for theirs in every for r in theirs})}
            self.optimizers = [made[ranks] for ranks in mine]


def write(snap: Snapshot, out: Path, groups: CheckpointGroups | None, rank: int) -> None:
    """Save a `snapshot` to the directory `out` (every rank of the run, each its part), in
    Megatron's torch_dist format. Collective over `groups` only (None: a run of one process)."""
    import torch.distributed.checkpoint as dcp
    from megatron.core.dist_checkpointing.core import CheckpointingConfig, save_config
    from megatron.core.dist_checkpointing.state_dict_utils import save_preprocess
    from megatron.core.dist_checkpointing.strategies.torch import (
        MCoreSavePlanner,
        _replace_state_dict_keys_with_sharded_keys,
        mcore_to_pyt_state_dict,
    )

    whole = snap.whole if snap.shards is None else _put_together(snap, groups)
    optimizer = {name: {k: _optimizer_entry(snap.entries[name], t.view(snap.shapes[name]), k)
                        for k, t in state.items()}
                 for name, state in whole.items()}
    # no sharding check across ranks (a collective on the run's group): DCP checks the global plan
    sharded, common = save_preprocess({"model": snap.model, "optimizer": optimizer, **snap.common},
                                      validate_access_integrity=False)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    keyed, _, _ = _replace_state_dict_keys_with_sharded_keys(sharded, keep_only_main_replica=True)
    dcp.save(mcore_to_pyt_state_dict(keyed, False), storage_writer=dcp.FileSystemWriter(str(out)),
             planner=MCoreSavePlanner(dedup_replicated_tensors=False, flatten_state_dict=False),
             process_group=groups.world if groups else None, no_dist=groups is None)
    if rank == 0:
        torch.save(common, out / "common.pt")
        save_config(CheckpointingConfig("torch_dist", 1, "torch", 1), str(out))


def _optimizer_entry(entry, t: torch.Tensor, key: str):
    """The optimizer's tensor `t` of a parameter (its `key`: param, exp_avg, ...) described as the
    parameter is: Megatron's `optimizer.state.<key>.<model tensor>`, or an adapter's place."""
    from megatron.core.dist_checkpointing.optimizer import make_sharded_optimizer_tensor

    if isinstance(entry, AdapterPlace):
        return entry.describe(t, f"optimizer.state.{key}.")
    return make_sharded_optimizer_tensor(entry, t, prefix=f"optimizer.state.{key}")


def _put_together(snap: Snapshot, groups: CheckpointGroups | None) -> dict:
    """Each parameter's optimizer state whole and 1-D, from every DP rank's shards of each inner
    optimizer, on that optimizer's first DP rank (empty elsewhere: it writes none of it)."""
    import torch.distributed as dist

    from models.reshard import stitch

    numel = {n: s.numel() for n, s in snap.shapes.items()}
    whole = {}
    for i, shard in enumerate(snap.shards):
        group = groups.optimizers[i] if groups else None
        if group is None or group.size() == 1:
            whole.update(stitch([shard], numel)[0])
            continue
        every = [None] * group.size() if group.rank() == 0 else None
        dist.gather_object(shard, every, dst=dist.get_global_rank(group, 0), group=group)
        if group.rank() == 0:
            whole.update(stitch(every, numel)[0])
    return whole


def saved_keys(path: Path) -> set[str]:
    """The global tensors a checkpoint directory holds."""
    import torch.distributed.checkpoint as dcp

    return set(dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata)


def load(trainer, path: Path, optimizer: bool = True) -> None:
    """This rank's model and (with `optimizer`) optimizer state from a directory `write` wrote,
    whatever layout wrote it. Collective over the run's groups."""
    from megatron.core import dist_checkpointing

    from models.reshard import load_whole

    module = trainer.module
    held = saved_keys(path)
    keys = [k for k in (_MAIN_WEIGHT, *_KEYS) if any(h.startswith(f"optimizer.state.{k}.") for h in held)]
    trainable = {n: p for n, p in module.named_parameters() if p.requires_grad}
    model, entries = _model_entries(trainer, trainable, torch.empty_like)
    wanted = {n: {k: _optimizer_entry(entries[n], torch.empty(p.shape, dtype=torch.float32), k) for k in keys}
              for n, p in trainable.items() if optimizer}
    state = dist_checkpointing.load({"model": model, "optimizer_tensors": wanted}, str(path))
    if getattr(trainer, "lora", None) is not None:
        with torch.no_grad():
            for n, p in trainable.items():
                p.copy_(entries[n].assemble(state["model"][n]))
    else:
        module.load_state_dict(state["model"])
    if optimizer:
        whole = {n: {k: (entries[n].assemble(t) if isinstance(t, dict) else t).reshape(-1).clone()
                     for k, t in tensors.items()}
                 for n, tensors in state["optimizer_tensors"].items()}
        load_whole(trainer, whole, state["optimizer_kind"])


def _model_entries(trainer, trainable: dict, adapter_tensor) -> tuple[dict, dict]:
    """(the model's sharded state dict, each trainable parameter's entry in it): Megatron's over the
    live parameters, or with LoRA the adapter's places, each tensor as `adapter_tensor(parameter)`
    gives it (a host copy to save, an empty one to load into)."""
    if getattr(trainer, "lora", None) is not None:  # the adapter alone
        entries = adapter_places(trainer.module)
        return {n: entries[n].describe(adapter_tensor(p)) for n, p in trainable.items()}, entries
    model = model_sharded_state(trainer.module)
    by_param = _entries_by_param(model)
    return model, {n: by_param[p] for n, p in trainable.items()}


def _entries_by_param(model: dict) -> dict:
    """Each parameter's entry (ShardedTensor or factory) in a model's sharded state dict."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values

    return {v.data: v for v in nested_values(model) if isinstance(getattr(v, "data", None), torch.nn.Parameter)}


def snapshot_tensors(snap: Snapshot) -> dict:
    """A `snapshot`'s tensors (the model's by global key and offset, the optimizer's state as this
    rank holds it) and its common part: what a checksum of the state this rank writes covers."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values

    model = {f"{v.key}@{tuple(getattr(v, 'global_offset', ()))}": v.data for v in nested_values(snap.model)
             if isinstance(getattr(v, "data", None), torch.Tensor)}
    return {"model": model, "optimizer": snap.whole if snap.shards is None else snap.shards, "common": snap.common}


def files_of(path: Path, rank: int) -> list[Path]:
    """The files of a distributed checkpoint directory that rank `rank` wrote: its DCP data files,
    and the first rank's metadata and common state too."""
    path = Path(path)
    mine = sorted(path.glob(f"__{rank}_*.distcp"))
    if rank == 0:
        mine += [path / n for n in (".metadata", "common.pt", "metadata.json")]
    return mine
