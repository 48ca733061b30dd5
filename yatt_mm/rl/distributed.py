"""Everything that crosses ranks in an RL step, and how: small metadata (counts, costs, rewards)
by all-reduce/all-gather, and training samples point to point (balancing) or by broadcast (to a
DP group's TP peers). All of it is CPU tensors over the gloo groups of `models.comm`; every
function here takes its group explicitly.

Samples travel without pickle: each is a dict of tensors plus string metadata, packed with
safetensors (a format with no code in it; `models.comm.pack`). A move plan is known to every rank (it comes from
metadata all ranks share), so only the byte lengths need one all-reduce before the transfers.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from models.comm import broadcast_packed, pack, unpack
from yatt_mm.rl.balance import Move, imbalance, loads_of, plan_moves, sample_cost
from yatt_mm.rl.samples import TrainSample


def exchange(
    outgoing: dict[int, tuple[dict[str, torch.Tensor], dict[str, str]]],
    moves: list[Move],
    rank: int,
    group,
) -> dict[int, tuple[dict[str, torch.Tensor], dict[str, str]]]:
    """Send this rank's samples named in `moves` and receive the ones moving here.

    `outgoing` maps a global sample index to (tensors, metadata) for every sample this rank
    sends. Returns the received samples by global index. `rank` is this process's rank in
    `group`, and moves name ranks of `group`.
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
    return dist.get_global_rank(group, group_rank)


def all_gather_floats(values: list[float], group) -> list[list[float]]:
    """Every rank's list of floats (lists may differ in length)."""
    world = dist.get_world_size(group)
    n = torch.tensor([len(values)], dtype=torch.int64)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(sizes, n, group=group)
    longest = max(int(s) for s in sizes)
    mine = torch.zeros(longest, dtype=torch.float64)
    mine[: len(values)] = torch.tensor(values, dtype=torch.float64)
    parts = [torch.zeros(longest, dtype=torch.float64) for _ in range(world)]
    dist.all_gather(parts, mine, group=group)
    return [p[: int(s)].tolist() for p, s in zip(parts, sizes)]


def sum_across(values: dict[str, float], group, op=dist.ReduceOp.SUM) -> dict[str, float]:
    keys = sorted(values)
    t = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64)
    dist.all_reduce(t, op=op, group=group)
    return dict(zip(keys, t.tolist()))


def group_cost(samples: list[TrainSample], patch_weight: float) -> float:
    return sum(sample_cost(s.text_tokens, s.vision_patches, patch_weight) for s in samples)


def pack_group(samples: list[TrainSample]):
    tensors, meta = {}, {"n": str(len(samples))}
    for i, s in enumerate(samples):
        t, m = s.pack()
        tensors.update({f"{i}.{k}": v for k, v in t.items()})
        meta.update({f"{i}.{k}": v for k, v in m.items()})
    return tensors, meta


def unpack_group(tensors, meta) -> list[TrainSample]:
    out = []
    for i in range(int(meta["n"])):
        pre = f"{i}."
        out.append(TrainSample.unpack({k[len(pre):]: v for k, v in tensors.items() if k.startswith(pre)},
                                      {k[len(pre):]: v for k, v in meta.items() if k.startswith(pre)}))
    return out


def balance_groups(groups: list[list[TrainSample]], patch_weight: float, group) -> tuple[list[list[TrainSample]], dict]:
    """Karmarkar-Karp over every rank's group costs (metadata only), then move whole groups
    point to point. Whole groups keep group-level loss aggregation local to a rank."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    costs_by_rank = all_gather_floats([group_cost(g, patch_weight) for g in groups], group)
    costs = [c for cs in costs_by_rank for c in cs]
    owner = [r for r, cs in enumerate(costs_by_rank) for _ in cs]
    offset = sum(len(cs) for cs in costs_by_rank[:rank])
    new_owner, moves = plan_moves(costs, owner, world)
    outgoing = {offset + j: pack_group(g) for j, g in enumerate(groups)
                if new_owner[offset + j] != rank}
    received = exchange(outgoing, moves, rank, group)
    kept = [g for j, g in enumerate(groups) if new_owner[offset + j] == rank]
    kept += [unpack_group(*received[i]) for i in sorted(received)]
    stats = {"balance/imbalance_before": imbalance(loads_of(costs, owner, world)),
             "balance/imbalance_after": imbalance(loads_of(costs, new_owner, world)),
             "balance/groups_moved": float(len(moves))}
    return kept, stats


def broadcast_samples(samples: list[TrainSample] | None, src: int, group) -> list[TrainSample]:
    """Give every TP rank of a DP group the samples its leader (`src`, a global rank) built."""
    if dist.get_world_size(group) == 1:
        return samples
    return unpack_group(*broadcast_packed(pack_group(samples) if dist.get_rank() == src else None, src, group))
