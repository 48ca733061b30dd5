"""Move training samples between DP ranks, point to point, without pickle.

Each sample is a dict of tensors plus string metadata, packed with safetensors (a format with no
code in it). The move plan is known to every rank (it comes from metadata all ranks share), so
only the byte lengths need one all-reduce before the point-to-point transfers.
"""

from __future__ import annotations

import json
import struct

import torch
import torch.distributed as dist
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from yatt_mm.balance import Move


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


def exchange(
    outgoing: dict[int, tuple[dict[str, torch.Tensor], dict[str, str]]],
    moves: list[Move],
    rank: int,
    group=None,
) -> dict[int, tuple[dict[str, torch.Tensor], dict[str, str]]]:
    """Send this rank's samples named in `moves` and receive the ones moving here.

    `outgoing` maps a global sample index to (tensors, metadata) for every sample this rank
    sends. Returns the received samples by global index. `rank` is this process's rank in
    `group`, and moves name ranks of `group` (global ranks when group is None).
    """
    lengths = torch.zeros(len(moves), dtype=torch.int64)
    buffers: dict[int, torch.Tensor] = {}
    for j, m in enumerate(moves):
        if m.src == rank:
            buffers[j] = pack(*outgoing[m.sample])
            lengths[j] = buffers[j].numel()
    dist.all_reduce(lengths, group=group)  # only the sender wrote each entry

    ops = []
    for j, m in enumerate(moves):
        if m.src == rank:
            ops.append(dist.P2POp(dist.isend, buffers[j], _global(m.dst, group), group))
        elif m.dst == rank:
            buffers[j] = torch.empty(int(lengths[j]), dtype=torch.uint8)
            ops.append(dist.P2POp(dist.irecv, buffers[j], _global(m.src, group), group))
    if ops:
        for req in dist.batch_isend_irecv(ops):
            req.wait()
    return {m.sample: unpack(buffers[j]) for j, m in enumerate(moves) if m.dst == rank}


def _global(group_rank: int, group) -> int:
    return group_rank if group is None else dist.get_global_rank(group, group_rank)
