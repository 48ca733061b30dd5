"""A controller's vLLM engines in a process of their own (placement `disaggregated`).

The rank that controls a DP group starts one worker; the worker holds the group's rollout engine
and its in-process GenRM judges' engines, and the rank reaches each through a `RemoteEngine`,
which has the methods of `RolloutEngine` the loop calls. So the next step's rollout
(run.max_staleness, yatt_mm/rl/rollout_ahead.py) runs its vLLM work in another interpreter than
the trainer: the rank's rollout thread mostly waits on a pipe, and the GIL no longer serialises
vLLM's scheduler with Megatron's step. Media still go only from the rank that read them to its
own worker.

Two channels per worker:
- a local connection (multiprocessing, an authentication key of the run's rank) carries calls,
  requests with their media, and results; pickled, as both ends are this run's own processes
  (nothing read from a shard is unpickled);
- a two-member process group carries the weights: the trainer's bucket is broadcast from the rank
  into the worker's engine. gloo on CPU; NCCL on GPUs (the worker on GPUs of its own, set by
  `run.rollout_devices`), the same code (the NCCL branch has not run on a GPU yet).

Two channels of calls too: one for generation and the chat template, one for weights, so that
new weights can reach the worker while a generation is in flight (run.partial_rollout: loaded
whole between two engine steps).

The worker runs under a supervisor (yatt_mm/processes.py) in a process group of its own, so it and
any process its vLLM starts (on GPUs, vLLM's EngineCore) die with the rank, however the rank dies:
a kill -9 of a rank leaves no engine behind to hold memory or cores.
"""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import threading
import time
import traceback
from contextlib import contextmanager
from dataclasses import asdict
from datetime import timedelta
from multiprocessing.connection import Client, Listener
from pathlib import Path
from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist

from models import runtime
from yatt_mm import processes
from yatt_mm.engines.engine import EngineConfig, GenerationResult, Request, Response, SamplingConfig
from yatt_mm.loopback import HOST as LOOPBACK
from yatt_mm.loopback import listening_socket, loopback_interface

# torchrun's variables: without them the worker's vLLM runs as a lone process (its "uni" executor)
JOB_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "ROLE_WORLD_SIZE",
           "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT",
           "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_ERROR_FILE")
KEY_ENV = "YATT_MM_WORKER_KEY"
WEIGHTS_TIMEOUT = timedelta(minutes=10)  # a weight copy waiting longer has lost its peer


def weights_backend() -> str:
    return "nccl" if runtime.has_gpu() else "gloo"


def weights_group(host: str, port: int, rank: int, listen_fd: int | None = None) -> Any:
    """The rank (0) and its worker (1), for the weight copy, listening on loopback only: the
    rank's store on `listen_fd`, a socket bound there (a TCPStore given only a host listens on
    every interface, yatt_mm/loopback.py), gloo on a device of `host`."""
    if rank == 0:
        store = dist.TCPStore(host, port, 2, True, WEIGHTS_TIMEOUT, master_listen_fd=listen_fd)
    else:
        store = dist.TCPStore(host, port, 2, False, WEIGHTS_TIMEOUT)
    if weights_backend() == "nccl":
        return dist.ProcessGroupNCCL(store, rank, 2)  # on one node: NCCL_SOCKET_IFNAME is loopback's here
    options = dist.ProcessGroupGloo._Options()
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]  # both ends on this machine
    options._timeout = WEIGHTS_TIMEOUT
    return dist.ProcessGroupGloo(store, rank, 2, options)


def broadcast_bucket(group, flat: torch.Tensor) -> None:
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    group.broadcast([flat], opts).wait()


