"""Cross-DP load balancing: partition a step's samples by cost, move only what must move.

Cost counts what the step computes: text tokens (prompt + response) and vision patches (the ViT
runs on every patch, which text-only balancers in verl and slime ignore). Only metadata (ids and
costs) is needed to plan; samples then move point to point between the two ranks concerned.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass


@dataclass(frozen=True)
class Move:
    sample: int  # index into the step's global sample list
    src: int
    dst: int


def sample_cost(text_tokens: int, vision_patches: int, patch_weight: float = 1.0) -> float:
    """Relative compute of one sample. A vision patch costs about one token in the ViT (similar
    width, fewer layers in small models); `patch_weight` tunes that per model."""
    return float(text_tokens) + patch_weight * float(vision_patches)


def karmarkar_karp(costs: list[float], k: int) -> list[list[int]]:
    """k-way largest differencing method: near-optimal max load, O(n log n * k)."""
    if k < 1:
        raise ValueError("number of partitions must be >= 1")
    if not costs:
        return [[] for _ in range(k)]
    # Each heap entry is a partial solution of k subsets; the key is its spread (max - min).
    heap = []
    counter = itertools.count()
    for i, c in enumerate(costs):
        subsets = [(c, [i])] + [(0.0, []) for _ in range(k - 1)]
        heapq.heappush(heap, (-c, next(counter), subsets))
    while len(heap) > 1:
        _, _, a = heapq.heappop(heap)
        _, _, b = heapq.heappop(heap)
        a = sorted(a, key=lambda s: s[0], reverse=True)
        b = sorted(b, key=lambda s: s[0])
        merged = [(sa + sb, ia + ib) for (sa, ia), (sb, ib) in zip(a, b)]
        loads = [s for s, _ in merged]
        heapq.heappush(heap, (-(max(loads) - min(loads)), next(counter), merged))
    return [sorted(items) for _, items in heap[0][2]]


def imbalance(loads: list[float]) -> float:
    """max / mean load: 1.0 is perfect."""
    mean = sum(loads) / len(loads)
    return max(loads) / mean if mean > 0 else 1.0


def loads_of(costs: list[float], owner: list[int], k: int) -> list[float]:
    loads = [0.0] * k
    for c, r in zip(costs, owner):
        loads[r] += c
    return loads


def plan_moves(costs: list[float], owner: list[int], k: int, tolerance: float = 0.02) -> tuple[list[int], list[Move]]:
    """A balanced owner per sample, and the moves from `owner` to it: few moves first.

    From the current placement, repeatedly move the sample from the most to the least loaded
    rank that best halves their gap, until max/mean is within `tolerance` of 1 (few, cheap
    moves: most samples stay where they were generated). When that stalls above what
    Karmarkar-Karp achieves, use the KK partition instead, with parts given to the ranks that
    already hold most of them."""
    loads = loads_of(costs, owner, k)
    new_owner = list(owner)
    mean = sum(loads) / k if k else 0.0
    for _ in range(len(costs)):
        if mean <= 0 or max(loads) / mean <= 1 + tolerance:
            break
        src, dst = loads.index(max(loads)), loads.index(min(loads))
        gap = loads[src] - loads[dst]
        candidates = [i for i, r in enumerate(new_owner) if r == src and 0 < costs[i] < gap]
        if not candidates:
            break
        i = min(candidates, key=lambda j: abs(costs[j] - gap / 2))
        new_owner[i] = dst
        loads[src] -= costs[i]
        loads[dst] += costs[i]
    kk_owner = _kk_owner(costs, owner, k)
    if imbalance(loads) > imbalance(loads_of(costs, kk_owner, k)) + tolerance:
        new_owner = kk_owner
    moves = [Move(i, owner[i], new_owner[i]) for i in range(len(costs)) if owner[i] != new_owner[i]]
    return new_owner, moves


def _kk_owner(costs: list[float], owner: list[int], k: int) -> list[int]:
    """KK partition; each part goes to the rank that already holds most of its cost."""
    parts = karmarkar_karp(costs, k)
    kept = [[sum(costs[i] for i in part if owner[i] == r) for r in range(k)] for part in parts]
    if k <= 7:
        best = max(itertools.permutations(range(k)), key=lambda perm: sum(kept[p][perm[p]] for p in range(k)))
    else:  # greedy: biggest overlaps first
        best = [-1] * k
        taken = set()
        for _, p, r in sorted(((-kept[p][r], p, r) for p in range(k) for r in range(k))):
            if best[p] < 0 and r not in taken:
                best[p] = r
                taken.add(r)
    new_owner = list(owner)
    for p, part in enumerate(parts):
        for i in part:
            new_owner[i] = best[p]
    return new_owner
