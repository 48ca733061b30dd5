"""Asynchronous checkpoints of an RL run, and exact resume.

A checkpoint is taken at the end of a step, after the weight sync: the cheapest point of the
schedule (no rollout, reward or gradient is in flight, and the engine already holds the
weights). Every rank copies its state in memory (`snapshot`), and a background thread writes it
while the next step's rollout runs:

    RUN_DIR/checkpoints/step_N/
        trainer/                        run.checkpoint_format=torch_dist (the default): the weights
                                        (with LoRA the adapter) and optimizer state of every rank as
                                        one Megatron-Core distributed checkpoint (models/dist_ckpt.py)
        trainer_rank{r}.pt              or, per_rank: this rank's model shard (TP) and optimizer
                                        state (with LoRA the adapter's shard and its state)
        controller_dp{d}.json           the DP group's data position (reader state) and the
                                        dynamic sampler's valid-rate estimate and buffer
        controller_dp{d}.safetensors    media of the groups waiting in that buffer
        done_rank{r}                    written last: the attempt's id, the world size and the
                                        layout (DP, TP, PP, CP, EP sizes, the optimizer setting), a
                                        SHA-256 of the state the rank wrote, with LoRA the frozen
                                        base (path, SHA-256 of the rank's base weights), and for
                                        torch_dist the rank's files in trainer/ with their SHA-256

Every file is written and fsynced (per-rank and controller files under a temporary name, then
renamed; the distributed checkpoint's by torch.distributed.checkpoint, its `.metadata` last), and
the directory fsynced, before the marker is (itself the same way): a marker on disk means its
files are. A checkpoint
is complete when every rank of one attempt (one launch of the run, of the world size its markers
name) left its marker, so markers left by a crashed attempt never complete a checkpoint that a
later attempt rewrites. `latest_complete` picks the newest complete one and says which partial
ones it skips.

A run may resume at another layout (`resume_plan`): each controller reads every old group's data
position (re-split by dataio/resplit.py). A distributed checkpoint is read at the new layout
directly. Per-rank files: at another number of DP groups each rank reads the files of its TP/PP
place (with the distributed optimizer, every old DP rank's there, re-sharded by models/reshard.py);
at another TP, PP, CP or EP size, or with the distributed optimizer switched, the checkpoint is
converted once through HF names (yatt_mm/rl/relayout.py).

A complete checkpoint can still be damaged after the fact (a disk or a copy that cut a file
short, a file edited or lost): resume verifies each rank's own files before it trusts them (a
distributed checkpoint's files hash to the SHA-256s their writer's marker lists, spread over the
ranks; a trainer file loads and hashes to its marker's SHA-256; the controller files are there and read),
and all ranks agree on the newest checkpoint that verified on every one of them
(`Checkpointer.choose`); each one skipped is named once with every failing rank's reason, and a
run whose complete checkpoints all fail stops with `NoUsableCheckpoint` instead of starting over
on top of them. After loading, the live weights and optimizer state are hashed once more against
the marker. Per-rank trainer files are read back with `torch.load(weights_only=True)`; a
distributed checkpoint's `.metadata` is a pickle (torch.distributed.checkpoint's own format), so
a run resumes only checkpoints it can trust, as with any PyTorch checkpoint of that format.

For crash tests only, YATT_MM_FAULT_CHECKPOINT_PAUSE=SECONDS holds each rank's write between its
trainer file and its marker, so a test can kill a rank mid-write at a known point.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import shutil
import threading
import time
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist

from yatt_mm.rl.layout import Layout, ResumePlan, resume_plan
from yatt_mm.rl.samples import Group
from yatt_mm.rl.sources import pack_prompt, unpack_prompt
from yatt_mm.engines.engine import Response


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


def _clone(obj):
    """A deep copy whose tensors no longer share storage with the live ones (CPU on GPUs)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _clone(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_clone(v) for v in obj)
    return obj


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


