"""Real gloo process groups inside the pytest process, one thread a rank: for the unit tests of
code that sums over DP groups. The groups stand alone (no default group, no port), so they never
meet the session's in-process vLLM engine or Megatron's state."""

from __future__ import annotations

import itertools
from concurrent.futures import ThreadPoolExecutor

import torch.distributed as dist

_jobs = itertools.count()  # next() is atomic under the GIL


def on_ranks(world: int, fn, timeout: float = 60.0) -> list:
    """fn(rank, group) on `world` ranks joined by one real gloo group; the results by rank."""
    prefix = f"job{next(_jobs)}"
    store = dist.HashStore()

    def rank(r: int):
        group = dist.ProcessGroupGloo(dist.PrefixStore(prefix, store), r, world)
        return fn(r, group)

    with ThreadPoolExecutor(world) as pool:
        futures = [pool.submit(rank, r) for r in range(world)]
        return [f.result(timeout=timeout) for f in futures]
