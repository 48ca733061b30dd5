"""What a checkpoint holds besides its files' integrity, and how it goes back into a run: the
controller's state (data position, dynamic sampler) encoded and decoded, the trainer's weights and
optimizer state restored from a verified checkpoint at this run's layout, whatever layout wrote
it, and the LoRA base it belongs to checked first."""

from __future__ import annotations

import itertools
import json
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist

from yatt_mm.engines.engine import Response
from yatt_mm.rl.checkpoint_files import DIST_DIR, base_identity, complete_markers, is_dist, state_digest, trainer_digest
from yatt_mm.rl.layout import ResumePlan
from yatt_mm.rl.samples import Group
from yatt_mm.rl.sources import pack_prompt, unpack_prompt


def controller_state(controller) -> tuple[dict, dict[str, torch.Tensor]]:
    """The DP group's data position and dynamic-sampling state: JSON, plus the media tensors of
    the buffered groups (safetensors, never pickle)."""
    tensors: dict[str, torch.Tensor] = {}
    index = itertools.count()

    def encode(group: Group) -> dict:
        i = next(index)
        t, meta = pack_prompt(group.prompt)  # never empty: a prompt without media has a "none" tensor
        tensors.update({f"{i}.{k}": v.contiguous() for k, v in t.items()})
        return {"index": i, "prompt": meta, "responses": [asdict(r) for r in group.responses],
                "rewards": group.rewards, "reward_parts": group.reward_parts, "version": group.version}

    state = {"source": controller.source.state_dict(), "sampler": controller.sampler.state_dict(encode)}
    return state, tensors


def load_controller_state(controller, state: dict, tensors: dict[str, torch.Tensor]) -> None:
    def decode(g: dict) -> Group:
        prefix = f"{g['index']}."
        own = {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}
        return Group(unpack_prompt(own, g["prompt"]), [Response(**r) for r in g["responses"]], g["rewards"],
                     g["reward_parts"], g.get("version", 0))

    controller.source.load_state_dict(state["source"])
    controller.sampler.load_state_dict(state["sampler"], decode)


def load_controller(ckpt: Path, controller, dp_rank: int, plan: ResumePlan | None = None, dp_size: int = 1) -> None:
    """Restore DP group `dp_rank`'s data position and sampler buffer. At another DP size
    (`plan.resharded`): every old group's position goes into the re-split of the data
    (`PromptSource.resplit`), the buffered groups of old groups `plan.buffers` come here, and the
    valid-rate estimate is their mean."""
    from safetensors.torch import load_file

    if plan is None or not plan.resharded:
        d = plan.positions[0] if plan and plan.positions else dp_rank
        state = json.loads((ckpt / f"controller_dp{d}.json").read_text())
        load_controller_state(controller, state, load_file(str(ckpt / f"controller_dp{d}.safetensors")))
        return
    old = [json.loads((ckpt / f"controller_dp{d}.json").read_text()) for d in plan.positions]
    tensors, buffer = {}, []
    for d in plan.buffers:  # their groups' tensors under names of their own: "d:i.<member>"
        for k, v in load_file(str(ckpt / f"controller_dp{d}.safetensors")).items():
            tensors[f"{d}:{k}"] = v
        buffer += [g | {"index": f"{d}:{g['index']}"} for g in old[d]["sampler"]["buffer"]]
    rates = [float(s["sampler"]["valid_rate"]) for s in old]
    state = {"source": controller.source.resplit([s["source"] for s in old], dp_rank, dp_size),
             "sampler": {"valid_rate": sum(rates) / len(rates), "buffer": buffer}}
    load_controller_state(controller, state, tensors)


def load_trainer(ckpt: Path, trainer, rank: int, world: int, state: dict | None = None) -> int:
    """Restore rank `rank`'s model shard and optimizer state from a checkpoint written at the same
    layout (`state`: its trainer file as read; else read here). Returns the step."""
    if state is None:
        state = torch.load(ckpt / f"trainer_rank{rank}.pt", map_location="cpu", weights_only=True)
    if state["world"] != world:
        raise RuntimeError(f"{ckpt} was written by a run of {state['world']} ranks; this run has {world}")
    return load_trainer_as(ckpt, trainer, ResumePlan([rank]), {rank: state})[0]