class Checkpointer:
    """Takes a rank's snapshot at once and writes it in a background thread; one write at a time.
    Also resumes a run from the newest complete checkpoint."""

    def __init__(self, root: Path, rank: int, world: int, keep: int, attempt: str, layout: Layout | None = None,
                 fmt: str = "per_rank"):
        self.root, self.rank, self.world, self.keep = Path(root), rank, world, keep
        self.format = fmt  # "torch_dist": a full-weight trainer's state in Megatron's distributed checkpoint
        self.attempt = attempt  # this launch's id, the same on every rank
        self.layout = layout or Layout(dp=world)
        if self.layout.world != world:
            raise ValueError(f"layout {self.layout.describe()} is not {world} ranks")
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._group = None  # the writes' own process groups (torch_dist), made at the first save
        self.last_write_seconds = 0.0

    def save(self, step: int, trainer, controller=None, dp_rank: int = 0, controller_snapshot=None) -> dict[str, float]:
        """Snapshot now (the caller's next step may change everything), write later.
        `controller_snapshot`: the controller's state as `controller_state` took it earlier (a
        rollout running ahead has moved the live one past what this step trained)."""
        self.wait()
        t0 = time.perf_counter()
        if self.format == "torch_dist":
            from models import dist_ckpt

            if self._group is None and dist.is_initialized():  # collective: every rank saves at this step
                self._group = dist_ckpt.CheckpointGroups(trainer)
            # with LoRA the adapter alone, and the base it belongs to by path and hash
            snapshot = {"dist": dist_ckpt.snapshot(trainer), "step": step, "base": base_identity(trainer),
                        "pipeline_layers": list(getattr(trainer.cfg, "pipeline_layers", []))}
        else:  # with LoRA the adapter alone, and the base it belongs to by path and hash
            snapshot = {"model": _clone(trainer.checkpoint_weights()), "optimizer": _clone(trainer.optimizer_state()),
                        "base": base_identity(trainer),
                        "step": step, "world": self.world, "tensor_parallel": trainer.cfg.tensor_parallel,
                        "pipeline_parallel": trainer.cfg.pipeline_parallel,
                        "pipeline_layers": list(getattr(trainer.cfg, "pipeline_layers", [])),
                        "distributed_optimizer": trainer.cfg.distributed_optimizer}
        ctrl = controller_snapshot or (controller_state(controller) if controller is not None else None)
        seconds = time.perf_counter() - t0
        self._thread = threading.Thread(target=self._write_guarded, args=(step, snapshot, ctrl, dp_rank),
                                        name=f"checkpoint-step{step}", daemon=False)
        self._thread.start()
        return {"checkpoint/snapshot_seconds": seconds, "checkpoint/last_write_seconds": self.last_write_seconds}

    def resume(self, trainer, controller, dp_rank: int, sync_weights, logs: list[Path], group=None) -> int:
        """Continue from the newest complete checkpoint that verifies on every rank (`choose`;
        `group`: a CPU process group of all ranks, None for a run of one process): the trainer's
        weights and optimizer, the engine's weights (`sync_weights()`, a collective over TP),
        the controller's data position and sampler buffer. Lines of `logs` after the
        checkpoint's step (a crashed run's last steps) are dropped, so metrics and data lineage
        read as one run. Returns the step to start from (0 without a checkpoint); raises
        NoUsableCheckpoint when there are complete checkpoints but none verifies."""
        ckpt, read = self.choose(controller is not None, group)
        if ckpt is None:  # a fresh start in a used run dir (a crash before the first checkpoint)
            for path in logs:
                drop_lines_after(path, -1)
            return 0
        plan, states = read
        if plan.convert and not is_dist(ckpt):  # the first rank writes it in HF names once; every rank reads it
            if self.rank == 0:
                from yatt_mm.rl.relayout import convert

                print(f"converting {ckpt} from {plan.saved.describe()} to {self.layout.describe()}", flush=True)
                convert(ckpt)
            if group is not None:
                dist.barrier(group=group)
        step, how = load_trainer_as(ckpt, trainer, plan, states)
        sync_weights()
        if controller is not None:
            load_controller(ckpt, controller, dp_rank, plan, self.layout.dp)
        for path in logs:
            drop_lines_after(path, step)
        if self.rank == 0:
            print(f"resumed from {ckpt} (step {step}; {how})", flush=True)
            if plan.resharded:
                print(f"resumed at another layout: written at {plan.saved.describe()}, now {self.layout.describe()}; "
                      f"the rest of each unfinished epoch is re-split across the {self.layout.dp} DP group(s)", flush=True)
            elif plan.convert:
                print(f"resumed at another layout: written at {plan.saved.describe()}, now {self.layout.describe()}; "
                      "the data positions are kept", flush=True)
        return step

    def choose(self, controller: bool, group=None) -> tuple[Path | None, tuple[ResumePlan, dict] | None]:
        """The newest complete checkpoint whose files verify on every rank, with this rank's
        plan and the trainer states it read (None, None: no complete checkpoint at all, a fresh
        start).

        Each rank verifies only the files it reads (`resume_plan`: its trainer file, or at
        another DP size its place's; a controller's, with `controller`, the DP groups'
        controller files it reads), newest first, and stops at the first that
        verifies: reading every checkpoint would cost as many loads of the model. The ranks
        then agree by all-reduce on the least and the greatest of their answers; while they
        differ, each looks again at or below the least. The answers only fall, so this ends,
        at the newest checkpoint that every rank verified (or none). Rank 0 then names each
        newer one skipped and why, with every rank's reasons gathered."""
        say = print if self.rank == 0 else (lambda _: None)
        dirs = list(reversed(_step_dirs(self.root)))
        complete = [d for d in dirs if complete_markers(d) is not None]
        if not complete:
            for d in dirs:
                say(_incomplete_message(d, self.world))
            return None, None
        failures: dict[int, str] = {}  # step -> why this rank's files do not verify
        kept: tuple[int, dict] | None = None  # the newest of this rank's that verified, as read
        bound = _step(complete[0])
        while True:
            mine = -1
            for d in complete:
                step = _step(d)
                if step > bound or step in failures:
                    continue
                if kept is not None and kept[0] == step:
                    mine = step
                    break
                plan = self._plan(d)
                states, reason = verify_files(d, plan, controller, (self.rank, self.world))
                if reason is None:
                    kept, mine = (step, (plan, states)), step
                    break
                failures[step] = reason
            least, greatest = _agree(mine, group)
            if least == greatest:
                break
            bound = least
        chosen = self.root / f"step_{least}" if least >= 0 else None
        reasons = _gather(failures, group, self.world)
        for d in dirs:
            if chosen is not None and _step(d) <= least:
                break
            if d in complete:
                why = [f"rank {r}: {reasons[r][_step(d)]}" for r in range(self.world) if _step(d) in reasons[r]]
                say(f"checkpoint {d} is damaged, skipped: {'; '.join(why)}")
            else:
                say(_incomplete_message(d, self.world))
        if chosen is None:
            raise NoUsableCheckpoint(
                f"no checkpoint in {self.root} can be resumed: all {len(complete)} complete one(s) are damaged "
                f"({', '.join(d.name for d in complete)}; the reasons are above). Restore them from a copy, or "
                f"remove {self.root} to start this run over from step 0")
        return chosen, kept[1]  # this rank's answer was the agreed one: its state is kept

    def _plan(self, ckpt: Path) -> ResumePlan:
        markers = complete_markers(ckpt)
        saved = markers[0].get("layout")
        if saved is None:  # written before checkpoints recorded their layout: the same world only
            if markers[0]["world"] != self.world:
                raise RuntimeError(f"{ckpt} was written by a run of {markers[0]['world']} ranks; this run has "
                                   f"{self.world}: resume with the world size the run was started with")
            return ResumePlan([self.rank], [self.layout.place(self.rank)[2]], [self.layout.place(self.rank)[2]])
        return resume_plan(Layout(**saved), self.layout, self.rank)

    def wait(self) -> None:
        """Block until the write in flight is on disk; re-raise its failure here, in the loop."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError(f"writing a checkpoint failed on rank {self.rank}: {error}") from error

    def _write_guarded(self, *args) -> None:
        try:
            self._write(*args)
        except BaseException as e:  # surfaced by wait() in the training loop
            self._error = e

    def _write(self, step: int, snapshot: dict, ctrl: tuple[dict, dict] | None, dp_rank: int) -> None:
        from safetensors.torch import save_file

        t0 = time.perf_counter()
        out = self.root / f"step_{step}"
        out.mkdir(parents=True, exist_ok=True)
        marker = out / f"done_rank{self.rank}"
        marker.unlink(missing_ok=True)  # a crashed attempt's, about to be stale
        written = {}
        if "dist" in snapshot:
            from models import dist_ckpt

            digest = state_digest(dist_ckpt.snapshot_tensors(snapshot["dist"]))
            dist_ckpt.write(snapshot["dist"], out / DIST_DIR, self._group, self.rank)
            _fsync(out / DIST_DIR)
            files = {f"{DIST_DIR}/{p.name}": _file_sha256(p) for p in dist_ckpt.files_of(out / DIST_DIR, self.rank)}
            written = {"format": "torch_dist", "base": snapshot["base"],
                       "pipeline_layers": snapshot["pipeline_layers"], "files": files}
        else:
            digest = state_digest({"model": snapshot["model"], "optimizer": snapshot["optimizer"]})
            _atomic(out / f"trainer_rank{self.rank}.pt", lambda p: torch.save(snapshot, p))
        if pause := float(os.environ.get("YATT_MM_FAULT_CHECKPOINT_PAUSE", 0)):
            time.sleep(pause)  # crash tests: a window to kill the rank mid-write
        if ctrl is not None:
            state, tensors = ctrl
            _atomic(out / f"controller_dp{dp_rank}.safetensors",
                    lambda p: save_file(tensors or {"none": torch.zeros(1)}, str(p)))
            _atomic(out / f"controller_dp{dp_rank}.json", lambda p: p.write_text(json.dumps(state)))
        _fsync(out)
        _atomic(marker, lambda p: p.write_text(json.dumps(
            {"attempt": self.attempt, "world": self.world, "step": step, "sha256": digest,
             "layout": asdict(self.layout)} | written)))
        _fsync(out)
        self.last_write_seconds = time.perf_counter() - t0
        if self.rank == 0:
            self._prune()

    def _prune(self) -> None:
        """Keep the newest `keep` complete checkpoints, and anything newer (being written)."""
        complete = [d for d in _step_dirs(self.root) if complete_markers(d) is not None]
        for d in complete[: max(len(complete) - self.keep, 0)]:
            shutil.rmtree(d, ignore_errors=True)


def _atomic(path: Path, write) -> None:
    """Write under a temporary name, fsync, rename: the name never shows a partial file."""
    tmp = path.with_name(f".{path.name}.tmp")
    write(tmp)
    _fsync(tmp)
    tmp.replace(path)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _step_dirs(root: Path) -> list[Path]:
    dirs = [d for d in Path(root).glob("step_*") if d.is_dir() and d.name[5:].isdigit()]
    return sorted(dirs, key=lambda d: int(d.name[5:]))


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


def _step(d: Path) -> int:
    return int(d.name[5:])


def _incomplete_message(d: Path, world: int) -> str:
    markers = list(_markers(d).values())
    attempts = len({m.get("attempt") for m in markers})
    world = max([m.get("world") or 0 for m in markers] + [0]) or world
    return (f"checkpoint {d} is incomplete ({len(markers)} of {world} ranks' markers"
            + (f", from {attempts} different attempts" if attempts > 1 else "") + "): skipped")


def latest_complete(root: Path, world: int, say=print) -> Path | None:
    """The newest checkpoint every rank of one attempt finished. Partial ones (a crash mid-write,
    or markers of different attempts) are skipped, and `say` tells which (`world`: the ranks
    expected when no marker says)."""
    for d in reversed(_step_dirs(root)):
        if complete_markers(d) is not None:
            return d
        say(_incomplete_message(d, world))
    return None


class NoUsableCheckpoint(RuntimeError):
    """The run has complete checkpoints, and every one failed to verify on some rank."""


def _short(e: BaseException) -> str:
    """An exception as one short line: its first sentence (torch's reader errors go on with
    several more of general advice), at most 200 characters."""
    text = " ".join(str(e).split()) or type(e).__name__
    first, dot, rest = text.partition(". ")
    text = first + "." if dot and len(first) >= 20 else text
    return text if len(text) <= 200 else text[:197] + "..."


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


DIST_DIR = "trainer"  # a full-weight trainer's Megatron distributed checkpoint, in each step's directory


def is_dist(ckpt: Path) -> bool:
    """Whether `ckpt` holds its trainer state as a Megatron distributed checkpoint."""
    markers = complete_markers(ckpt) or _markers(ckpt)
    return any(m.get("format") == "torch_dist" for m in markers.values())


def verify_dist_files(ckpt: Path, rank: int, ranks: int) -> str | None:
    """None when the files the old ranks r with r % `ranks` == `rank` wrote to the distributed
    checkpoint are there and hash to their markers' SHA-256s, else why not."""
    markers = complete_markers(ckpt) or {}
    for old in sorted(r for r in markers if r % ranks == rank):
        for name, want in markers[old].get("files", {}).items():
            path = ckpt / name
            if not path.is_file():
                return f"{name} is missing"
            if _file_sha256(path) != want:
                return f"{name} does not hash to the SHA-256 in done_rank{old}: its contents changed after writing"
    return None


