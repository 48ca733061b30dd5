"""Several datasets drawn in fixed shares (`data.blend`), as one DP rank's stream.

    data:
      blend:
        - {name: charts, shards: [data/charts/], weight: 3}
        - {name: video, shards: [data/video/], weight: 1}

Each source is a `DataReader` of its own (its own order, epochs, skips and decode workers; every
other `data` setting applies to each). Which source the next sample comes from is not random: the
one furthest behind its share, as Megatron's blended datasets choose, so after n draws every source
has given its weight's share of n to within about a sample, on every rank, and the choice is a
pure function of the counts drawn so far. The state is those counts plus each source's reader state, so
a resume continues exactly. Sources are matched by name on resume: a changed weight, or an added or
removed source, is taken up from that point (the shares start counting afresh; an added source
reads from its beginning), which is how a curriculum changes its mix mid-run.
"""

from __future__ import annotations

import sys
from collections import Counter
from dataclasses import replace
from typing import Iterator

from dataio.budget import TokenBudget
from dataio.reader import DataConfig, DataReader, Sample

STATE_KIND = "blend"
STATE_VERSION = 1


def open_reader(cfg: DataConfig, dp_rank: int = 0, dp_size: int = 1, budget: TokenBudget | None = None):
    """The reader `cfg` asks for: a `BlendedReader` with data.blend, else a `DataReader`."""
    if cfg.blend:
        return BlendedReader(cfg, dp_rank, dp_size, budget)
    return DataReader(cfg, dp_rank, dp_size, budget=budget)


def next_source(weights: list[float], drawn: list[int]) -> int:
    """The source furthest behind its share after one more draw (ties: the first listed)."""
    total = sum(drawn) + 1
    share = sum(weights)
    return max(range(len(weights)), key=lambda i: (weights[i] / share * total - drawn[i], -i))


class BlendedReader:
    """One DP rank's endless, resumable stream from the datasets of `cfg.blend`."""

    def __init__(self, cfg: DataConfig, dp_rank: int = 0, dp_size: int = 1, budget: TokenBudget | None = None):
        cfg.validate()
        if not cfg.blend:
            raise ValueError("BlendedReader needs data.blend (a list of {name, shards, weight})")
        self.budget = budget  # as a DataReader's: SFT reports the frames it dropped when set
        self.names = [s.name for s in cfg.blend]
        self.weights = [float(s.weight) for s in cfg.blend]
        self.readers = {s.name: DataReader(replace(cfg, shards=list(s.shards), index=s.index, blend=[]), dp_rank,
                                           dp_size, budget=budget, source=s.name) for s in cfg.blend}
        self.drawn = [0] * len(self.names)  # samples each source gave since the shares last changed
        self._streams: dict[str, Iterator[Sample]] = {}
        for name, reader in self.readers.items():  # every rank draws from every source
            if not len(reader.order(0)):
                self.close()
                raise ValueError(f"data.blend[{name}]: its {len(reader.index)} samples leave DP rank {dp_rank} of "
                                 f"{dp_size} none to read; give it more samples or run fewer DP groups")

    def __iter__(self) -> Iterator[Sample]:
        while True:
            i = next_source(self.weights, self.drawn)
            name = self.names[i]
            if name not in self._streams:
                self._streams[name] = iter(self.readers[name])
            sample = next(self._streams[name])
            self.drawn[i] += 1
            yield sample

    def iter_epoch(self) -> Iterator[Sample]:
        """The rest of every source's epoch, interleaved in the blend's shares while they last
        (held-out scans, which may stop early, see every source)."""
        streams = {i: self.readers[n].iter_epoch() for i, n in enumerate(self.names)}
        drawn = [0] * len(self.names)
        while streams:
            live = list(streams)
            i = live[next_source([self.weights[j] for j in live], [drawn[j] for j in live])]
            try:
                sample = next(streams[i])
            except StopIteration:
                del streams[i]
                continue
            drawn[i] += 1
            yield sample

    # the sources' counts together, as a single reader reports them
    @property
    def skips(self) -> Counter[str]:
        return sum((r.skips for r in self.readers.values()), Counter())

    @property
    def ignored_members(self) -> Counter[str]:
        return sum((r.ignored_members for r in self.readers.values()), Counter())

    @property
    def samples_yielded(self) -> int:
        return sum(r.samples_yielded for r in self.readers.values())

    @property
    def budget_fitted(self) -> int:
        return sum(r.budget_fitted for r in self.readers.values())

    @property
    def frames_dropped(self) -> int:
        return sum(r.frames_dropped for r in self.readers.values())

    @property
    def remote_retries(self) -> int:
        return sum(r.remote_retries for r in self.readers.values())

    def quarantine(self, sample: Sample, reason: str, detail: str = "") -> None:
        """Log a sample its consumer cannot use, in its source's reader (DataReader.quarantine)."""
        self.readers[sample.source].quarantine(sample, reason, detail)

    def skips_by_source(self) -> dict[str, int]:
        return {name: sum(r.skips.values()) for name, r in self.readers.items()}

    def close(self) -> None:
        self._close_streams()
        for r in self.readers.values():
            r.close()

    def _close_streams(self) -> None:
        for stream in self._streams.values():
            stream.close()  # stops the source's decode workers now
        self._streams = {}

    # ---------------------------------------------------------------- state
    def state_dict(self) -> dict:
        return {"version": STATE_VERSION, "kind": STATE_KIND, "names": list(self.names), "weights": list(self.weights),
                "drawn": list(self.drawn), "sources": {name: r.state_dict() for name, r in self.readers.items()}}

    def load_state_dict(self, state: dict) -> None:
        if state.get("kind") != STATE_KIND:
            raise ValueError("data state was saved by a single dataset (data.shards), not a blend (data.blend): "
                             "resume with the same data settings")
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"data blend state version {state.get('version')} is not {STATE_VERSION}")
        self._close_streams()
        saved = state["sources"]
        for name, reader in self.readers.items():
            if name in saved:
                reader.load_state_dict(saved[name])
        mix = dict(zip(state["names"], state["weights"]))
        if mix == dict(zip(self.names, self.weights)):  # the same sources and weights, perhaps listed in another order
            drawn = dict(zip(state["names"], state["drawn"]))
            self.drawn = [int(drawn[n]) for n in self.names]
            return
        added = [n for n in self.names if n not in saved]
        removed = [n for n in saved if n not in self.readers]
        print(f"data.blend: the mix changed since the checkpoint ({_mix(mix)} -> "
              f"{_mix(dict(zip(self.names, self.weights)))}); shares count afresh from here"
              + (f"; {', '.join(added)} read from the start" if added else "")
              + (f"; {', '.join(removed)} no longer read" if removed else ""), file=sys.stderr, flush=True)
        self.drawn = [0] * len(self.names)


def _mix(weights: dict[str, float]) -> str:
    return ", ".join(f"{n}: {w:g}" for n, w in weights.items())
