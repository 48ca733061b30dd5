"""A checkpoint as it lies on disk, and whether it is whole: the markers each rank writes last
(`done_rank{r}`), which checkpoints are complete, the digests and SHA-256s that a resume checks
the files against, and the write that never shows a partial file. The layout of a step's
directory and the order of its writes: yatt_mm/rl/checkpoint.py."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch

from yatt_mm.rl.layout import ResumePlan


def state_digest(state: dict) -> str:
    """SHA-256 over the names, dtypes, shapes and bytes of every tensor in a (nested) state dict:
    equal digests mean bitwise equal tensors."""
    h = hashlib.sha256()

    def visit(prefix: str, obj) -> None:
        if isinstance(obj, torch.Tensor):
            t = obj.detach().to("cpu").contiguous().reshape(-1)
            h.update(f"{prefix}:{t.dtype}:{tuple(obj.shape)}".encode())
            h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        elif isinstance(obj, dict):
            for k in sorted(obj, key=str):
                visit(f"{prefix}.{k}", obj[k])
        elif isinstance(obj, (list, tuple)):
            for i, v in enumerate(obj):
                visit(f"{prefix}.{i}", v)

    visit("", state)
    return h.hexdigest()


def trainer_digest(trainer) -> str:
    return state_digest({"model": trainer.checkpoint_weights(), "optimizer": trainer.optimizer_state()})


def base_identity(trainer) -> dict | None:
    """With LoRA, the frozen base a checkpoint's adapter belongs to: the policy's directory and
    the SHA-256 of the base weights this rank holds (its TP shard of its stage; hashed once per
    run: the base never changes). None without LoRA (the checkpoint holds every weight)."""
    if getattr(trainer, "lora", None) is None:
        return None
    if getattr(trainer, "_base_sha256", None) is None:
        from models.lora import frozen_state

        trainer._base_sha256 = state_digest(frozen_state(trainer.module))
    return {"path": str(trainer.hf_dir), "sha256": trainer._base_sha256, "lora_rank": trainer.lora.rank}


def atomic_write(path: Path, write) -> None:
    """Write under a temporary name, fsync, rename: the name never shows a partial file."""
    tmp = path.with_name(f".{path.name}.tmp")
    write(tmp)
    fsync_path(tmp)
    tmp.replace(path)


def fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def step_dirs(root: Path) -> list[Path]:
    dirs = [d for d in Path(root).glob("step_*") if d.is_dir() and d.name[5:].isdigit()]
    return sorted(dirs, key=lambda d: int(d.name[5:]))


def step_of(d: Path) -> int:
    return int(d.name[5:])


def _markers(d: Path) -> dict[int, dict]:
    """Every readable marker of `d`, by the rank its name gives."""
    out = {}
    for m in d.glob("done_rank*"):
        if not m.name[9:].isdigit():
            continue
        try:
            out[int(m.name[9:])] = json.loads(m.read_text())
        except (OSError, ValueError):  # not ours to judge here: the checkpoint counts as partial
            continue
    return out


def complete_markers(d: Path) -> dict[int, dict] | None:
    """The markers of the attempt (one launch) that finished `d` on every one of its ranks, by
    rank; None when no attempt did. A marker says how many ranks its attempt had, so a
    checkpoint written at another world size is complete too (resume decides whether it fits).
    Each rank removes its old marker before it writes, so two attempts can never both be whole
    (rank 0 is in every attempt)."""
    by_attempt: dict[str, dict[int, dict]] = {}
    for rank, m in _markers(d).items():
        by_attempt.setdefault(str(m.get("attempt")), {})[rank] = m
    for markers in by_attempt.values():
        worlds = {m.get("world") for m in markers.values()}
        if len(worlds) == 1 and set(markers) == set(range(worlds.pop() or 0)):
            return markers
    return None


def incomplete_message(d: Path, world: int) -> str:
    markers = list(_markers(d).values())
    attempts = len({m.get("attempt") for m in markers})
    world = max([m.get("world") or 0 for m in markers] + [0]) or world
    return (f"checkpoint {d} is incomplete ({len(markers)} of {world} ranks' markers"
            + (f", from {attempts} different attempts" if attempts > 1 else "") + "): skipped")


def latest_complete(root: Path, world: int, say=print) -> Path | None:
    """The newest checkpoint every rank of one attempt finished. Partial ones (a crash mid-write,
    or markers of different attempts) are skipped, and `say` tells which (`world`: the ranks
    expected when no marker says)."""
    for d in reversed(step_dirs(root)):
        if complete_markers(d) is not None:
            return d
        say(incomplete_message(d, world))
    return None


DIST_DIR = "trainer"  # a full-weight trainer's Megatron distributed checkpoint, in each step's directory


def is_dist(ckpt: Path) -> bool:
    """Whether `ckpt` holds its trainer state as a Megatron distributed checkpoint."""
    markers = complete_markers(ckpt) or _markers(ckpt)
    return any(m.get("format") == "torch_dist" for m in markers.values())


def verify_files(ckpt: Path, plan: ResumePlan, controller: bool,
                 share: tuple[int, int] = (0, 1)) -> tuple[dict[int, dict] | None, str | None]:
    """(the trainer states `plan` reads, by rank, None) when its files in `ckpt` are whole, else
    (None, why not): each trainer file reads and hashes to the SHA-256 of its rank's marker (a
    distributed checkpoint: the files of every old rank r with r % ranks == rank, `share` =
    (rank, ranks), hash to their marker's list); with `controller`, the controller files of the
    DP groups it reads are there and read."""
    from safetensors.torch import load_file

    states = {}
    distributed = is_dist(ckpt)
    if distributed and (reason := verify_dist_files(ckpt, *share)) is not None:
        return None, reason
    for rank in ([] if distributed else plan.trainers):
        state, reason = verify_trainer_file(ckpt, rank)
        if reason is not None:
            return None, reason
        states[rank] = state
    if controller:
        members = [(f"controller_dp{d}.json", lambda p: json.loads(p.read_text())) for d in plan.positions]
        members += [(f"controller_dp{d}.safetensors", lambda p: load_file(str(p))) for d in plan.buffers]
        for member, read in members:
            if not (ckpt / member).is_file():
                return None, f"{member} is missing"
            try:
                read(ckpt / member)
            except Exception as e:
                return None, f"{member} cannot be read (truncated or damaged: {_short(e)})"
    return states, None


def verify_dist_files(ckpt: Path, rank: int, ranks: int) -> str | None:
    """None when the files the old ranks r with r % `ranks` == `rank` wrote to the distributed
    checkpoint are there and hash to their markers' SHA-256s, else why not."""
    markers = complete_markers(ckpt) or {}
    for old in sorted(r for r in markers if r % ranks == rank):
        for name, want in markers[old].get("files", {}).items():
            path = ckpt / name
            if not path.is_file():
                return f"{name} is missing"
            if file_sha256(path) != want:
                return f"{name} does not hash to the SHA-256 in done_rank{old}: its contents changed after writing"
    return None


