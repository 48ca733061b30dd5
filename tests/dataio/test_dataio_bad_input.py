"""Bad input of every kind is skipped, counted by reason and quarantined; the stream goes on."""

from __future__ import annotations

import json
import os
import re
from collections import Counter

import pytest

from dataio.decode import MediaConfig, VideoDecodePool
from dataio.errors import MediaError
from dataio.index import build_index, expand_shards, open_dataset
from dataio.reader import DataConfig, DataReader

from dataio_helpers import good_video_bytes, make_bad_dataset


@pytest.fixture(scope="session")
def bad_ds(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("dataio_bad"))
    info = make_bad_dataset(root)
    return root, info


@pytest.mark.parametrize("worker_kind,isolation", [("thread", "process"), ("process", "none")])
def test_every_bad_input_is_skipped_counted_and_quarantined(bad_ds, tmp_path, worker_kind, isolation):
    root, info = bad_ds
    qlog = tmp_path / "quarantine.jsonl"
    reader = DataReader(DataConfig(shards=[root], shuffle=False, workers=2, worker_kind=worker_kind,
                                   video_isolation=isolation, quarantine_log=str(qlog)))
    got = [s.key for s in reader.iter_epoch()]
    reader.close()
    assert sorted(got) == sorted(info["good"])  # every good sample, including those after bad ones
    expected = Counter(info["expected"].values())
    assert reader.skips == expected
    lines = [json.loads(x) for x in qlog.read_text().splitlines()]
    assert Counter(x["reason"] for x in lines) == expected
    by_key = {x["key"]: x for x in lines}
    for key, reason in info["expected"].items():
        assert by_key[key]["reason"] == reason
        assert os.path.exists(by_key[key]["shard"])
    assert "c-corrupt.tar" in by_key[""]["shard"] and "invalid tar header" in by_key[""]["detail"]
    # skipped + decoded = every sample of the epoch, exactly once
    assert len(got) + sum(reader.skips.values()) == len(reader.index)
    assert not os.path.exists(info["bomb_target"]), "shard content was unpickled"
    assert reader.ignored_members == {"npy": 1, "pyd": 1, "pickle": 1}


def test_index_records_tar_damage(bad_ds):
    root, _ = bad_ds
    table, _ = build_index(expand_shards([root]))
    rows = table.to_pylist()
    assert any(r["kind"] == "truncated" and r["key"] == "t_cut" for r in rows)
    err = [r for r in rows if r["kind"] == "tar_error"]
    assert len(err) == 1 and err[0]["shard"].endswith("c-corrupt.tar")
    assert not any(r["key"] == "c_lost" for r in rows)


def test_truncated_shard_is_reported_when_it_shrinks_after_indexing(tmp_path):
    from dataio_helpers import good_image_bytes, js, write_tar

    p = write_tar(str(tmp_path / "s.tar"), [("a.jpg", good_image_bytes(1)), ("a.json", js()),
                                            ("b.jpg", good_image_bytes(2)), ("b.json", js())])
    build_index([p], str(tmp_path / "index.parquet"))
    data = open(p, "rb").read()
    open(p, "wb").write(data[: data.index(b"b.jpg") + 600])  # shard cut after indexing
    reader = DataReader(DataConfig(index=str(tmp_path / "index.parquet"), shuffle=False, workers=1))
    assert [s.key for s in reader.iter_epoch()] == ["a"]
    assert reader.skips == {"read_error": 1}


def _hang_holding_gil(data, cfg, window, expected):
    """STAND-IN for decord's get_batch deadlock (dmlc/decord#373), which holds the GIL: a
    catastrophically backtracking regex also spins in C with the GIL held, for hours."""
    re.match(r"(a+)+$", "a" * 64 + "b")


def test_hanging_video_decode_is_cut_off_and_the_stream_goes_on(tmp_path):
    pool = VideoDecodePool(1, timeout_s=1.5, decoder=f"{__name__}:_hang_holding_gil")
    with pytest.raises(MediaError) as e:
        pool.decode(good_video_bytes(1), MediaConfig())
    assert e.value.reason == "video_timeout" and pool.killed == 1
    pool.decoder = "dataio.decode:decode_video_bytes"  # the replacement child decodes normally
    pool.timeout_s = 60  # its start-up (imports) counts too: not 1.5 s on a busy machine
    frames = pool.decode(good_video_bytes(1), MediaConfig(video_frames=4))
    assert frames.shape[0] == 4 and frames.flags.writeable
    pool.close()


def _memfds() -> list[str]:
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            out.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            pass
    return [t for t in out if "yatt-mm-video-frames" in t]


