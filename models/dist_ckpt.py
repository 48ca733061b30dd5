"""The trainer's state in a form that does not depend on the layout: Megatron-Core's distributed
checkpointing (`dist_checkpointing`, its `torch_dist` format, written by torch.distributed.checkpoint).

Every tensor is saved as its part of one global tensor (Megatron's ShardedTensor: the TP split, the
pipeline stage's global layer numbers, the global expert number; the optimizer's state in its
parameter's shape), so any layout reads the parts it needs: another DP, TP, PP, CP or EP size. The
Megatron blocks describe their own tensors (fused QKV, SwiGLU's [gate; up], GatedDeltaNet's
sections); `model_sharded_state` walks the plain torch modules around them (the vision tower's
patch embedding and merger) and asks each Megatron module it meets.

Saving has two halves, so that the training loop does not wait for the write:
- `snapshot` (the loop's thread): the sharded state dict, with the distributed optimizer's shards
  gathered into each parameter's shape onto DP rank 0 (Megatron's `fully_reshardable` form, over
  the gloo DP group), every tensor copied to host memory;
- `write` (a background thread): torch.distributed.checkpoint saves the copies, its collectives on
  a process group of its own, so they never interleave with the loop's.
The directory is Megatron's own format (`metadata.json`, `common.pt`, DCP's `.metadata` and
`__{rank}_{i}.distcp`), which `dist_checkpointing.load` reads.

`load` reads the model through Megatron and the optimizer's tensors by their names
(`optimizer.state.{param,exp_avg,exp_avg_sq}.<model tensor>`: the distributed optimizer and
the plain one name them alike), then puts them into this run's optimizer as models/reshard.py
does for any layout: so the distributed optimizer may be switched on or off, and the experts'
optimizer (its own only under EP) may come and go.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch

# The distributed optimizer's state in each parameter's own shape whatever the DP size, gathered
# over the gloo DP group onto DP rank 0 in host memory (Megatron's other mode all-gathers it onto
# every rank's GPU), named without the chained optimizers' index (EP chains one for the experts).
_OPTIMIZER = {"distrib_optim_sharding_type": "fully_reshardable",
              "distrib_optim_fully_reshardable_mem_efficient": True, "chained_optim_avoid_prefix": True}
_MAIN_WEIGHT = ("param", "fp32_param")  # the distributed optimizer's name, the 16-bit plain one's
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


def snapshot(trainer) -> tuple[dict, dict]:
    """(sharded part with every tensor copied to host memory, common part): what `write` saves.
    Collective over the run's groups (the optimizer's gather, Megatron's sharding checks)."""
    from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor
    from megatron.core.dist_checkpointing.state_dict_utils import save_preprocess

    from models.optimizer import inner_optimizers

    model = model_sharded_state(trainer.module)
    state = {"model": model,
             "optimizer": trainer.optimizer.sharded_state_dict(model, is_loading=False, metadata=dict(_OPTIMIZER)),
             "optimizer_kind": {"distributed": trainer.cfg.distributed_optimizer,
                                "inner": len(inner_optimizers(trainer.optimizer)), "step": _adam_step(trainer.optimizer),
                                "megatron": trainer.optimizer.state_dict() if trainer.cfg.distributed_optimizer else None}}
    sharded, common = save_preprocess(state)

    def to_host(x):
        if isinstance(x, ShardedTensor):
            x.data = x.data.detach().to("cpu", copy=True)
        elif isinstance(x, ShardedObject):
            x.data = copy.deepcopy(x.data)
        return x

    dict_list_map_inplace(to_host, sharded)
    return sharded, _host_copy(common)


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


def write(snap: tuple[dict, dict], out: Path, group, rank: int) -> None:
    """Save a `snapshot` to the directory `out` (every rank of the run, each its part), in
    Megatron's torch_dist format. Collective over `group` only."""
    import torch.distributed.checkpoint as dcp
    from megatron.core.dist_checkpointing.core import CheckpointingConfig, save_config
    from megatron.core.dist_checkpointing.strategies.torch import (
        MCoreSavePlanner,
        _replace_state_dict_keys_with_sharded_keys,
        mcore_to_pyt_state_dict,
    )

    sharded, common = snap
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    keyed, _, _ = _replace_state_dict_keys_with_sharded_keys(sharded, keep_only_main_replica=True)
    dcp.save(mcore_to_pyt_state_dict(keyed, False), storage_writer=dcp.FileSystemWriter(str(out)),
             planner=MCoreSavePlanner(dedup_replicated_tensors=False, flatten_state_dict=False),
             process_group=group)
    if rank == 0:
        torch.save(common, out / "common.pt")
        save_config(CheckpointingConfig("torch_dist", 1, "torch", 1), str(out))


def saved_keys(path: Path) -> set[str]:
    """The global tensors a checkpoint directory holds."""
    import torch.distributed.checkpoint as dcp

    return set(dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata)


def load(trainer, path: Path, optimizer: bool = True) -> None:
    """This rank's model and (with `optimizer`) optimizer state from a directory `write` wrote,
    whatever layout wrote it. Collective over the run's groups."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.optimizer import make_sharded_optimizer_tensor

    from models.reshard import load_whole

    module = trainer.module
    model = model_sharded_state(module)
    held = saved_keys(path)
    main = next((k for k in _MAIN_WEIGHT if any(h.startswith(f"optimizer.state.{k}.") for h in held)), None)
    entry = _entries_by_param(model)
    wanted = {}
    for name, p in module.named_parameters():
        if p.requires_grad and optimizer:
            keys = (*_KEYS, main) if main else _KEYS
            wanted[name] = {k: make_sharded_optimizer_tensor(entry[p], torch.empty(p.shape, dtype=torch.float32),
                                                             prefix=f"optimizer.state.{k}") for k in keys}
    state = dist_checkpointing.load({"model": model, "optimizer_tensors": wanted}, str(path))
    module.load_state_dict(state["model"])
    if not optimizer:
        return
    kind = state["optimizer_kind"]
    whole = {}
    for name, p in module.named_parameters():
        if name in wanted:
            loaded = state["optimizer_tensors"][name]
            weight = loaded.pop(main) if main else p.detach()  # fp32 without the distributed optimizer
            whole[name] = {"param": weight.float().reshape(-1).clone(),
                           **{k: v.reshape(-1).clone() for k, v in loaded.items()}}
    load_whole(trainer, whole, kind)


def _entries_by_param(model: dict) -> dict:
    """Each parameter's entry (ShardedTensor or factory) in a model's sharded state dict."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values

    return {v.data: v for v in nested_values(model) if isinstance(getattr(v, "data", None), torch.nn.Parameter)}


def snapshot_tensors(snap: tuple[dict, dict]) -> dict:
    """A `snapshot`'s tensors, each named by its global key and offset, and its common part: what
    a checksum of the state this rank writes covers."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    sharded, common = snap
    tensors = {f"{v.key}@{tuple(v.global_offset)}": v.data for v in nested_values(sharded)
               if isinstance(v, ShardedTensor)}
    return {"sharded": tensors, "common": common}


def files_of(path: Path, rank: int) -> list[Path]:
    """The files of a distributed checkpoint directory that rank `rank` wrote: its DCP data files,
    and the first rank's metadata and common state too."""
    path = Path(path)
    mine = sorted(path.glob(f"__{rank}_*.distcp"))
    if rank == 0:
        mine += [path / n for n in (".metadata", "common.pt", "metadata.json")]
    return mine
