"""Where a checkpoint's ranks sat, and what each rank of a run at another layout reads of it.

A checkpoint's markers record the layout that wrote it (`Layout`). `resume_plan` tells a rank of
the resuming run which trainer files it loads and which DP groups' controller files it reads: the
same rank's at the same layout; at another number of DP groups the files of its TP/PP place (every
old DP rank's there with the distributed optimizer, whose shards models/reshard.py puts together)
and every old group's data position (re-split by dataio/resplit.py); at another TP, PP, CP or EP
size, with the distributed optimizer switched, and at any DP change under expert parallelism with
it, a conversion through HF names (yatt_mm/rl/relayout.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Layout:
    """The parallel sizes a rank's checkpoint was written at (ranks laid out as models/comm.py
    lays them: TP fastest, then CP, DP, PP)."""

    tp: int = 1
    cp: int = 1
    pp: int = 1
    ep: int = 1
    dp: int = 1
    distributed_optimizer: bool = False

    @property
    def world(self) -> int:
        return self.tp * self.cp * self.dp * self.pp

    def place(self, rank: int) -> tuple[int, int, int, int]:
        """(tp, cp, dp, pp) rank of global `rank`."""
        tc = self.tp * self.cp
        return rank % self.tp, rank // self.tp % self.cp, rank // tc % self.dp, rank // (tc * self.dp)

    def rank(self, t: int, c: int, d: int, p: int) -> int:
        return t + self.tp * (c + self.cp * (d + self.dp * p))

    def describe(self) -> str:
        return (f"DP {self.dp} x TP {self.tp} x PP {self.pp} x CP {self.cp}" + (f" x EP {self.ep}" if self.ep > 1 else "")
                + f", distributed_optimizer={str(self.distributed_optimizer).lower()}")


@dataclass
class ResumePlan:
    """What one rank reads of a checkpoint. `trainers`: the ranks whose trainer files it loads,
    the first holding its weights (the same TP/PP place; with the distributed optimizer at
    another DP size, every old DP rank there, for their optimizer shards). `positions`: the old
    DP groups whose data positions its controller reads; `buffers`: those whose buffered groups
    it takes over. `saved`: the layout that wrote it."""

    trainers: list[int]
    positions: list[int] = field(default_factory=list)
    buffers: list[int] = field(default_factory=list)
    saved: Layout | None = None
    resharded: bool = False  # the DP size changed
    convert: bool = False  # TP, PP, CP, EP or the optimizer changed: through HF names (yatt_mm/rl/relayout.py)


def weights_plan(saved: Layout, live: Layout, rank: int) -> ResumePlan:
    """The one file rank `rank` of `live` reads for the weights alone (an export): the old rank at
    its TP/CP/PP place in the DP group that holds its expert shard (DP rank d % EP), whatever the
    optimizer."""
    t, c, d, p = live.place(rank)
    return ResumePlan([saved.rank(t, c, d % saved.ep, p)], saved=saved)


def resume_plan(saved: Layout, live: Layout, rank: int) -> ResumePlan:
    """How rank `rank` of a run at `live` resumes from a checkpoint written at `saved`. The number
    of DP groups may change as it is; TP, PP, CP, EP and the distributed optimizer's setting
    through a conversion of the checkpoint."""
    t, c, d, p = live.place(rank)
    if saved == live:
        return ResumePlan([rank], [d], [d], saved)
    data = (list(range(saved.dp)), [dd for dd in range(saved.dp) if dd % live.dp == d]) if saved.dp != live.dp \
        else ([d], [d])
    changed = any(getattr(saved, k) != getattr(live, k) for k in ("tp", "cp", "pp", "ep")) \
        or saved.distributed_optimizer != live.distributed_optimizer
    # under expert parallelism the experts' optimizer shards lie over other groups than the rest's:
    # a DP change there goes through the conversion too
    expert_dp = live.ep > 1 and saved.dp != live.dp and live.distributed_optimizer
    if changed or expert_dp:
        return ResumePlan([], *data, saved, resharded=saved.dp != live.dp, convert=True)
    if live.distributed_optimizer:  # every old DP rank's optimizer shards, the weights from the first
        trainers = [saved.rank(t, c, dd, p) for dd in range(saved.dp)]
    else:  # every DP rank held the whole state: the one at this rank's expert shard (d % EP) has it
        trainers = [saved.rank(t, c, d % saved.ep, p)]
    return ResumePlan(trainers, *data, saved, resharded=True)