def _hang_die_or_decode(data, cfg, window, expected):
    from dataio.decode import decode_video_bytes

    if data == b"hang":
        _hang_holding_gil(data, cfg, window, expected)
    if data == b"die":
        os._exit(3)  # stand-in for a crash inside libav
    return decode_video_bytes(data, cfg, window, expected)


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc")
def test_shared_memory_frames_match_and_are_released_after_kill_crash_and_close():
    from dataio.decode import _shm_supported, decode_video_bytes

    if not _shm_supported():
        pytest.skip("no memfd here: frames go through the pipe")
    shm_before = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    pool = VideoDecodePool(1, timeout_s=60, decoder=f"{__name__}:_hang_die_or_decode")
    pipe = VideoDecodePool(1, timeout_s=30, shared_memory=False)
    assert pool.shared_memory and not pipe.shared_memory
    small, big = MediaConfig(video_frames=2, video_max_pixels=4 * 28 * 28), MediaConfig(video_frames=40)
    clip = good_video_bytes(1, frames=12)
    direct = VideoDecodePool(1, timeout_s=60)  # decode_video_bytes resizes straight into the buffer
    for media in (small, big, small):  # the second grows the child's buffer, the third reuses it
        got = pool.decode(clip, media)
        assert got.flags.writeable and got.flags.owndata
        want = decode_video_bytes(clip, media)
        assert (got == want).all() and (got == pipe.decode(clip, media)).all()
        assert (direct.decode(clip, media) == want).all()  # small: resized in place; big: no resize, copied
    direct.close()
    assert _memfds()  # the buffer (and the dup mmap keeps of it) while its child lives
    pool.timeout_s = 1.5  # only for the hang: a fresh child's start-up (imports) counts too
    with pytest.raises(MediaError) as e:
        pool.decode(b"hang", small)
    assert e.value.reason == "video_timeout" and pool.killed == 1 and _memfds() == []
    pool.timeout_s = 60
    assert pool.decode(clip, big).shape[0] == 40  # a new child, a new buffer
    with pytest.raises(MediaError) as e:
        pool.decode(b"die", small)
    assert e.value.reason == "corrupt_video" and "died" in e.value.detail and _memfds() == []
    assert pool.decode(clip, big).shape[0] == 40
    pool.close()
    pipe.close()
    assert _memfds() == []
    shm_after = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    assert not [n for n in shm_after - shm_before if "yatt" in n]


def test_reader_skips_a_hanging_video_and_continues(tmp_path):
    from dataio_helpers import good_image_bytes, js, write_tar

    write_tar(str(tmp_path / "s.tar"), [("a.mp4", good_video_bytes(1)), ("a.json", js()),
                                        ("b.jpg", good_image_bytes(2)), ("b.json", js())])
    reader = DataReader(DataConfig(shards=[str(tmp_path)], shuffle=False, workers=2, decode_timeout_s=1.5,
                                   video_decoder=f"{__name__}:_hang_holding_gil"))
    assert [s.key for s in reader.iter_epoch()] == ["b"]
    assert reader.skips == {"video_timeout": 1}
    reader.close()
    assert _memfds() == []  # the killed child's frame buffer was released, and the idle one's at close


def test_real_file_whose_metadata_frame_count_is_wrong(tmp_path):
    """A real mp4 whose declared frame count (the sample's metadata) disagrees with the
    container is rejected before get_batch is called."""
    from dataio.decode import decode_video_bytes

    data = good_video_bytes(3, frames=8)
    assert decode_video_bytes(data, MediaConfig(video_frames=4), expected_frames=8).shape[0] == 4
    with pytest.raises(MediaError, match="bad_frame_count"):
        decode_video_bytes(data, MediaConfig(video_frames=4), expected_frames=9)
    with pytest.raises(MediaError, match="bad_frame_count"):
        decode_video_bytes(data, MediaConfig(video_frames=4, video_max_reported_frames=5))


def test_all_bad_rank_raises_instead_of_spinning(tmp_path):
    from dataio_helpers import js, write_tar

    write_tar(str(tmp_path / "s.tar"), [("a.json", js()), ("b.json", js())])
    reader = DataReader(DataConfig(shards=[str(tmp_path)], workers=1))
    with pytest.raises(RuntimeError, match="no usable sample"):
        next(iter(reader))


def test_plain_webdataset_reads_our_shards(tmp_path):
    import webdataset as wds

    from dataio.synth import write_shards

    paths = write_shards(str(tmp_path), images=9, videos=2, frame_sequences=1, samples_per_shard=4)
    keys = [s["__key__"] for s in wds.WebDataset(paths, shardshuffle=False)]
    assert sorted(keys) == sorted(open_dataset(paths).sample_key) and len(keys) == 12


@pytest.mark.parametrize("isolation", ["process", "none"])
def test_no_members_bytes_reach_the_terminal_when_decord_cannot_open_them(tmp_path, capfd, isolation):
    """decord's failed open logs 'ERROR opening: <the member's bytes>, <reason>' on the process's
    stderr (megabytes for a cut-off video); the reader keeps the reason for the quarantine log and
    nothing of the bytes reaches the terminal, from a decoding child or a decoding thread."""
    from dataio_helpers import js, write_tar

    marker = b"MEMBER-BYTES-7f3a"
    cut = good_video_bytes(4)[:600]  # a real mp4 cut short: its header, and then nothing
    write_tar(str(tmp_path / "s.tar"), [("a.mp4", marker * 40), ("a.json", js()), ("b.mp4", marker + cut),
                                        ("b.json", js()), ("c.mp4", cut), ("c.json", js())])
    log = tmp_path / "quarantine.jsonl"
    reader = DataReader(DataConfig(shards=[str(tmp_path)], shuffle=False, workers=1, video_isolation=isolation,
                                   quarantine_log=str(log)))
    assert list(reader.iter_epoch()) == []
    reader.close()
    err = capfd.readouterr().err
    assert "MEMBER-BYTES" not in err and "ERROR opening" not in err, err[-2000:]
    details = {x["key"]: x["detail"] for x in map(json.loads, log.read_text().splitlines())}
    assert set(details) == {"a", "b", "c"}
    for detail in details.values():
        assert detail.startswith("decord cannot open: ") and "MEMBER-BYTES" not in detail, detail
    assert details["a"].endswith("Invalid data found when processing input")