class EngineWorker:
    """The rank's side: starts the worker process, owns the channels, stops it."""

    def __init__(self, engines: dict[str, EngineConfig], log_path: str | Path, devices: str = "",
                 startup_timeout_s: float = 600.0):
        host = LOOPBACK
        key = secrets.token_bytes(32)
        listener = Listener((host, 0), authkey=key)
        weights_socket = listening_socket(host)
        weights_port = weights_socket.getsockname()[1]
        env = {k: v for k, v in os.environ.items() if k not in JOB_ENV}
        env[KEY_ENV] = key.hex()
        # vLLM's process groups inside the worker never leave this machine: on loopback, whatever
        # the run's own interface settings (a job of several nodes sets them to its network)
        env.update(dict.fromkeys(("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"), loopback_interface()))
        env["VLLM_CONFIGURE_LOGGING"] = "1"  # its own log file, as a judge server's
        if devices:
            env["CUDA_VISIBLE_DEVICES"] = devices
        Path(log_path).parent.mkdir(parents=True, exist_ok=True)
        self.log_path = Path(log_path)
        with open(log_path, "ab") as log:  # self.proc: the worker's supervisor, which ends with the worker
            self.proc = processes.start_supervised(
                [sys.executable, "-m", "yatt_mm.engines.worker", f"{host}:{listener.address[1]}", f"{host}:{weights_port}"],
                env=env, stdout=log, stderr=subprocess.STDOUT)
        # calls; and the weights' own channel, so that new weights can reach the worker while a
        # call is in flight (partial rollout)
        self.conn, self.weights_conn = self._accept(listener, startup_timeout_s)
        self.weights = weights_group(host, weights_port, 0, listen_fd=weights_socket.detach())  # the store owns it now
        self._lock, self._weights_lock = threading.Lock(), threading.Lock()
        # run.partial_rollout: weights that arrive while any of the worker's engines generates are
        # loaded between two of its steps; a rollout in flight goes on with them
        self.partial_rollout = False
        self.started = self.call("start", engines={name: asdict(cfg) for name, cfg in engines.items()})

    def _accept(self, listener: Listener, timeout: float):
        accepted: list = []
        thread = threading.Thread(target=lambda: accepted.extend([listener.accept(), listener.accept()]), daemon=True)
        thread.start()
        deadline = time.monotonic() + timeout
        while thread.is_alive() and time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the engine worker exited with code {self.proc.returncode} at start-up; "
                                   f"see {self.log_path}")
            thread.join(0.2)
        listener.close()
        if len(accepted) < 2:
            processes.end_group(self.proc, 5.0)
            raise TimeoutError(f"the engine worker did not connect within {timeout:.0f} s; see {self.log_path}")
        return accepted

    @property
    def pids(self) -> list[int]:
        """The worker's processes: its supervisor, the worker, and what vLLM started there."""
        return processes.group_members(self.proc.pid) if self.proc.poll() is None else []

    def engine(self, name: str) -> "RemoteEngine":
        return RemoteEngine(self, name)

    def call(self, op: str, on_event: Callable[..., None] | None = None, **kwargs) -> Any:
        """One call into the worker; `on_event(*event)` sees what it streams back meanwhile."""
        return self._call(self.conn, self._lock, op, on_event, None, kwargs)

    def call_weights(self, op: str, then: Callable[[], None] | None = None, **kwargs) -> Any:
        """A call on the weights' channel; `then()` runs once it is sent (the bucket's broadcast)."""
        return self._call(self.weights_conn, self._weights_lock, op, None, then, kwargs)

    def _call(self, conn, lock, op: str, on_event, then, kwargs: dict) -> Any:
        with lock:
            try:
                conn.send((op, kwargs))
                if then is not None:
                    then()
                while True:
                    kind, *payload = conn.recv()
                    if kind == "event":
                        on_event(*payload)
                    elif kind == "result":
                        return payload[0]
                    else:
                        raise RuntimeError(f"engine worker: '{op}' failed there:\n{payload[0]}")
            except (EOFError, OSError) as e:
                raise RuntimeError(f"engine worker (pid {self.proc.pid}) is gone "
                                   f"(exit code {self.proc.poll()}) during '{op}'; see {self.log_path}") from e

    def close(self, timeout: float = 30.0) -> None:
        if self.proc.poll() is None:
            try:
                self.call("stop")
            except RuntimeError:
                pass
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        processes.end_group(self.proc, 5.0)  # whatever of its group is left


