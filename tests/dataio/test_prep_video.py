"""`yatt-mm prep video`: real videos made with PyAV in several codecs and containers, odd frame
rates, rotation metadata and broken files, prepped into shards that dataio's reader, its index
and the plain webdataset library all read back with the expected sample count."""

from __future__ import annotations

import glob
import io
import json
import os
import tarfile

import numpy as np
import pyarrow.parquet as pq
import pytest
from PIL import Image

from prep_media import GOOD, make_corpus, write_scene_video, write_truncated_faststart

from dataio.prep.clips import stride_clips
from dataio.prep.probe import probe
from yatt_mm.cli import main


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("videos"))
    info = make_corpus(root)
    write_truncated_faststart(os.path.join(root, "a_h264.mp4"), os.path.join(root, "z_cut_faststart.mp4"))
    info["bad"]["z_cut_faststart.mp4"] = ("truncated", "decode_error")
    return root, info


def prep(args: list[str]) -> int:
    return main(["prep", "video", *args, "--no-progress"])


@pytest.fixture(scope="module")
def prepped(corpus, tmp_path_factory):
    root, info = corpus
    out = str(tmp_path_factory.mktemp("out"))
    assert prep([root, "--out", out, "--workers", "2", "--max-clip-len", "1"]) == 0
    return out


def test_probe_codecs_rates_rotation(corpus):
    root, _ = corpus
    got = {name: probe(os.path.join(root, name)) for name in GOOD}
    assert got["a_h264.mp4"].codec == "h264" and abs(got["a_h264.mp4"].fps - 29.97) < 3e-4  # 30000/1001: 3.0e-5
    assert got["b_vp9.webm"].codec == "vp9" and got["b_vp9.webm"].fps == 7
    assert got["c_mpeg4.avi"].codec == "mpeg4"
    assert got["d_mjpeg.avi"].codec == "mjpeg"
    assert got["e_rotated.mp4"].rotation == 90 and got["e_rotated.mp4"].display_size == (32, 64)
    for name, sec in {n: v[2] for n, v in GOOD.items()}.items():
        # measured: 0 for four, 3.0e-3 for a_h264.mp4 (90 frames at 29.97 fps: 3.003 s)
        assert abs(got[name].duration - sec) < 0.03, (name, got[name].duration)


def _samples_by_key(shard_paths):
    out = {}
    for p in shard_paths:
        with tarfile.open(p) as tf:
            for m in tf.getmembers():
                key, _, ext = m.name.partition(".")
                out.setdefault(key, {})[ext] = tf.extractfile(m).read()
    return out


def test_output_read_back_by_dataio_and_webdataset(corpus, prepped):
    root, info = corpus
    n_expected = sum(len(stride_clips(probe(os.path.join(root, n)).duration, 1.0, 1.0)) for n in GOOD)
    assert n_expected == 3 + 3 + 2 + 2 + 2
    shards = sorted(glob.glob(os.path.join(prepped, "*.tar")))
    assert shards and not glob.glob(os.path.join(prepped, "*.tmp"))

    from dataio.reader import DataConfig, DataReader

    reader = DataReader(DataConfig(shards=[prepped], shuffle=False, workers=2), 0, 1)
    samples = list(reader.iter_epoch())
    reader.close()
    assert len(samples) == n_expected and not reader.skips
    by_src = {}
    for s in samples:
        by_src.setdefault(s.metadata["source"]["path"], []).append(s)
        assert len(s.videos) == 1 and s.videos[0].shape[0] == 16  # reader's default: 16 uniform frames
        assert s.metadata["fps"] == 2.0 and s.metadata["num_frames"] == 2
    assert {k: len(v) for k, v in by_src.items()} == {"a_h264.mp4": 3, "b_vp9.webm": 3, "c_mpeg4.avi": 2,
                                                      "d_mjpeg.avi": 2, "e_rotated.mp4": 2}
    # the caption sidecar a_h264.txt: a captioning sample (prompt + caption as the answer)
    a = by_src["a_h264.mp4"][0]
    assert a.prompt == "Describe the video." and a.answer == "a green bar moves right"
    assert a.metadata["caption"] == "a green bar moves right"
    assert [s.metadata["clip"]["start_s"] for s in by_src["a_h264.mp4"]] == [0.0, 1.0, 2.0]
    # rotated source: stored upright (portrait), the coded top-left marker now at the bottom left
    rot = by_src["e_rotated.mp4"][0]
    assert rot.metadata["source"]["rotation"] == 90
    assert (rot.metadata["width"], rot.metadata["height"]) == (32, 64)
    frame = np.asarray(Image.open(io.BytesIO(_samples_by_key(shards)[rot.key]["000.jpg"])).convert("L"))
    assert frame.shape == (64, 32)
    assert frame[-8:, :4].mean() > 200 and frame[:8, :4].mean() < 120

    # the index lists exactly the shards' members
    idx = pq.read_table(os.path.join(prepped, "index.parquet"))
    assert len(set(zip(idx.column("shard").to_pylist(), idx.column("key").to_pylist()))) == n_expected

    import webdataset as wds

    n = 0
    for x in wds.WebDataset(shards, shardshuffle=False):
        assert "json" in x and "000.jpg" in x and "001.jpg" in x
        assert json.loads(x["json"])["metadata"]["source"]["path"]
        n += 1
    assert n == n_expected