def verify_trainer_file(ckpt: Path, rank: int) -> tuple[dict | None, str | None]:
    """(rank `rank`'s trainer state as read, None) when its file reads and hashes to its marker's
    SHA-256, else (None, why not)."""
    name = f"trainer_rank{rank}.pt"
    path = ckpt / name
    if not path.is_file():
        return None, f"{name} is missing"
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # torch reports a cut file as a zip reader failure, among others
        return None, f"{name} cannot be read (truncated or damaged: {_short(e)})"
    lacking = [k for k in ("model", "optimizer", "step", "world", "tensor_parallel")
               if not isinstance(state, dict) or k not in state]
    if lacking:
        return None, f"{name} lacks {', '.join(lacking)}"
    try:
        want = json.loads((ckpt / f"done_rank{rank}").read_text())["sha256"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        return None, f"done_rank{rank} holds no SHA-256 of the trainer state ({_short(e)})"
    if state_digest({"model": state["model"], "optimizer": state["optimizer"]}) != want:
        return None, f"{name} does not hash to the SHA-256 in done_rank{rank}: its contents changed after writing"
    return state, None


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    return h.hexdigest()


def _short(e: BaseException) -> str:
    """An exception as one short line: its first sentence (torch's reader errors go on with
    several more of general advice), at most 200 characters."""
    text = " ".join(str(e).split()) or type(e).__name__
    first, dot, rest = text.partition(". ")
    text = first + "." if dot and len(first) >= 20 else text
    return text if len(text) <= 200 else text[:197] + "..."