class RemoteEngine:
    """One of a worker's engines, as the loop's controllers use a RolloutEngine: generation with
    the same streaming hand-overs, bucketed weight updates, the chat template. Always resident:
    the disaggregated placement never releases it, and the ranks that are not controllers hold
    none."""

    def __init__(self, worker: EngineWorker, name: str):
        self.worker = worker
        self.name = name

    @contextmanager
    def lead(self):
        yield  # one process's engine: no peer ranks replay its calls

    def prompt_text(self, request: Request) -> str:
        return self.worker.call("prompt_text", engine=self.name, messages=request.messages)

    def processor_media(self, request: Request) -> dict[str, Any]:
        from yatt_mm.engines.media import processor_media

        return processor_media(request.images, request.videos, self.worker.started[self.name]["timed_videos"])

    def generate(self, requests: list[Request], sampling: SamplingConfig,
                 on_finished: Callable[[int, list[Response]], None] | None = None,
                 on_sample: Callable[[int, int, Response], None] | None = None) -> GenerationResult:
        def event(kind: str, *args) -> None:
            (on_sample if kind == "sample" else on_finished)(*args)

        return self.worker.call("generate", on_event=event, engine=self.name, requests=requests,
                                sampling=asdict(sampling), finished=on_finished is not None,
                                samples=on_sample is not None, partial=self.worker.partial_rollout)

    def prompt_logprobs(self, requests: list) -> list:
        """A distillation teacher's scoring (yatt_mm/engines/scoring.py), in the worker."""
        return self.worker.call("prompt_logprobs", engine=self.name, requests=requests)

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], partial: bool = False) -> dict[str, float]:
        """The bucket in one flat byte buffer, broadcast into the worker, which loads it."""
        tensors = [(name, t.detach().contiguous()) for name, t in named_tensors]
        specs = [(name, tuple(t.shape), str(t.dtype).removeprefix("torch.")) for name, t in tensors]
        flat = torch.cat([t.reshape(-1).view(torch.uint8) for _, t in tensors]) if tensors else torch.empty(0, dtype=torch.uint8)
        if weights_backend() == "nccl":
            flat = flat.cuda()
        start = time.perf_counter()
        info = self.worker.call_weights("update_weights", then=lambda: broadcast_bucket(self.worker.weights, flat),
                                        engine=self.name, specs=specs, nbytes=flat.numel(), partial=partial)
        return info | {"seconds": time.perf_counter() - start}

    def load_adapter(self, tensors: dict[str, torch.Tensor], config: dict) -> dict[str, float]:
        """sync.lora adapter: the adapter (small beside the weights) sent through the weights'
        channel as it is, loaded there in place."""
        start = time.perf_counter()
        info = self.worker.call_weights("load_adapter", engine=self.name, config=config,
                                        tensors={k: t.detach().cpu() for k, t in tensors.items()})
        return info | {"seconds": time.perf_counter() - start}

    def weights_loaded(self) -> None:
        """The sync's last bucket has been sent: a generation that took the new weights in the
        middle goes on from here."""
        self.worker.call_weights("weights_loaded", engine=self.name)


# -- the worker process -------------------------------------------------------------------------

def _unpack(flat: torch.Tensor, specs: list) -> list[tuple[str, torch.Tensor]]:
    out, offset = [], 0
    for name, shape, dtype in specs:
        dtype = getattr(torch, dtype)
        nbytes = int(torch.Size(shape).numel()) * torch.empty(0, dtype=dtype).element_size()
        out.append((name, flat[offset: offset + nbytes].view(dtype).view(shape)))
        offset += nbytes
    return out


