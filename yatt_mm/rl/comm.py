"""What crosses DP groups in a step, all of it small except balanced samples: group costs,
counters for metrics, and (point to point) the groups that balancing moves."""

from __future__ import annotations

import torch
import torch.distributed as dist

from yatt_mm.balance import imbalance, loads_of, plan_moves, sample_cost
from yatt_mm.exchange import exchange, pack, unpack
from yatt_mm.rl.samples import TrainSample


def all_gather_floats(values: list[float], group=None) -> list[list[float]]:
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


def sum_across(values: dict[str, float], group=None, op=dist.ReduceOp.SUM) -> dict[str, float]:
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


def balance_groups(groups: list[list[TrainSample]], patch_weight: float, group=None) -> tuple[list[list[TrainSample]], dict]:
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
    length = torch.zeros(1, dtype=torch.int64)
    buf = None
    if dist.get_rank() == src:
        buf = pack(*pack_group(samples))
        length[0] = buf.numel()
    dist.broadcast(length, src, group=group)
    if buf is None:
        buf = torch.empty(int(length), dtype=torch.uint8)
    dist.broadcast(buf, src, group=group)
    return unpack_group(*unpack(buf))
