"""Which samples a data-parallel rank reads in an epoch, and in what order: pure functions of
(number of samples, seed, epoch, dp_rank, dp_size, slice size, buffer size).

1. The global sample list (shard order, then tar order) is cut into slices of `slice_size`
   consecutive samples; the slices are shuffled by (seed, epoch). Slices keep reads sequential
   inside a shard while still mixing shards.
2. That global order is cut into `dp_size` contiguous sample ranges, rank r getting
   [r*N//W, (r+1)*N//W): ranges of samples, not whole shards, so N need not divide by W and
   rank sizes differ by at most one. Every sample lands in exactly one rank.
3. Inside a rank, a bounded shuffle buffer of `buffer_size` reorders the range, with a random
   generator seeded by (seed, epoch, dp_rank).

The buffer works on sample indices, not decoded samples, so a rank's whole order is known up
front: resuming is "skip the first `position` entries", and the number of decode workers never
changes the order (workers decode the rank's list in order; see `dataio.reader`). Ranks of one
model-parallel group pass the same dp_rank and so read the same samples.
"""

from __future__ import annotations

import numpy as np


def _rng(seed: int, epoch: int, *extra: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence([seed, epoch, *extra]))


def check_split(dp_rank: int, dp_size: int) -> None:
    if dp_size < 1:
        raise ValueError(f"dp_size must be >= 1, got {dp_size}")
    if not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank must be in [0, dp_size={dp_size}), got {dp_rank}")


def global_order(n: int, seed: int, epoch: int, slice_size: int, shuffle: bool = True) -> np.ndarray:
    """All sample indices of an epoch: shuffled slices of consecutive samples, concatenated."""
    if slice_size < 1:
        raise ValueError(f"slice_size must be >= 1, got {slice_size}")
    if not shuffle:
        return np.arange(n, dtype=np.int64)
    starts = np.arange(0, n, slice_size, dtype=np.int64)
    perm = _rng(seed, epoch, 0).permutation(len(starts))
    parts = [np.arange(s, min(s + slice_size, n), dtype=np.int64) for s in starts[perm]]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


def rank_range(n: int, dp_rank: int, dp_size: int) -> tuple[int, int]:
    """Rank r's contiguous range [start, end) of the global order."""
    check_split(dp_rank, dp_size)
    return dp_rank * n // dp_size, (dp_rank + 1) * n // dp_size


def buffer_shuffle(items: np.ndarray, buffer_size: int, rng: np.random.Generator) -> np.ndarray:
    """A streaming shuffle buffer: fill to `buffer_size`, then emit a random element per element
    added; drain at the end. An item moves at most `buffer_size` - 1 places earlier."""
    if buffer_size <= 1 or len(items) <= 1:
        return items.copy()
    out = np.empty_like(items)
    buf: list[int] = []
    k = 0
    draws = rng.random(len(items))  # one draw per emitted item, taken up front (fast, reproducible)
    for x in items.tolist():
        buf.append(x)
        if len(buf) >= buffer_size:
            j = int(draws[k] * len(buf))
            buf[j], buf[-1] = buf[-1], buf[j]
            out[k] = buf.pop()
            k += 1
    while buf:
        j = int(draws[k] * len(buf))
        buf[j], buf[-1] = buf[-1], buf[j]
        out[k] = buf.pop()
        k += 1
    return out


def rank_order(
    n: int,
    dp_rank: int,
    dp_size: int,
    seed: int,
    epoch: int,
    slice_size: int = 64,
    buffer_size: int = 256,
    shuffle: bool = True,
) -> np.ndarray:
    """The global sample indices rank `dp_rank` reads in `epoch`, in the order it reads them."""
    start, end = rank_range(n, dp_rank, dp_size)
    mine = global_order(n, seed, epoch, slice_size, shuffle)[start:end]
    if not shuffle:
        return mine
    return buffer_shuffle(mine, buffer_size, _rng(seed, epoch, 1, dp_rank))
