"""Shards as people have them: compressed as a whole (what webdataset's own test shard
`sample.tgz` is: a gzip-compressed tar of 90 PNG + .cls samples) are decompressed once into the
cache and read like any shard; a compression we cannot stream is refused with the fix named."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from dataio.index import expand_shards
from dataio.reader import DataConfig, DataReader
from dataio_helpers import good_image_bytes

ROOT = Path(__file__).resolve().parents[2]


def _sample_tgz(path: Path, n: int = 90, mode: str = "w:gz") -> Path:
    with tarfile.open(path, mode) as tf:
        for i in range(n):
            for name, data in ((f"sample{i:03d}.png", good_image_bytes(i, "png")), (f"sample{i:03d}.cls", str(i % 10).encode())):
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tf.addfile(info, io.BytesIO(data))
    return path


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("yatt_cache")


def test_inspect_decodes_every_sample_of_a_tgz(tmp_path, cache):
    shard = _sample_tgz(tmp_path / "sample.tgz")
    import webdataset as wds  # the library's own reading of the same file, for the count

    assert sum(1 for _ in wds.WebDataset(str(shard), shardshuffle=False)) == 90
    proc = subprocess.run([sys.executable, "-m", "yatt_mm.cli", "data", "inspect", str(shard), "--json",
                           "--sheet", str(tmp_path / "sheet.png")], capture_output=True, text=True, cwd=ROOT,
                          timeout=300, env={**__import__("os").environ, "YATT_MM_CACHE": str(cache)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["samples"] == 90 and result["decoded"] == 90 and result["skipped"] == 0, result


@pytest.mark.parametrize("name, mode", [("a.tar.gz", "w:gz"), ("b.tar.bz2", "w:bz2"), ("c.tar.xz", "w:xz"),
                                        ("misnamed.tar", "w:gz")])
def test_compressed_shards_in_a_directory_read_like_plain_ones(tmp_path, cache, monkeypatch, name, mode):
    monkeypatch.setenv("YATT_MM_CACHE", str(cache))
    data = tmp_path / "data"
    data.mkdir()
    _sample_tgz(data / name, n=6, mode=mode)
    (path,) = expand_shards([str(data)])
    assert path.startswith(str(cache)) and path.endswith(".tar") and tarfile.open(path, "r:").getnames()
    assert expand_shards([str(data)]) == [path]  # decompressed once, then reused
    reader = DataReader(DataConfig(shards=[str(data)], shuffle=False, workers=0))
    got = list(reader.iter_epoch())
    assert [s.answer for s in got] == [str(i) for i in range(6)] and all(len(s.images) == 1 for s in got)


def test_broken_or_unreadable_compression_is_refused_with_the_fix(tmp_path, cache, monkeypatch):
    monkeypatch.setenv("YATT_MM_CACHE", str(cache))
    good = _sample_tgz(tmp_path / "ok.tgz", n=4).read_bytes()
    (tmp_path / "cut.tgz").write_bytes(good[: len(good) // 2])
    with pytest.raises(ValueError, match="cut.tgz is compressed but cannot be decompressed"):
        expand_shards([str(tmp_path / "cut.tgz")])
    assert not list(cache.rglob("*.tmp*"))  # no half-written copy left behind
    (tmp_path / "z.tar.zst").write_bytes(b"\x28\xb5\x2f\xfd" + bytes(64))
    with pytest.raises(ValueError, match="zstd-compressed.*zstd -d"):
        expand_shards([str(tmp_path / "z.tar.zst")])
