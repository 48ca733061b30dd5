"""The optimizer's state carried to another DP size, or between the distributed optimizer and the
plain one.

Megatron's distributed optimizer gives each DP rank a contiguous range of each gradient bucket;
the fp32 main weights and Adam moments a rank steps are 1-D slices of whole parameters, and
where those slices fall depends on the DP size. A rank's checkpoint therefore names, beside its
shards, which parameter and which element range each shard is (`shard_places`). Resuming at
another DP size puts every parameter's state together from the old ranks' shards (`stitch`)
and cuts it again as this rank's optimizer owns it (`cut`), in the form
`VLMTrainer.load_optimizer_state` reads: no format of our own beside Megatron's, and the same
load path as a resume at the same size. A conversion through HF names (yatt_mm/rl/relayout.py)
goes through the same whole form: `plain_whole` and `load_plain` are its two ends for Megatron's
optimizer without sharding, where each rank holds every parameter of its shard of the model whole.
"""

from __future__ import annotations

import torch

Whole = dict[str, dict[str, torch.Tensor]]  # parameter name -> {"param", "exp_avg", ...} (1-D, whole)


def shard_places(opt, module) -> list[list]:
    """[name, start, end] of each main-weight shard of a Megatron DistributedOptimizer `opt`, in
    its param groups' order (the order of the torch optimizer's state indices)."""
    names = {p: n for n, p in module.named_parameters()}
    at = {place: p for p, place in opt.model_param_group_index_map.items()}  # (group, order) -> model param
    out = []
    for g, group in enumerate(opt.optimizer.param_groups):
        for o in range(len(group["params"])):
            p = at[(g, o)]
            r = opt._get_model_param_range_map(p)["param"]
            out.append([names[p], int(r.start), int(r.end)])
    return out


def stitch(shards: list[dict], numel: dict[str, int]) -> tuple[Whole, torch.Tensor | None]:
    """Whole parameters' main weights and Adam moments from one inner optimizer's shards of
    every old DP rank (each {"state", "params", "places"}), and Adam's step count."""
    whole: Whole = {}
    step = None
    for shard in shards:
        adam = shard["state"]["state"]
        for j, (name, start, end) in enumerate(shard["places"]):
            moments = {k: v for k, v in adam.get(j, {}).items() if k != "step"}
            step = adam.get(j, {}).get("step", step)
            for key, v in {"param": shard["params"][j], **moments}.items():
                buf = whole.setdefault(name, {}).setdefault(key, torch.zeros(numel[name], dtype=v.dtype))
                buf[start:end] = v.reshape(-1)
    return whole, step


def cut(whole: Whole, step: torch.Tensor | None, opt, module) -> dict:
    """This rank's shard of one inner optimizer, as `optimizer_state()` writes it."""
    places = shard_places(opt, module)
    state, params = {}, []
    for j, (name, start, end) in enumerate(places):
        params.append(whole[name]["param"][start:end].clone())
        moments = {k: v[start:end].clone() for k, v in whole[name].items() if k != "param"}
        if moments and step is not None:  # a parameter Adam has stepped
            state[j] = {"step": step.clone(), **moments}
    groups = opt.optimizer.state_dict()["param_groups"]  # this rank's params, the run's hyperparameters
    return {"state": {"state": state, "param_groups": groups}, "params": params, "places": places}


def reshard(saved: list[dict], optimizer, module, inner: list) -> dict:
    """This rank's optimizer state from `saved`, the states written by every old DP rank of this
    rank's TP/PP position (their `optimizer_state()`), in DP order."""
    numel = {n: p.numel() for n, p in module.named_parameters()}
    optimizer.load_state_dict(saved[0]["megatron"])  # hyperparameters first: `cut` keeps this rank's
    shards = []
    for i, opt in enumerate(inner):
        whole, step = stitch([s["shards"][i] for s in saved], numel)
        shards.append(cut(whole, step, opt, module))
    return {"megatron": saved[0]["megatron"], "shards": shards}


