"""A data position saved at one DP size, continued at another.

Each DP rank reads its own range of an epoch's global order (`dataio.split`), so a reader state
says how far one rank got in its own range. When a run resumes with another number of DP groups,
the new rank `r` of `W` is given:

- for every epoch some old rank had not finished (ranks drift apart: skips, dynamic sampling),
  the samples no old rank had read yet, in the epoch's global order, cut into `W` contiguous
  ranges (rank `r` takes range `r`) and shuffled by the same bounded buffer as a normal epoch
  (its own seed). These are the state's `pending` segments, read before anything else;
- then every later epoch as a normal epoch of a `W`-rank run.

So each sample of an epoch is still read exactly once across the change. Counters (skips,
samples yielded, ...) of old rank `d` go to new rank `d % W`: their sums over ranks stay what
they were. A blend of datasets re-splits each source on its own; its draw counts follow the
counters. Re-splitting a state that already has pending segments (a second change before the
first one's epoch ended) works the same way: what an old rank still has to read is its pending
segments, then its normal epochs.
"""

from __future__ import annotations

import base64
import zlib
from collections import Counter

import numpy as np

from dataio.split import _rng, buffer_shuffle, check_split, global_order, rank_order

_COUNTERS = ("samples_yielded", "budget_fitted", "frames_dropped", "remote_retries")
_TALLIES = ("skips", "ignored_members")


def encode_indices(indices: np.ndarray) -> str:
    """Sample indices as compact text for a JSON state (zlib'd little-endian int64, base64)."""
    return base64.b64encode(zlib.compress(np.asarray(indices, dtype="<i8").tobytes())).decode()


def decode_indices(text: str) -> np.ndarray:
    return np.frombuffer(zlib.decompress(base64.b64decode(text)), dtype="<i8").astype(np.int64)


def _order_of(state: dict, epoch: int) -> np.ndarray:
    """The whole order old rank `state` reads in `epoch` when it reads a normal epoch."""
    return rank_order(state["num_samples"], state["dp_rank"], state["dp_size"], state["seed"], epoch,
                      state["slice_size"], state["shuffle_buffer"], state["shuffle"])


def _remaining(state: dict, epoch: int) -> np.ndarray:
    """What old rank `state` has still to read of `epoch` (nothing of an epoch it finished)."""
    pending = state.get("pending", [])
    current = int(state["epoch"])
    if epoch < current:
        return np.zeros(0, dtype=np.int64)
    if epoch == current:
        order = decode_indices(pending[0]["todo"]) if pending else _order_of(state, epoch)
        return order[int(state["position"]):]
    for seg in pending[1:]:
        if seg["epoch"] == epoch:
            return decode_indices(seg["todo"])
    if pending and epoch <= pending[-1]["epoch"]:
        return np.zeros(0, dtype=np.int64)
    return _order_of(state, epoch)


def _last_open_epoch(state: dict) -> int:
    pending = state.get("pending", [])
    return max(int(state["epoch"]), pending[-1]["epoch"] if pending else 0)


def resplit_reader(states: list[dict], dp_rank: int, dp_size: int) -> dict:
    """The state of new rank `dp_rank` of `dp_size`, from every old rank's `DataReader.state_dict()`
    (all of them, in old rank order)."""
    check_split(dp_rank, dp_size)
    first = states[0]
    same = ("dataset", "num_samples", "seed", "shuffle", "slice_size", "shuffle_buffer", "dp_size", "version")
    for s in states:
        differs = [k for k in same if s.get(k) != first.get(k)]
        if differs:
            raise ValueError(f"the DP groups' data states disagree on {differs}: they are not one run's")
    if sorted(s["dp_rank"] for s in states) != list(range(first["dp_size"])):
        raise ValueError(f"a re-split needs every DP group's data state: got ranks {[s['dp_rank'] for s in states]} "
                         f"of {first['dp_size']}")
    n, seed = first["num_samples"], first["seed"]
    pending = []
    for epoch in range(min(int(s["epoch"]) for s in states), max(_last_open_epoch(s) for s in states) + 1):
        left = np.concatenate([_remaining(s, epoch) for s in states])
        where = np.empty(n, dtype=np.int64)
        where[global_order(n, seed, epoch, first["slice_size"], first["shuffle"])] = np.arange(n)
        left = left[np.argsort(where[left], kind="stable")]  # the epoch's global order: slices stay together
        mine = left[dp_rank * len(left) // dp_size: (dp_rank + 1) * len(left) // dp_size]
        if first["shuffle"]:
            mine = buffer_shuffle(mine, first["shuffle_buffer"], _rng(seed, epoch, 2, dp_rank, dp_size))
        if len(mine):
            pending.append({"epoch": epoch, "todo": encode_indices(mine)})
    last = max(_last_open_epoch(s) for s in states)
    mine_old = [s for s in states if s["dp_rank"] % dp_size == dp_rank]
    out = {k: first[k] for k in same} | {"dp_rank": dp_rank, "dp_size": dp_size, "pending": pending,
                                         "epoch": pending[0]["epoch"] if pending else last + 1, "position": 0}
    for k in _COUNTERS:
        out[k] = sum(int(s.get(k, 0)) for s in mine_old)
    for k in _TALLIES:
        out[k] = dict(sum((Counter(s.get(k, {})) for s in mine_old), Counter()))
    return out


def resplit(states: list[dict], dp_rank: int, dp_size: int) -> dict:
    """`resplit_reader` for a single dataset's state or a blend's (each source on its own)."""
    if states[0].get("kind") != "blend":
        return resplit_reader(states, dp_rank, dp_size)
    first = states[0]
    mine_old = [s for s in states if s["sources"][first["names"][0]]["dp_rank"] % dp_size == dp_rank]
    drawn = [sum(int(s["drawn"][i]) for s in mine_old) for i in range(len(first["names"]))]
    return {k: first[k] for k in ("version", "kind", "names", "weights")} | {
        "drawn": drawn,
        "sources": {name: resplit_reader([s["sources"][name] for s in states], dp_rank, dp_size)
                    for name in first["sources"]}}
