"""The process groups of a job and the device each collective's tensors live on: the one place
that starts torch.distributed and Megatron's model-parallel groups.

Two kinds of group, never mixed:
- accelerator groups, Megatron's own (NCCL on GPUs): gradients, TP activations and logits, the
  weight gather of a sync. Their tensors live on `Comm.device`.
- CPU groups, gloo, made here beside them: everything the RL loop moves between controllers
  (counts, costs, rewards, balanced groups, the TP broadcast of training samples, barriers).
  NCCL refuses CPU tensors, so these could not share the accelerator groups; Megatron keeps gloo
  DP groups for the same reason.
Every collective in `yatt_mm/` names a group from here; `is_cpu_group` tells which kind a group is.

Under torchrun the default group comes from its environment (NCCL on a GPU, gloo otherwise); a
plain `python` process gets a one-rank group on an in-memory store, so single-process tools
(parity, doctor, the GPU check, tests, benchmarks) run the same code as the ranks of a job.
"""

from __future__ import annotations

import json
import os
import random
import socket
import struct
from dataclasses import dataclass

import torch
import torch.distributed as dist
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on right now, for a child process to bind. It is drawn below the
    kernel's ephemeral range: the OS hands ports of that range to every outgoing connection, so a
    port from it (what binding port 0 gives) can be taken between this check and the child's bind."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            ephemeral_low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral_low = 32768
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(10000, max(ephemeral_low, 10001))
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # nothing free below the range: let the OS pick
        s.bind((host, 0))
        return s.getsockname()[1]


def accelerator_device() -> torch.device:
    """This rank's device: its GPU (LOCAL_RANK) where there is one, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def init_distributed() -> None:
    """torch.distributed from torchrun's environment, or one local rank; idempotent. NCCL is the
    default group's backend on GPUs: one GPU per rank, LOCAL_RANK's."""
    if dist.is_initialized():
        return
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    if "RANK" in os.environ:
        dist.init_process_group(backend)
    else:
        # one rank: an in-memory store, no port to pick or to lose to another process
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)


@dataclass(frozen=True)
class Comm:
    """Where this rank sits and the groups it talks over. A DP group's model replica spans
    TP x PP ranks (its model-parallel group); the first of them (TP rank 0 of the first pipeline
    stage) is the group's controller, its leader. `leaders_cpu` joins the leaders and is None
    elsewhere."""

    rank: int
    world: int
    tp_rank: int
    tp_size: int
    pp_rank: int
    pp_size: int
    dp_rank: int
    dp_size: int
    node: int  # torchrun's node rank (GROUP_RANK)
    device: torch.device  # where tensors of the accelerator groups live
    tp: object  # Megatron's TP group (accelerator)
    pp: object  # Megatron's pipeline group (accelerator): the weight export's hand-over
    dp: object  # Megatron's DP group (accelerator)
    world_cpu: object
    tp_cpu: object
    pp_cpu: object
    mp_cpu: object  # the model-parallel ranks of this DP group (TP x PP): samples reach all of them
    dp_cpu: object
    leaders_cpu: object | None
    # expert parallelism (MoE models): the experts of each layer spread over `ep_size`
    # consecutive DP ranks (same TP rank and stage); `ep` is Megatron's group of them (accelerator)
    ep_rank: int = 0
    ep_size: int = 1
    ep: object = None
    # context parallelism (models/context.py): each sequence split over `cp_size` ranks (same TP
    # rank, DP rank and stage; Megatron's order tp-cp-dp-pp puts them between TP and DP); `cp` is
    # Megatron's group of them (accelerator: the K/V and logprob gathers), `cp_cpu` its gloo twin.
    # A model replica spans TP x CP x PP ranks: they all get the DP group's samples (mp_cpu)
    cp_rank: int = 0
    cp_size: int = 1
    cp: object = None
    cp_cpu: object = None

    @property
    def leader(self) -> bool:
        return self.tp_rank == 0 and self.pp_rank == 0 and self.cp_rank == 0

    @property
    def leader_rank(self) -> int:
        """Global rank of this DP group's leader."""
        return layout_rank(0, self.dp_rank, 0, self.tp_size, self.dp_size, 0, self.cp_size)

    @property
    def first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    def pp_peer(self, stage: int) -> int:
        """Global rank of this rank's counterpart (same TP, CP and DP rank) on pipeline `stage`."""
        return layout_rank(self.tp_rank, self.dp_rank, stage, self.tp_size, self.dp_size, self.cp_rank, self.cp_size)