def _file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    return h.hexdigest()


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


def _agree(mine: int, group) -> tuple[int, int]:
    """The least and the greatest of every rank's `mine` (one all-reduce)."""
    if group is None:
        return mine, mine
    both = torch.tensor([-mine, mine], dtype=torch.int64)
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
    return -int(both[0]), int(both[1])


def _gather(failures: dict[int, str], group, world: int) -> list[dict[int, str]]:
    """Every rank's failures, by rank (rank 0 names them all)."""
    if group is None:
        return [failures]
    out: list = [None] * world
    dist.all_gather_object(out, failures, group=group)
    return out


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


def drop_lines_after(path: Path, step: int) -> None:
    """Keep the JSON lines of `path` whose "step" is at most `step` (-1: none). A torn last line
    (a process killed mid-write) is dropped too; a torn line elsewhere is an error."""
    if not path.is_file():
        return
    lines = path.read_text().splitlines(keepends=True)
    kept = []
    for i, line in enumerate(lines):
        try:
            record = json.loads(line)
        except ValueError:
            if i == len(lines) - 1:
                break
            raise RuntimeError(f"{path}: line {i + 1} is not JSON; the log is damaged") from None
        if record["step"] <= step:
            kept.append(line if line.endswith("\n") else line + "\n")
    path.write_text("".join(kept))  # the open append-mode writers go on at the new end