class Worker:
    """The worker process: its engines, and the calls and weight updates it answers."""

    def __init__(self, conn, weights_conn, group):
        self.conn, self.weights_conn, self.group = conn, weights_conn, group
        self.device = "cuda" if weights_backend() == "nccl" else "cpu"
        self.engines: dict[str, Any] = {}
        self.generating: str | None = None  # the engine generating now, if any
        self.stale_caches: set[str] = set()  # engines loaded mid-generation: caches to drop at its end

    def serve(self) -> None:
        from multiprocessing.connection import wait

        while True:
            for conn in wait([self.conn, self.weights_conn]):
                try:
                    op, kw = conn.recv()
                except EOFError:  # the rank is gone
                    return
                if op == "stop":
                    self.conn.send(("result", None))
                    return
                self.answer(conn, op, kw)

    def answer(self, conn, op: str, kw: dict) -> None:
        try:
            conn.send(("result", getattr(self, f"_{op}")(conn, **kw)))
        except Exception:
            conn.send(("error", traceback.format_exc()))

    def _start(self, conn, engines: dict) -> dict:
        from yatt_mm.engines.engine import RolloutEngine

        for name, cfg in engines.items():
            self.engines[name] = RolloutEngine(EngineConfig(**cfg))
        return {name: {"timed_videos": e.timed_videos} for name, e in self.engines.items()}

    def _prompt_text(self, conn, engine: str, messages: list) -> str:
        return self.engines[engine].prompt_text(Request(messages))

    def _prompt_logprobs(self, conn, engine: str, requests: list) -> list:
        from yatt_mm.engines.scoring import prompt_logprobs

        return prompt_logprobs(self.engines[engine], requests)

    def _generate(self, conn, engine: str, requests: list, sampling: dict, finished: bool, samples: bool,
                  partial: bool) -> GenerationResult:
        on_finished = (lambda i, rs: conn.send(("event", "finished", i, rs))) if finished else None
        on_sample = (lambda i, j, r: conn.send(("event", "sample", i, j, r))) if samples else None
        self.generating = engine
        try:
            return self.engines[engine].generate(requests, SamplingConfig(**sampling), on_finished, on_sample,
                                                 self._weights_between_steps if partial else None)
        finally:
            self.generating = None
            for name in self.stale_caches:
                self.engines[name].reset_caches()
            self.stale_caches.clear()

    def _weights_between_steps(self) -> bool:
        """Between two steps of a generation: a sync that has begun is loaded whole (never a step
        on half the new weights); says whether it changed the generating engine's weights."""
        if not self.weights_conn.poll():
            return False
        changed = False
        while True:
            op, kw = self.weights_conn.recv()
            changed |= op in ("update_weights", "load_adapter") and kw["engine"] == self.generating
            self.answer(self.weights_conn, op, kw)
            if op == "weights_loaded":
                return changed

    def _update_weights(self, conn, engine: str, specs: list, nbytes: int, partial: bool) -> dict:
        flat = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        broadcast_bucket(self.group, flat)
        mid_generation = self.generating == engine
        if mid_generation:  # vLLM keeps its caches while requests run: dropped when the generation ends
            self.stale_caches.add(engine)
        return self.engines[engine].update_weights(_unpack(flat, specs), partial=partial,
                                                   reset_caches=not mid_generation)

    def _load_adapter(self, conn, engine: str, tensors: dict, config: dict) -> dict:
        mid_generation = self.generating == engine
        if mid_generation:  # as _update_weights: the caches go when the generation ends
            self.stale_caches.add(engine)
        return self.engines[engine].load_adapter(tensors, config, reset_caches=not mid_generation)

    def _weights_loaded(self, conn, engine: str) -> None:
        return None


def serve(address: str, weights_address: str) -> None:
    # its supervisor ends it (and what it started) when the rank dies; nothing to arm here
    host, port = address.rsplit(":", 1)
    key = bytes.fromhex(os.environ.pop(KEY_ENV))
    conn = Client((host, int(port)), authkey=key)
    weights_conn = Client((host, int(port)), authkey=key)
    w_host, w_port = weights_address.rsplit(":", 1)
    Worker(conn, weights_conn, weights_group(w_host, int(w_port), 1)).serve()


if __name__ == "__main__":
    serve(sys.argv[1], sys.argv[2])