def _main_params(opt, module) -> list[tuple[str, torch.Tensor]]:
    """(name, main weight) of each parameter a Megatron optimizer without sharding steps, in its
    torch optimizer's index order: the parameters themselves (FP32Optimizer; the fp32 ones of
    mixed precision), or the fp32 copies of the 16-bit ones (Float16OptimizerWithFloat16Params)."""
    names = {p: n for n, p in module.named_parameters()}
    model_of = {}
    model_groups, main_groups = getattr(opt, "float16_groups", []), getattr(opt, "fp32_from_float16_groups", [])
    for model_group, main_group in zip(model_groups, main_groups):
        model_of.update(zip(main_group, model_group))
    return [(names[model_of.get(p, p)], p) for g in opt.optimizer.param_groups for p in g["params"]]


def plain_whole(opt, module) -> tuple[Whole, torch.Tensor | None]:
    """Each parameter's main weight and Adam moments (1-D) held by a Megatron optimizer without
    sharding `opt`, and Adam's step count."""
    whole: Whole = {}
    step = None
    for name, p in _main_params(opt, module):
        adam = opt.optimizer.state.get(p, {})
        step = adam.get("step", step)
        whole[name] = {"param": p.detach().reshape(-1).clone(),
                       **{k: v.reshape(-1).clone() for k, v in adam.items() if k != "step"}}
    return whole, step


def load_plain(whole: Whole, step: torch.Tensor | None, opt, module) -> None:
    """`whole` into a Megatron optimizer without sharding `opt`: its main weights, and Adam's state
    through torch's own load_state_dict (with this run's hyperparameters)."""
    adam = opt.optimizer.state_dict()
    adam["state"] = {}
    with torch.no_grad():
        for j, (name, p) in enumerate(_main_params(opt, module)):
            p.copy_(whole[name]["param"].view(p.shape))
            moments = {k: v.view(p.shape).clone() for k, v in whole[name].items() if k != "param"}
            if moments and step is not None:  # a parameter Adam has stepped
                adam["state"][j] = {"step": step.clone(), **moments}
    opt.optimizer.load_state_dict(adam)


def load_whole(trainer, whole: dict[str, dict[str, torch.Tensor]], meta: dict) -> None:
    """Each parameter's whole optimizer state into this run's optimizer: cut as the distributed
    optimizer shards it here, or whole into the plain one. `meta`: Adam's `step`, and how the
    saving run's optimizer was built (`distributed`, `inner` optimizers, Megatron's `megatron`
    state_dict(), which is taken where it fits this one)."""
    from models.optimizer import inner_optimizers

    inner = inner_optimizers(trainer.optimizer)
    if not trainer.cfg.distributed_optimizer:  # each rank steps its shard of the model whole
        for opt in inner:
            load_plain(whole, meta["step"], opt, trainer.module)
        return
    same = meta.get("distributed", True) and meta["inner"] == len(inner)  # the saved state_dict() fits this one
    megatron = meta["megatron"] if same else stepped_hyperparameters(inner, meta["step"])
    trainer.optimizer.load_state_dict(megatron)  # hyperparameters first: `cut` keeps this rank's
    shards = [cut(whole, meta["step"], opt, trainer.module) for opt in inner]
    trainer.load_optimizer_state({"megatron": megatron, "shards": shards})


def stepped_hyperparameters(inner: list, step: torch.Tensor) -> dict | list[dict]:
    """Megatron's state_dict() of this run's optimizer as if it had stepped `step` times: its own
    param groups (this run's hyperparameters; no schedule changes them) with Adam's step, for a
    checkpoint written without the distributed optimizer or whose layout chained another number
    of inner optimizers (under EP the experts have one of their own)."""
    states = []
    for opt in inner:
        groups = [{**{k: v for k, v in g.items() if k != "params"}, "step": float(step)}
                  for g in opt.optimizer.state_dict()["param_groups"]]
        grad_scaler = getattr(opt, "grad_scaler", None)
        states.append({"optimizer": {"param_groups": groups}}
                      | ({"grad_scaler": grad_scaler.state_dict()} if grad_scaler else {}))
    return states[0] if len(states) == 1 else states