def layout_rank(tp_rank: int, dp_rank: int, pp_rank: int, tp: int, dp: int, cp_rank: int = 0, cp: int = 1) -> int:
    """Megatron's default rank order (tp-cp-ep-dp-pp, EP folded into DP): TP ranks are
    consecutive, then CP ranks, then DP replicas, then pipeline stages."""
    return tp_rank + tp * (cp_rank + cp * (dp_rank + dp * pp_rank))


_comm: Comm | None = None
_cpu_groups: list = []  # the groups made here for CPU tensors (compared by identity)


def is_cpu_group(group) -> bool:
    return any(group is g for g in _cpu_groups)


def comm() -> Comm:
    if _comm is None:
        raise RuntimeError("models.comm.init_parallel() has not run in this process")
    return _comm


def init_parallel(tensor_parallel: int = 1, seed: int = 1234, pipeline_parallel: int = 1,
                  expert_parallel: int = 1, context_parallel: int = 1) -> Comm:
    """torch.distributed, Megatron's tensor/pipeline/data-parallel groups (and expert-parallel
    ones: `expert_parallel` consecutive DP ranks share out each MoE layer's experts; and
    context-parallel ones: `context_parallel` ranks share each sequence) and its RNG tracker,
    then the gloo groups beside them. Every rank must call it (group creation is collective)."""
    global _comm
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel as tp_mod

    init_distributed()
    if _comm is not None:
        return _comm
    world = dist.get_world_size()
    if world % (tensor_parallel * pipeline_parallel * context_parallel):
        raise ValueError(f"world size {world} is not a multiple of tensor_parallel x pipeline_parallel x "
                         f"context_parallel = {tensor_parallel} x {pipeline_parallel} x {context_parallel}")
    if world % (tensor_parallel * pipeline_parallel * expert_parallel):
        raise ValueError(f"world size {world} is not a multiple of tensor_parallel x pipeline_parallel x "
                         f"expert_parallel = {tensor_parallel} x {pipeline_parallel} x {expert_parallel}")
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(tensor_model_parallel_size=tensor_parallel,
                                     pipeline_model_parallel_size=pipeline_parallel,
                                     expert_model_parallel_size=expert_parallel,
                                     context_parallel_size=context_parallel)
        tp_mod.model_parallel_cuda_manual_seed(seed)
    tp, pp = ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size()
    cp = ps.get_context_parallel_world_size()
    dp = world // (tp * cp * pp)
    rank = dist.get_rank()
    t, c_, d, p = rank % tp, rank // tp % cp, rank // (tp * cp) % dp, rank // (tp * cp * dp)
    # with CP 1 (cs = [0]) every group is what it was before context parallelism
    ranks = lambda ts, ds, ps_, cs=(c_,): [layout_rank(a, b, c, tp, dp, e, cp)  # noqa: E731
                                           for c in ps_ for b in ds for e in cs for a in ts]
    # every group of each kind, in the same order on every rank (group creation is collective)
    tp_groups = [ranks(range(tp), [b], [c], [e]) for c in range(pp) for b in range(dp) for e in range(cp)]
    pp_groups = [ranks([a], [b], range(pp), [e]) for b in range(dp) for e in range(cp) for a in range(tp)]
    dp_groups = [ranks([a], range(dp), [c], [e]) for c in range(pp) for e in range(cp) for a in range(tp)]
    mp_groups = [ranks(range(tp), [b], range(pp), range(cp)) for b in range(dp)]
    cp_groups = [ranks([a], [b], [c], range(cp)) for c in range(pp) for b in range(dp) for a in range(tp)]
    mine = lambda groups: next(g for g in groups if rank in g)  # noqa: E731
    for expected, megatrons in ((mine(tp_groups), ps.get_tensor_model_parallel_group()),
                                (mine(pp_groups), ps.get_pipeline_model_parallel_group()),
                                (mine(dp_groups), ps.get_data_parallel_group()),
                                (mine(cp_groups), ps.get_context_parallel_group()),
                                # Megatron's DDP reduces gradients over DP x CP (its dp_cp group)
                                (sorted(ranks([t], range(dp), [p], range(cp))), ps.get_data_parallel_group(
                                    with_context_parallel=True))):
        if dist.get_process_group_ranks(megatrons) != expected:
            raise RuntimeError(f"Megatron's groups {dist.get_process_group_ranks(megatrons)} are not the "
                               f"layout yatt-mm assumes ({expected})")
    ep = ps.get_expert_model_parallel_world_size()
    if ep > 1:  # Megatron's expert ranks (tp-ep-dp-pp, expert TP = TP): blocks of ep consecutive ranks of
        # the flattened CP x DP index (c + cp x d; with CP 1, of DP ranks), at this TP rank and stage
        first = (c_ + cp * d) // ep * ep
        expected = [t + tp * (g + cp * dp * p) for g in range(first, first + ep)]
        if dist.get_process_group_ranks(ps.get_expert_model_parallel_group()) != expected:
            raise RuntimeError(f"Megatron's expert-parallel group "
                               f"{dist.get_process_group_ranks(ps.get_expert_model_parallel_group())} is not the "
                               f"layout yatt-mm assumes ({expected})")
    made = {kind: [_gloo(g) for g in groups][groups.index(mine(groups))]
            for kind, groups in (("tp", tp_groups), ("pp", pp_groups), ("dp", dp_groups), ("mp", mp_groups))
            + ((("cp", cp_groups),) if cp > 1 else ())}
    _comm = Comm(rank=rank, world=world, tp_rank=t, tp_size=tp, pp_rank=p, pp_size=pp, dp_rank=d, dp_size=dp,
                 node=int(os.environ.get("GROUP_RANK", 0)), device=accelerator_device(),
                 tp=ps.get_tensor_model_parallel_group(), pp=ps.get_pipeline_model_parallel_group(),
                 dp=ps.get_data_parallel_group(), world_cpu=_gloo(list(range(world))), tp_cpu=made["tp"],
                 pp_cpu=made["pp"], mp_cpu=made["mp"], dp_cpu=made["dp"],
                 leaders_cpu=made["dp"] if t == 0 and p == 0 and c_ == 0 else None,
                 ep_rank=ps.get_expert_model_parallel_rank() if ep > 1 else 0, ep_size=ep,
                 ep=ps.get_expert_model_parallel_group() if ep > 1 else None,
                 cp_rank=c_, cp_size=cp, cp=ps.get_context_parallel_group() if cp > 1 else None,
                 cp_cpu=made.get("cp"))
    return _comm