def test_failures_recorded_with_reasons(corpus, prepped):
    root, info = corpus
    t = pq.read_table(os.path.join(prepped, "failures.parquet")).to_pylist()
    got = {os.path.basename(r["path"]): r["reason"] for r in t}
    assert set(got) == set(info["bad"])
    for name, want in info["bad"].items():
        assert got[name] in (want if isinstance(want, tuple) else (want,)), (name, got[name])
    stats = json.load(open(os.path.join(prepped, "stats.json")))
    assert stats["items_ok"] == len(GOOD) and stats["items_failed"] == len(info["bad"])
    assert stats["samples"] == 12 and stats["shards"] == len(glob.glob(os.path.join(prepped, "*.tar")))


def test_deterministic_and_rerun_is_noop(corpus, prepped, tmp_path):
    root, _ = corpus
    out = str(tmp_path / "again")
    # another worker count (0: in-process) must not change a byte
    assert prep([root, "--out", out, "--workers", "0", "--max-clip-len", "1"]) == 0
    names = sorted(os.path.basename(p) for p in glob.glob(os.path.join(prepped, "*.tar")))
    assert names == sorted(os.path.basename(p) for p in glob.glob(os.path.join(out, "*.tar")))
    for n in names + ["failures.parquet", "index.parquet"]:
        assert open(os.path.join(out, n), "rb").read() == open(os.path.join(prepped, n), "rb").read(), n
    before = {n: os.path.getmtime(os.path.join(out, n)) for n in names}
    assert prep([root, "--out", out, "--workers", "2", "--max-clip-len", "1"]) == 0  # already complete
    assert before == {n: os.path.getmtime(os.path.join(out, n)) for n in names}
    with pytest.raises(SystemExit, match="other settings.*max_clip_len"):
        prep([root, "--out", out, "--max-clip-len", "2"])


def test_small_shards_and_mp4_store(corpus, tmp_path):
    root, _ = corpus
    out = str(tmp_path / "mp4")
    assert prep([root, "--out", out, "--workers", "2", "--store", "mp4", "--fps", "4", "--max-clip-len", "1.5",
                 "--max-samples-per-shard", "2"]) == 0
    shards = sorted(glob.glob(os.path.join(out, "*.tar")))
    members = _samples_by_key(shards)
    want = sum(len(stride_clips(probe(os.path.join(root, n)).duration, 1.5, 1.0)) for n in GOOD)
    assert len(members) == want and len(shards) == (want + 1) // 2
    import decord

    for key, m in members.items():
        meta = json.loads(m["json"])["metadata"]
        vr = decord.VideoReader(io.BytesIO(m["mp4"]))
        assert len(vr) == meta["frames"] == 6, key  # 1.5 s at 4 fps; checked by the reader too
        assert vr[0].shape[:2] == (meta["height"], meta["width"])

    from dataio.reader import DataConfig, DataReader

    reader = DataReader(DataConfig(shards=[out], shuffle=False, workers=0, video_isolation="none"), 0, 1)
    assert len(list(reader.iter_epoch())) == want and not reader.skips


def test_scene_cuts(tmp_path):
    src = tmp_path / "in"
    src.mkdir()
    write_scene_video(str(src / "scenes.mp4"), seconds_each=1.0)
    out = str(tmp_path / "out")
    assert prep([str(src), "--out", out, "--workers", "0", "--clips", "scenes", "--max-clip-len", "5",
                 "--min-clip-len", "0.5"]) == 0
    metas = [json.loads(m["json"])["metadata"] for m in _samples_by_key(glob.glob(os.path.join(out, "*.tar"))).values()]
    spans = sorted((m["clip"]["start_s"], m["clip"]["end_s"]) for m in metas)
    # measured: exactly the cuts (10 fps, a colour a second); one frame off would be 0.1
    assert [x for span in spans for x in span] == pytest.approx([0.0, 1.0, 1.0, 2.0, 2.0, 3.0], abs=1e-6)


def test_nothing_succeeded_is_an_error(tmp_path):
    src = tmp_path / "in"
    src.mkdir()
    (src / "a.mp4").write_bytes(b"")
    (src / "b.mp4").write_text("not a video")
    with pytest.raises(SystemExit, match="none of the 2 inputs produced a sample.*empty_file 1, invalid_data 1"):
        prep([str(src), "--out", str(tmp_path / "out"), "--workers", "0"])
    t = pq.read_table(str(tmp_path / "out" / "failures.parquet"))
    assert t.num_rows == 2


def test_list_file_inputs(corpus, tmp_path):
    root, _ = corpus
    lst = tmp_path / "list.csv"
    lst.write_text("path,question,answer,source_id\n"
                   f"{root}/c_mpeg4.avi,How many bars?,1,x1\n"
                   f"{root}/d_mjpeg.avi,What colour?,blue,\n"
                   f"{root}/missing.mp4,?,?,\n")
    out = str(tmp_path / "out")
    assert prep([str(lst), "--out", out, "--workers", "0", "--max-clip-len", "2"]) == 0
    recs = [json.loads(m["json"]) for m in _samples_by_key(glob.glob(os.path.join(out, "*.tar"))).values()]
    assert sorted((r["prompt"], r["answer"]) for r in recs) == [("How many bars?", "1"), ("What colour?", "blue")]
    assert [r["metadata"].get("extra") for r in recs if r["answer"] == "1"] == [{"source_id": "x1"}]
    fails = pq.read_table(os.path.join(out, "failures.parquet")).to_pylist()
    assert [(os.path.basename(f["path"]), f["reason"]) for f in fails] == [("missing.mp4", "unreadable")]
