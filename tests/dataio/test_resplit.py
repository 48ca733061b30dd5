"""Resuming a data position at another DP size (dataio/resplit.py), on real shards with real
decoding: every sample of every epoch read exactly once across the change, whatever the old
ranks' positions (one of them already in the next epoch), and across two changes in a row."""

from __future__ import annotations

from collections import Counter

import pytest

from dataio.blend import BlendedReader
from dataio.reader import BlendSource, DataConfig, DataReader
from dataio.resplit import resplit
from dataio.synth import write_shards

N = 23


@pytest.fixture(scope="module")
def ds(tmp_path_factory):
    root = tmp_path_factory.mktemp("resplit")
    write_shards(str(root / "a"), images=N, videos=0, samples_per_shard=5, seed=3, tasks=None)
    write_shards(str(root / "b"), images=9, videos=0, samples_per_shard=4, seed=4, tasks=None)
    return root


def cfg(ds, **kw) -> DataConfig:
    return DataConfig(**({"shards": [str(ds / "a")], "seed": 7, "slice_size": 3, "shuffle_buffer": 4, "workers": 0,
                          "video_isolation": "none"} | kw))


def read(reader, n: int) -> list[tuple[int, str]]:
    it = iter(reader)
    return [(s.epoch, s.key) for s in (next(it) for _ in range(n))]


def read_through(reader, last_epoch: int) -> list[tuple[int, str]]:
    """Everything up to the end of `last_epoch`."""
    got = []
    while reader.epoch <= last_epoch:
        got += [(s.epoch, s.key) for s in reader.iter_epoch()]
    return got


def moved(states: list[dict], make, dp_size: int) -> list:
    readers = [make(r, dp_size) for r in range(dp_size)]
    for r, reader in enumerate(readers):
        reader.load_state_dict(resplit(states, r, dp_size))
    return readers


def assert_each_once(pairs, epochs, keys):
    count = Counter(pairs)
    assert set(count.values()) == {1}, [p for p, c in count.items() if c > 1]
    for e in epochs:
        assert sorted(k for ep, k in pairs if ep == e) == sorted(keys), e


@pytest.mark.parametrize("old,new,taken", [(2, 1, (5, 14)), (2, 3, (14, 3)), (3, 2, (0, 9, 4)), (4, 1, (6, 6, 6, 6))])
def test_every_sample_of_each_epoch_is_read_once_across_a_change_of_dp_size(ds, old, new, taken):
    """Old ranks stopped at different points (one past its epoch's end, into epoch 1); the new
    ranks finish those epochs and one more, each sample once per epoch. The counters' sums stay."""
    make = lambda r, w: DataReader(cfg(ds), r, w)  # noqa: E731
    before = [make(r, old) for r in range(old)]
    pairs = [p for reader, n in zip(before, taken) for p in read(reader, n)]
    states = [r.state_dict() for r in before]
    after = moved(states, make, new)
    assert sum(r.samples_yielded for r in after) == sum(taken)
    for reader in after:
        pairs += read_through(reader, 2)
    keys = before[0].index.sample_key
    assert_each_once(pairs, (0, 1, 2), keys)
    assert max(e for e, _ in pairs) == 2


def test_two_changes_in_a_row_and_a_resume_inside_a_re_split_epoch(ds):
    """DP 2 -> 3 in epoch 0, then 3 -> 1 before the re-split remainder is read; and a resume at
    the same size inside a remainder continues exactly."""
    make = lambda r, w: DataReader(cfg(ds), r, w)  # noqa: E731
    first = [make(r, 2) for r in range(2)]
    pairs = read(first[0], 4) + read(first[1], 7)
    middle = moved([r.state_dict() for r in first], make, 3)
    assert all(r.pending for r in middle)
    took = [read(reader, n) for reader, n in zip(middle, (1, 4, 2))]
    pairs += [p for t in took for p in t]
    twin = make(1, 3)
    twin.load_state_dict(resplit([r.state_dict() for r in first], 1, 3))
    head = read(twin, 2)
    again = make(1, 3)
    again.load_state_dict(twin.state_dict())
    assert head + read(again, 2) == took[1]
    last = moved([r.state_dict() for r in middle], make, 1)[0]
    pairs += read_through(last, 1)
    assert_each_once(pairs, (0, 1), first[0].index.sample_key)
    assert not last.pending and last.epoch == 2


def test_a_blend_re_splits_each_source_on_its_own(ds):
    blend = DataConfig(blend=[BlendSource(name="a", shards=[str(ds / "a")], weight=2),
                              BlendSource(name="b", shards=[str(ds / "b")], weight=1)],
                       seed=2, slice_size=2, shuffle_buffer=3, video_isolation="none", workers=0)
    make = lambda r, w: BlendedReader(blend, r, w)  # noqa: E731
    before = [make(r, 2) for r in range(2)]
    drawn = [(s.source, s.epoch, s.key) for reader, n in zip(before, (7, 12)) for s in _take(reader, n)]
    after = moved([r.state_dict() for r in before], make, 1)[0]
    assert after.drawn == [sum(r.drawn[i] for r in before) for i in range(2)]
    it = iter(after)
    while min(r.epoch for r in after.readers.values()) < 2:
        s = next(it)
        drawn.append((s.source, s.epoch, s.key))
    for name, size in (("a", N), ("b", 9)):
        mine = [(e, k) for src, e, k in drawn if src == name and e < 2]
        assert len(mine) == len(set(mine)) == 2 * size, name
    for r in [*before, after]:
        r.close()


def _take(reader, n):
    it = iter(reader)
    return [next(it) for _ in range(n)]
