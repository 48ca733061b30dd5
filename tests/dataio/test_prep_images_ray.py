"""`yatt-mm prep images` (a jsonl list with prompts and answers, bad files recorded), and
`prep video --engine ray` on a local Ray instance giving the same bytes as the local engine."""

from __future__ import annotations

import glob
import json
import os

import pyarrow.parquet as pq
import pytest

from prep_media import make_corpus, make_images

from yatt_mm.cli import main


def test_prep_images_from_jsonl(tmp_path):
    root = str(tmp_path / "imgs")
    rows = make_images(root)
    lst = os.path.join(root, "list.jsonl")
    with open(lst, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    out = str(tmp_path / "out")
    assert main(["prep", "images", lst, "--out", out, "--workers", "2", "--max-side", "64", "--no-progress"]) == 0
    fails = {os.path.basename(r["path"]): r["reason"] for r in pq.read_table(os.path.join(out, "failures.parquet")).to_pylist()}
    assert fails == {"bad.jpg": "not_an_image", "missing.jpg": "unreadable"}

    from dataio.reader import DataConfig, DataReader

    reader = DataReader(DataConfig(shards=[out], shuffle=False, workers=0), 0, 1)
    got = list(reader.iter_epoch())
    assert not reader.skips and len(got) == 5
    assert sorted((s.prompt, s.answer) for s in got) == [(f"What is in image {i}?", str(i)) for i in range(5)]
    for s in got:
        assert len(s.images) == 1 and max(s.metadata["width"], s.metadata["height"]) <= 64
        src = s.metadata["source"]
        assert max(src["width"], src["height"]) > 64 or (src["width"], src["height"]) == (s.metadata["width"], s.metadata["height"])

    import webdataset as wds

    shards = sorted(glob.glob(os.path.join(out, "*.tar")))
    assert sum(1 for x in wds.WebDataset(shards, shardshuffle=False) if "jpg" in x and "json" in x) == 5


def test_ray_engine_matches_local(tmp_path):
    pytest.importorskip("ray.data", reason="Ray is an optional extra (pip install 'yatt-mm[ray]'); not installed")
    root = str(tmp_path / "videos")
    make_corpus(root)
    args = ["--max-clip-len", "1", "--max-samples-per-shard", "5", "--no-progress"]
    local, ray_out = str(tmp_path / "local"), str(tmp_path / "ray")
    assert main(["prep", "video", root, "--out", local, "--workers", "0", *args]) == 0
    assert main(["prep", "video", root, "--out", ray_out, "--workers", "2", "--engine", "ray", *args]) == 0
    names = sorted(os.path.basename(p) for p in glob.glob(os.path.join(local, "*.tar")))
    assert len(names) == 3  # 12 clips, 5 per shard
    assert names == sorted(os.path.basename(p) for p in glob.glob(os.path.join(ray_out, "*.tar")))
    for n in names + ["failures.parquet", "index.parquet"]:
        assert open(os.path.join(local, n), "rb").read() == open(os.path.join(ray_out, n), "rb").read(), n
