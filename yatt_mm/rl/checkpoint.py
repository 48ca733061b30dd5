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

Here: the `Checkpointer` (snapshot and background write, the choice of the checkpoint to resume
and the resume itself). On disk, markers and verification: checkpoint_files.py; the controller's
state and the trainer's restore at any layout: checkpoint_state.py.

For crash tests only, YATT_MM_FAULT_CHECKPOINT_PAUSE=SECONDS holds each rank's write between its
trainer file and its marker, so a test can kill a rank mid-write at a known point.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist

from yatt_mm.rl.checkpoint_files import (DIST_DIR, atomic_write, base_identity, complete_markers, file_sha256,
                                         fsync_path, incomplete_message, is_dist, state_digest, step_dirs, step_of,
                                         verify_files)
from yatt_mm.rl.checkpoint_state import controller_state, load_controller, load_trainer_as
from yatt_mm.rl.layout import Layout, ResumePlan, resume_plan


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
        dirs = list(reversed(step_dirs(self.root)))
        complete = [d for d in dirs if complete_markers(d) is not None]
        if not complete:
            for d in dirs:
                say(incomplete_message(d, self.world))
            return None, None
        failures: dict[int, str] = {}  # step -> why this rank's files do not verify
        kept: tuple[int, dict] | None = None  # the newest of this rank's that verified, as read
        bound = step_of(complete[0])
        while True:
            mine = -1
            for d in complete:
                step = step_of(d)
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
            if chosen is not None and step_of(d) <= least:
                break
            if d in complete:
                why = [f"rank {r}: {reasons[r][step_of(d)]}" for r in range(self.world) if step_of(d) in reasons[r]]
                say(f"checkpoint {d} is damaged, skipped: {'; '.join(why)}")
            else:
                say(incomplete_message(d, self.world))
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
            fsync_path(out / DIST_DIR)
            files = {f"{DIST_DIR}/{p.name}": file_sha256(p) for p in dist_ckpt.files_of(out / DIST_DIR, self.rank)}
            written = {"format": "torch_dist", "base": snapshot["base"],
                       "pipeline_layers": snapshot["pipeline_layers"], "files": files}
        else:
            digest = state_digest({"model": snapshot["model"], "optimizer": snapshot["optimizer"]})
            atomic_write(out / f"trainer_rank{self.rank}.pt", lambda p: torch.save(snapshot, p))
        if pause := float(os.environ.get("YATT_MM_FAULT_CHECKPOINT_PAUSE", 0)):
            time.sleep(pause)  # crash tests: a window to kill the rank mid-write
        if ctrl is not None:
            state, tensors = ctrl
            atomic_write(out / f"controller_dp{dp_rank}.safetensors",
                    lambda p: save_file(tensors or {"none": torch.zeros(1)}, str(p)))
            atomic_write(out / f"controller_dp{dp_rank}.json", lambda p: p.write_text(json.dumps(state)))
        fsync_path(out)
        atomic_write(marker, lambda p: p.write_text(json.dumps(
            {"attempt": self.attempt, "world": self.world, "step": step, "sha256": digest,
             "layout": asdict(self.layout)} | written)))
        fsync_path(out)
        self.last_write_seconds = time.perf_counter() - t0
        if self.rank == 0:
            self._prune()

    def _prune(self) -> None:
        """Keep the newest `keep` complete checkpoints, and anything newer (being written)."""
        complete = [d for d in step_dirs(self.root) if complete_markers(d) is not None]
        for d in complete[: max(len(complete) - self.keep, 0)]:
            shutil.rmtree(d, ignore_errors=True)


class NoUsableCheckpoint(RuntimeError):
    """The run has complete checkpoints, and every one failed to verify on some rank."""


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


def _clone(obj):
    """A deep copy whose tensors no longer share storage with the live ones (CPU on GPUs)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _clone(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_clone(v) for v in obj)
    return obj


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
