"""Asynchronous checkpoints of an RL run, and exact resume.

A checkpoint is taken at the end of a step, after the weight sync: the cheapest point of the
schedule (no rollout, reward or gradient is in flight, and the engine already holds the
weights). Every rank copies its state in memory (`snapshot`), and a background thread writes it
while the next step's rollout runs:

    RUN_DIR/checkpoints/step_N/
        trainer_rank{r}.pt              this rank's model shard (TP) and optimizer state
        controller_dp{d}.json           the DP group's data position (reader state) and the
                                        dynamic sampler's valid-rate estimate and buffer
        controller_dp{d}.safetensors    media of the groups waiting in that buffer
        done_rank{r}                    written last, with the rank's weights checksum

A checkpoint is complete when every rank's `done_rank*` exists; `latest_complete` picks the
newest complete one, so a crash during a write leaves the previous checkpoint in charge. The
trainer files are our own, still read back with `torch.load(weights_only=True)`: nothing in
a checkpoint is unpickled as code.
"""

from __future__ import annotations

import itertools
import json
import shutil
import threading
import time
from dataclasses import asdict
from pathlib import Path

import torch

from yatt_mm.rl.samples import Group
from yatt_mm.rl.sources import pack_prompt, unpack_prompt
from yatt_mm.engines.engine import Response


def weights_checksum(module: torch.nn.Module) -> float:
    """Sum of every parameter in float64: cheap, and any lost or partial load changes it."""
    return float(sum(p.detach().double().sum() for p in module.parameters()))


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
                "rewards": group.rewards, "reward_parts": group.reward_parts}

    state = {"source": controller.source.state_dict(), "sampler": controller.sampler.state_dict(encode)}
    return state, tensors


def load_controller_state(controller, state: dict, tensors: dict[str, torch.Tensor]) -> None:
    def decode(g: dict) -> Group:
        prefix = f"{g['index']}."
        own = {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}
        return Group(unpack_prompt(own, g["prompt"]), [Response(**r) for r in g["responses"]], g["rewards"],
                     g["reward_parts"])

    controller.source.load_state_dict(state["source"])
    controller.sampler.load_state_dict(state["sampler"], decode)


class Checkpointer:
    """Takes a rank's snapshot at once and writes it in a background thread; one write at a time.
    Also resumes a run from the newest complete checkpoint."""

    def __init__(self, root: Path, rank: int, world: int, keep: int):
        self.root, self.rank, self.world, self.keep = Path(root), rank, world, keep
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.last_write_seconds = 0.0

    def save(self, step: int, trainer, controller=None, dp_rank: int = 0) -> dict[str, float]:
        """Snapshot now (the caller's next step may change everything), write later."""
        self.wait()
        t0 = time.perf_counter()
        snapshot = {"model": _clone(trainer.module.state_dict()), "optimizer": _clone(trainer.optimizer.state_dict()),
                    "step": step, "world": self.world, "tensor_parallel": trainer.cfg.tensor_parallel,
                    "checksum": weights_checksum(trainer.module)}
        ctrl = controller_state(controller) if controller is not None else None
        seconds = time.perf_counter() - t0
        self._thread = threading.Thread(target=self._write_guarded, args=(step, snapshot, ctrl, dp_rank),
                                        name=f"checkpoint-step{step}", daemon=False)
        self._thread.start()
        return {"checkpoint/snapshot_seconds": seconds, "checkpoint/last_write_seconds": self.last_write_seconds}

    def resume(self, trainer, controller, dp_rank: int, sync_weights, logs: list[Path]) -> int:
        """Continue from the newest complete checkpoint: the trainer's weights and optimizer,
        the engine's weights (`sync_weights()`, a collective over TP), the controller's data
        position and sampler buffer. Lines of `logs` after the checkpoint's step (a crashed
        run's last steps) are dropped, so metrics and data lineage read as one run. Returns the
        step to start from (0 without a checkpoint)."""
        ckpt = latest_complete(self.root, self.world)
        if ckpt is None:
            return 0
        step = load_trainer(ckpt, trainer, self.rank, self.world)
        sync_weights()
        if controller is not None:
            load_controller(ckpt, controller, dp_rank)
        for path in logs:
            drop_lines_after(path, step)
        if self.rank == 0:
            print(f"resumed from {ckpt} (step {step})", flush=True)
        return step

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
        checksum = snapshot.pop("checksum")
        _atomic(out / f"trainer_rank{self.rank}.pt", lambda p: torch.save(snapshot, p))
        if ctrl is not None:
            state, tensors = ctrl
            _atomic(out / f"controller_dp{dp_rank}.safetensors",
                    lambda p: save_file(tensors or {"none": torch.zeros(1)}, str(p)))
            _atomic(out / f"controller_dp{dp_rank}.json", lambda p: p.write_text(json.dumps(state)))
        _atomic(out / f"done_rank{self.rank}", lambda p: p.write_text(json.dumps({"checksum": checksum})))
        self.last_write_seconds = time.perf_counter() - t0
        if self.rank == 0:
            self._prune()

    def _prune(self) -> None:
        """Keep the newest `keep` complete checkpoints, and anything newer (being written)."""
        complete = [d for d in _step_dirs(self.root) if _is_complete(d, self.world)]
        for d in complete[: max(len(complete) - self.keep, 0)]:
            shutil.rmtree(d, ignore_errors=True)


