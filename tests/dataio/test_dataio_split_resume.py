"""Splitting, shuffling and resume of the per-rank reader, on real shards with real decoding."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from dataio.index import build_index, open_dataset
from dataio.reader import DataConfig, DataReader, rank_keys
from dataio.split import global_order, rank_order
from dataio.synth import write_shards

N = 23  # does not divide by 2 ranks, 4 readers, or the 5-sample shards


@pytest.fixture(scope="session")
def small_ds(tmp_path_factory):
    root = tmp_path_factory.mktemp("dataio_small")
    paths = write_shards(str(root), images=19, videos=2, frame_sequences=2, samples_per_shard=5, seed=3,
                         video_frames=8)
    build_index(paths, str(root / "index.parquet"))
    return str(root)


@pytest.fixture(autouse=True)
def _close_readers(monkeypatch):
    """Every reader a test opens is closed after it, passed or failed: its worker threads and
    processes do not outlive the test."""
    opened = []

    class ClosedAfterTest(DataReader):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            opened.append(self)

    monkeypatch.setitem(globals(), "DataReader", ClosedAfterTest)
    yield
    for r in opened:
        r.close()  # idempotent: a test may have closed it already


def cfg(ds, **kw):
    base = dict(shards=[ds], seed=7, slice_size=3, shuffle_buffer=4, workers=2, video_isolation="none")
    base.update(kw)
    return DataConfig(**base)


def all_keys(ds):
    idx = open_dataset([ds])
    assert len(idx) == N
    return idx.sample_key


@pytest.mark.parametrize("n,w,slice_size,buf", [(23, 2, 3, 4), (23, 4, 5, 1), (7, 3, 1, 2), (100, 7, 8, 16), (2, 3, 4, 4)])
def test_rank_orders_partition_the_epoch(n, w, slice_size, buf):
    seen = Counter()
    for r in range(w):
        seen.update(rank_order(n, r, w, seed=1, epoch=2, slice_size=slice_size, buffer_size=buf).tolist())
    assert sorted(seen) == list(range(n)) and set(seen.values()) <= {1}


def test_exactly_once_2_ranks_x_2_workers(small_ds):
    keys = all_keys(small_ds)
    got = []
    per_rank = {}
    for rank in range(2):
        reader = DataReader(cfg(small_ds, workers=2), dp_rank=rank, dp_size=2)
        out = [s.key for s in reader.iter_epoch()]
        reader.close()
        assert not reader.skips
        assert out == reader.keys(0) == rank_keys([small_ds], rank, 2, seed=7, slice_size=3, shuffle_buffer=4)
        per_rank[rank] = out
        got += out
    assert sorted(got) == sorted(keys) and len(got) == len(set(got)) == N
    assert {len(v) for v in per_rank.values()} == {11, 12}


def test_order_independent_of_workers_and_kind(small_ds):
    orders = []
    for workers, kind in ((0, "thread"), (1, "thread"), (3, "thread"), (2, "process")):
        reader = DataReader(cfg(small_ds, workers=workers, worker_kind=kind), dp_rank=1, dp_size=2)
        orders.append([s.key for s in reader.iter_epoch()])
        reader.close()
    assert all(o == orders[0] for o in orders)


def test_model_parallel_ranks_of_one_dp_group_read_the_same(small_ds):
    a = DataReader(cfg(small_ds), dp_rank=0, dp_size=2)
    b = DataReader(cfg(small_ds, workers=1), dp_rank=0, dp_size=2)  # e.g. the TP peer
    assert [s.key for s in a.iter_epoch()] == [s.key for s in b.iter_epoch()]


def test_seed_determinism(small_ds):
    o1 = rank_order(N, 0, 2, seed=5, epoch=0, slice_size=3, buffer_size=4)
    o2 = rank_order(N, 0, 2, seed=5, epoch=0, slice_size=3, buffer_size=4)
    assert o1.tolist() == o2.tolist()
    assert o1.tolist() != rank_order(N, 0, 2, seed=6, epoch=0, slice_size=3, buffer_size=4).tolist()
    assert o1.tolist() != rank_order(N, 0, 2, seed=5, epoch=1, slice_size=3, buffer_size=4).tolist()
    # the decoded stream is deterministic too, pixels included
    r1 = list(DataReader(cfg(small_ds), 0, 1).iter_epoch())
    r2 = list(DataReader(cfg(small_ds, workers=1), 0, 1).iter_epoch())
    assert [s.key for s in r1] == [s.key for s in r2]
    assert all(a.images[0].tobytes() == b.images[0].tobytes() for a, b in zip(r1, r2) if a.images)
    # slices keep runs of consecutive samples together
    g = global_order(N, 5, 0, slice_size=3).tolist()
    assert g != list(range(N)) and all(g[i + 1] == g[i] + 1 for i in range(0, 21, 3))


@pytest.mark.parametrize("stop_after,new_workers,new_kind", [(5, 1, "thread"), (1, 3, "thread"), (8, 2, "process")])
def test_resume_mid_epoch_with_other_worker_count(small_ds, stop_after, new_workers, new_kind):
    full = [s.key for s in DataReader(cfg(small_ds), 0, 2).iter_epoch()]
    first = DataReader(cfg(small_ds, workers=2), 0, 2)
    got = []
    for s in first.iter_epoch():
        got.append(s.key)
        if len(got) == stop_after:
            break
    state = json.loads(json.dumps(first.state_dict()))  # what a checkpoint stores
    first.close()
    second = DataReader(cfg(small_ds, workers=new_workers, worker_kind=new_kind), 0, 2)
    second.load_state_dict(state)
    got += [s.key for s in second.iter_epoch()]
    second.close()
    assert got == full
    assert second.epoch == 1 and second.position == 0
    # and the next epoch continues with epoch 1's order
    assert [s.key for s in second.iter_epoch()] == second.keys(1)


def test_resume_at_epoch_end_starts_next_epoch(small_ds):
    r = DataReader(cfg(small_ds), 1, 2)
    list(r.iter_epoch())
    state = r.state_dict()
    assert (state["epoch"], state["position"]) == (1, 0)
    r2 = DataReader(cfg(small_ds, workers=1), 1, 2)
    r2.load_state_dict(state)
    assert [s.key for s in r2.iter_epoch()] == r.keys(1)


def test_endless_reader_checkpointed_right_after_an_epochs_last_sample_resumes(small_ds):
    """The endless iterator stops right after yielding the epoch's last sample, before it moves
    on: the state is (epoch 0, position = end). A reader resumed there goes on to epoch 1 (it
    once took the empty rest of epoch 0 for an epoch without usable samples and raised)."""
    r = DataReader(cfg(small_ds), 1, 2)
    it = iter(r)
    for _ in r.keys(0):
        next(it)
    state = r.state_dict()
    assert (state["epoch"], state["position"]) == (0, len(r.keys(0)))
    r2 = DataReader(cfg(small_ds), 1, 2)
    r2.load_state_dict(state)
    assert next(iter(r2)).key == r.keys(1)[0]


def test_endless_iteration_crosses_epochs(small_ds):
    r = DataReader(cfg(small_ds), 0, 2)
    it = iter(r)
    keys = [next(it).key for _ in range(len(r.keys(0)) + 2)]
    assert keys[: len(r.keys(0))] == r.keys(0) and keys[-2:] == r.keys(1)[:2]


def test_state_from_other_split_is_refused(small_ds):
    state = DataReader(cfg(small_ds), 0, 2).state_dict()
    with pytest.raises(ValueError, match="dp_size"):
        DataReader(cfg(small_ds), 0, 3).load_state_dict(state)
    with pytest.raises(ValueError, match="seed"):
        DataReader(cfg(small_ds, seed=8), 0, 2).load_state_dict(state)


def test_misconfiguration_names_the_setting(small_ds):
    with pytest.raises(ValueError, match="worker_kind"):
        DataReader(cfg(small_ds, worker_kind="fork"))
    with pytest.raises(ValueError, match="dp_rank"):
        DataReader(cfg(small_ds), dp_rank=2, dp_size=2)
    with pytest.raises(ValueError, match="shuffle_buffer"):
        DataReader(cfg(small_ds, shuffle_buffer=0))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        DataReader(cfg("/nonexistent/shards"))


def test_ordered_thread_map_keeps_order_bounds_work_ahead_and_stops_on_close():
    import random
    import threading
    import time

    from dataio.reader import ordered_thread_map

    rng = random.Random(0)
    delays = [rng.uniform(0, 0.004) for _ in range(60)]
    lock = threading.Lock()
    started, consumed, ahead = [], [0], []

    def fn(i):
        with lock:
            started.append(i)
            ahead.append(i - consumed[0])
        time.sleep(delays[i])
        return i * i

    out = []
    for v in ordered_thread_map(fn, list(range(60)), workers=3, window=4):
        out.append(v)
        consumed[0] = len(out)
    assert out == [i * i for i in range(60)] and max(ahead) < 4

    started.clear()
    gen = ordered_thread_map(fn, list(range(60)), workers=2, window=4)
    assert [next(gen) for _ in range(3)] == [0, 1, 4]
    gen.close()  # stops the threads (joined) after at most their current item
    n = len(started)
    time.sleep(0.05)
    assert len(started) == n <= 3 + 4 and not [t for t in threading.enumerate() if t.name.startswith("yatt-mm-decode")]

    def boom(i):
        if i == 5:
            raise ValueError("x")
        return i

    with pytest.raises(ValueError):
        list(ordered_thread_map(boom, list(range(20)), workers=2, window=4))
    assert list(ordered_thread_map(boom, [], workers=2, window=4)) == []