def destroy_parallel() -> None:
    """Undo `init_parallel` (Megatron's model-parallel groups and RNG tracker, the gloo groups
    made here), keeping torch.distributed's default group: the next `init_parallel` may take
    another layout in the same process, as Megatron's own tests do between cases."""
    global _comm
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    for group in _cpu_groups:
        dist.destroy_process_group(group)
    _cpu_groups.clear()
    _comm = None


def _gloo(ranks: list[int]):
    group = dist.new_group(ranks, backend="gloo")
    if dist.get_rank() in ranks:
        _cpu_groups.append(group)
    return group


# --- moving tensors with metadata between ranks, without pickle ----------------------------------


def pack(tensors: dict[str, torch.Tensor], meta: dict[str, str] | None = None) -> torch.Tensor:
    seen: set[int] = set()
    flat = {}
    for k, v in tensors.items():
        v = v.contiguous()
        ptr = v.untyped_storage().data_ptr()
        flat[k] = v.clone() if ptr in seen else v  # safetensors refuses tensors sharing memory
        seen.add(ptr)
    data = st_save(flat, metadata=meta or {})
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def unpack(buf: torch.Tensor) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    raw = buf.numpy().tobytes()
    (header_len,) = struct.unpack("<Q", raw[:8])  # safetensors: u64 header size, JSON header
    meta = json.loads(raw[8 : 8 + header_len]).get("__metadata__") or {}
    return st_load(raw), meta


def broadcast_packed(payload: tuple[dict[str, torch.Tensor], dict[str, str]] | None, src: int, group):
    """`payload` (tensors, string metadata) from global rank `src` to every rank of the CPU
    `group` (length first, then the safetensors bytes). Returns it on every rank."""
    length = torch.zeros(1, dtype=torch.int64)
    buf = None
    if dist.get_rank() == src:
        buf = pack(*payload)
        length[0] = buf.numel()
    dist.broadcast(length, src, group=group)
    if buf is None:
        buf = torch.empty(int(length), dtype=torch.uint8)
    dist.broadcast(buf, src, group=group)
    return unpack(buf)