def load_trainer_as(ckpt: Path, trainer, plan: ResumePlan, states: dict[int, dict]) -> tuple[int, str]:
    """Restore this rank's model shard and optimizer state as `plan` says, from the trainer
    states read (`verify_files`); checks the layout, then that the live state hashes to what was
    written (bit for bit). Returns the step and what was restored, in words."""
    if is_dist(ckpt):
        return load_dist_trainer(ckpt, trainer, plan)
    if plan.convert:
        return load_converted_trainer(ckpt, trainer, plan)
    source = plan.trainers[0]
    state = states[source]
    layout = (state["tensor_parallel"], state.get("pipeline_parallel", 1))
    if layout != (trainer.cfg.tensor_parallel, trainer.cfg.pipeline_parallel):
        raise RuntimeError(f"{ckpt} was written at TP {layout[0]} x PP {layout[1]}; this run has TP "
                           f"{trainer.cfg.tensor_parallel} x PP {trainer.cfg.pipeline_parallel}: only the number of "
                           "DP groups may change between save and resume")
    layers = list(getattr(trainer.cfg, "pipeline_layers", []))
    if state.get("pipeline_layers", []) != layers:
        raise RuntimeError(f"{ckpt} was written with policy.trainer.pipeline_layers={state.get('pipeline_layers', [])}"
                           f"; this run has {layers}: set it the same to resume")
    if state.get("distributed_optimizer", False) != trainer.cfg.distributed_optimizer:
        raise RuntimeError(f"{ckpt} was written with policy.trainer.distributed_optimizer="
                           f"{state.get('distributed_optimizer', False)}; set it the same to resume")
    check_base(ckpt, state.get("base"), base_identity(trainer))
    trainer.load_checkpoint_weights(state["model"])
    if plan.resharded and trainer.cfg.distributed_optimizer:
        trainer.load_optimizer_state(trainer.reshard_optimizer_state([states[r]["optimizer"] for r in plan.trainers]))
        if state_digest(trainer.checkpoint_weights()) != state_digest(state["model"]):
            raise RuntimeError(f"{ckpt}: the restored weights do not hash to rank {source}'s as written")
        return int(state["step"]), (f"weights bitwise as written, the distributed optimizer's state re-sharded from "
                                    f"DP {plan.saved.dp} to DP {trainer.dp_size}")
    trainer.load_optimizer_state(state["optimizer"])
    want = json.loads((ckpt / f"done_rank{source}").read_text())["sha256"]
    if trainer_digest(trainer) != want:
        raise RuntimeError(f"{ckpt}: rank {source}'s restored weights and optimizer state do not hash to what was "
                           "written with them: the checkpoint is damaged")
    return int(state["step"]), "weights and optimizer state bitwise as written"


def load_dist_trainer(ckpt: Path, trainer, plan: ResumePlan) -> tuple[int, str]:
    """Weights (with LoRA the adapter, onto the base it was trained on) and optimizer state from a
    Megatron distributed checkpoint, at this run's layout whatever layout wrote it; at the same
    layout, checked bit for bit against what was written."""
    from models import dist_ckpt

    markers = complete_markers(ckpt)
    layers = (markers[0].get("pipeline_layers", []), list(getattr(trainer.cfg, "pipeline_layers", [])))
    # the layout that wrote it, the pipeline's split of the layers included
    same = plan.saved is not None and not plan.resharded and not plan.convert and layers[0] == layers[1]
    mine = dist.get_rank() if dist.is_initialized() else 0
    check_base(ckpt, markers[mine if same else 0].get("base"), base_identity(trainer), weights=same)
    dist_ckpt.load(trainer, ckpt / DIST_DIR)
    step = int(markers[0]["step"])
    what = "the LoRA adapter and its optimizer state" if getattr(trainer, "lora", None) is not None \
        else "weights and optimizer state"
    if not same:
        split = f", pipeline_layers={layers[0]}" if layers[0] != layers[1] else ""
        return step, f"{what} read at this layout from the distributed checkpoint written at " \
                     f"{plan.saved.describe() if plan.saved else 'another layout'}{split}"
    if state_digest(dist_ckpt.snapshot_tensors(dist_ckpt.snapshot(trainer))) != markers[mine]["sha256"]:
        raise RuntimeError(f"{ckpt}: rank {mine}'s restored weights and optimizer state do not hash to what was "
                           "written with them: the checkpoint is damaged")
    return step, f"{what} bitwise as written"


def load_converted_trainer(ckpt: Path, trainer, plan: ResumePlan) -> tuple[int, str]:
    """Weights and optimizer state from the checkpoint in HF names (yatt_mm/rl/relayout.py)."""
    from yatt_mm.rl.relayout import converted_dir, load_converted

    load_converted(ckpt, trainer)
    step = int((converted_dir(ckpt) / "done").read_text().split()[1])
    which = "the distributed optimizer's" if trainer.cfg.distributed_optimizer else "the optimizer's"
    if trainer.lora is not None:
        return step, f"the LoRA adapter and {which} state converted from {plan.saved.describe()}"
    return step, f"weights and {which} state converted from {plan.saved.describe()} through HF names"


def check_base(ckpt: Path, saved: dict | None, live: dict | None, weights: bool = True) -> None:
    """A LoRA checkpoint resumes onto the base it was trained on, and only into a LoRA run of its
    rank (a full checkpoint only into a full run): else an error that says which setting differs.
    `weights`: compare the hashes of the base weights too (each rank hashes its own shard, so only
    at the layout that wrote the checkpoint; elsewhere the base's path is compared)."""
    rank = lambda base: base["lora_rank"] if base else 0  # noqa: E731
    if rank(saved) != rank(live):
        raise RuntimeError(f"{ckpt} was written with policy.lora.rank={rank(saved)}; this run has "
                           f"policy.lora.rank={rank(live)}: set it the same to resume")
    if saved and not weights and saved["path"] != live["path"]:
        raise RuntimeError(f"{ckpt} holds a LoRA adapter of the base {saved['path']}, but this run's policy.model is "
                           f"{live['path']}: resume with the base the adapter was trained on")
    if saved and weights and saved["sha256"] != live["sha256"]:
        raise RuntimeError(f"{ckpt} holds a LoRA adapter of the base {saved['path']} (weights SHA-256 "
                           f"{saved['sha256'][:12]}...), but this run's policy.model {live['path']} has other weights "
                           f"({live['sha256'][:12]}...): resume with the base the adapter was trained on")