def _atomic(path: Path, write) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    write(tmp)
    tmp.replace(path)


def _step_dirs(root: Path) -> list[Path]:
    dirs = [d for d in Path(root).glob("step_*") if d.is_dir() and d.name[5:].isdigit()]
    return sorted(dirs, key=lambda d: int(d.name[5:]))


def _is_complete(d: Path, world: int) -> bool:
    return all((d / f"done_rank{r}").is_file() for r in range(world))


def latest_complete(root: Path, world: int) -> Path | None:
    done = [d for d in _step_dirs(root) if _is_complete(d, world)]
    if not done and any(Path(root).glob("step_*/done_rank*")):
        partial = sorted({len(list(d.glob("done_rank*"))) for d in _step_dirs(root)})
        raise RuntimeError(f"{root}: no checkpoint has all {world} ranks' files (found {partial} per step): "
                           "resume with the world size the run was started with")
    return done[-1] if done else None


def load_trainer(ckpt: Path, trainer, rank: int, world: int) -> int:
    """Restore this rank's model shard and optimizer state; checks the layout and the checksum."""
    state = torch.load(ckpt / f"trainer_rank{rank}.pt", map_location="cpu", weights_only=True)
    if state["world"] != world or state["tensor_parallel"] != trainer.cfg.tensor_parallel:
        raise RuntimeError(f"{ckpt} was written by {state['world']} ranks at TP {state['tensor_parallel']}; "
                           f"this run has {world} ranks at TP {trainer.cfg.tensor_parallel}")
    trainer.module.load_state_dict(state["model"])
    trainer.optimizer.load_state_dict(state["optimizer"])
    want = json.loads((ckpt / f"done_rank{rank}").read_text())["checksum"]
    got = weights_checksum(trainer.module)
    if abs(got - want) > 1e-6 * max(1.0, abs(want)):
        raise RuntimeError(f"{ckpt}: rank {rank}'s weights do not match the checksum written with them "
                           f"({got} != {want}): the checkpoint is damaged")
    return int(state["step"])


def load_controller(ckpt: Path, controller, dp_rank: int) -> None:
    from safetensors.torch import load_file

    state = json.loads((ckpt / f"controller_dp{dp_rank}.json").read_text())
    load_controller_state(controller, state, load_file(str(ckpt / f"controller_dp{dp_rank}.safetensors")))


def drop_lines_after(path: Path, step: int) -> None:
    """Keep the JSON lines of `path` whose "step" is at most `step`."""
    if path.is_file():
        kept = [ln for ln in path.read_text().splitlines(keepends=True) if json.loads(ln)["step"] <= step]
        path.write_text("".join(kept))  # the open append-mode writers go on at the new end
