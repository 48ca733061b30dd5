"""`yatt-mm prep ... --out s3://...` against moto's S3 server (tests/s3_store.py), with the real
s3fs client: shards and the index land in the bucket, none visible half-written, and a run
killed -9 resumes from the bucket (on a machine without the first run's staging folder) to the
same bytes as a local run. `--out gs://...` against a GCS-protocol server with the real gcsfs
client: the same bytes, a rerun that finds the run done, refusals."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from prep_media import make_images
from s3_store import FaultProxy, free_port

ROOT = Path(__file__).resolve().parents[2]
ARGS = ["--workers", "0", "--max-side", "64", "--max-samples-per-shard", "2", "--no-progress"]


@pytest.fixture(scope="module")
def image_list(tmp_path_factory):
    """24 images (and 2 bad rows: failures.parquet has content) listed with prompts and answers."""
    root = str(tmp_path_factory.mktemp("prep-images"))
    rows = make_images(root, n=24)
    with open(os.path.join(root, "list.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    return os.path.join(root, "list.jsonl")


@pytest.fixture(scope="module")
def local_prep(image_list, tmp_path_factory) -> Path:
    """The same list prepared into a local folder: the bytes every bucket run must hold."""
    ref = tmp_path_factory.mktemp("prep-ref") / "ref"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-m", "yatt_mm.cli", "prep", "images", image_list, "--out", str(ref), *ARGS],
                          env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert len(list(ref.glob("shard-*.tar"))) == 12
    return ref


def _assert_same_outputs(seen: dict[str, bytes], ref: Path) -> None:
    """The bucket's objects of a finished run equal the local run's files, the index as a table."""
    ref_names = sorted(p.name for p in ref.glob("shard-*.tar"))
    assert sorted(k for k in seen if k.startswith("shard-")) == ref_names
    for name in ref_names + ["failures.parquet"]:
        assert seen[name] == (ref / name).read_bytes(), name
    assert pq.read_table(pa.BufferReader(seen["index.parquet"])).equals(pq.read_table(ref / "index.parquet"))
    assert json.loads(seen["stats.json"])["samples"] == 24


def _prep(args: list[str], env: dict) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "yatt_mm.cli", "prep", "images", *args], env=env, cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _objects(s3, bucket: str, prefix: str) -> dict[str, bytes]:
    listed = s3.list_objects_v2(Bucket=bucket, Prefix=prefix + "/").get("Contents", [])
    return {o["Key"][len(prefix) + 1:]: s3.get_object(Bucket=bucket, Key=o["Key"])["Body"].read() for o in listed}


def test_prep_writes_shards_and_index_to_a_bucket_and_resumes_there_after_kill_9(image_list, local_prep, s3_store,
                                                                                  tmp_path):
    s3 = s3_store.client()
    s3.create_bucket(Bucket="prep")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "YATT_MM_CACHE": str(tmp_path / "cache-1")}
    ref = local_prep

    proxy = FaultProxy(int(s3_store.endpoint.rsplit(":", 1)[1]), latency_s=0.05)  # slow enough to be killed mid-run
    try:
        env |= s3_store.admin.env(proxy.url)
        proc = _prep([image_list, "--out", "s3://prep/ds", *ARGS], env)
        try:
            deadline = time.time() + 120
            while time.time() < deadline and proc.poll() is None:
                journal = _objects(s3, "prep", "ds/.prep").get("journal.jsonl", b"")
                if journal.count(b'"shard"') >= 3:
                    break
                time.sleep(0.05)
            assert proc.poll() is None, proc.communicate()[1][-2000:]
            proc.send_signal(signal.SIGKILL)
            proc.wait(30)
        finally:
            if proc.poll() is None:
                proc.kill()
        seen = _objects(s3, "prep", "ds")
        shards = {k: v for k, v in seen.items() if k.startswith("shard-")}
        assert 3 <= len(shards) < 12 and "index.parquet" not in seen, sorted(seen)
        for name, data in shards.items():  # what a reader sees mid-run: whole shards only
            assert data == (ref / name).read_bytes(), name

        env["YATT_MM_CACHE"] = str(tmp_path / "cache-2")  # another machine: the state comes from the bucket
        proc = _prep([image_list, "--out", "s3://prep/ds", *ARGS], env)
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-2000:]
        assert "(resumed) -> s3://prep/ds" in out and "failures: s3://prep/ds/failures.parquet" in out, out
    finally:
        proxy.close()
    seen = _objects(s3, "prep", "ds")
    _assert_same_outputs(seen, ref)
    assert json.loads(seen["stats.json"])["resumed"]


def test_prep_writes_to_gcs_as_to_disk_and_a_rerun_finds_it_done(image_list, local_prep, tmp_path, monkeypatch):
    """gs:// through gcsfs against a GCS-protocol server on 127.0.0.1 (gcp-storage-emulator): the
    bucket ends with the local run's bytes, the resume state lives in the bucket (a rerun from a
    machine without the staging folder writes nothing again), and a missing bucket is refused
    naming the URL and the endpoint the client used."""
    import fsspec
    from gcp_storage_emulator.server import create_server

    port = free_port()
    server = create_server("127.0.0.1", port, in_memory=True, default_bucket="prep")
    server.start()
    try:
        env = {**os.environ, "PYTHONPATH": str(ROOT), "YATT_MM_CACHE": str(tmp_path / "cache-1"),
               "STORAGE_EMULATOR_HOST": f"http://127.0.0.1:{port}"}
        done = subprocess.run([sys.executable, "-m", "yatt_mm.cli", "prep", "images", image_list, "--out", "gs://prep/ds",
                               *ARGS], env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", env["STORAGE_EMULATOR_HOST"])
        gcs = fsspec.filesystem("gcs", skip_instance_cache=True)

        def objects() -> dict[str, bytes]:
            return {path.removeprefix("prep/ds/"): gcs.cat_file(path) for path in gcs.find("prep/ds")}

        seen = objects()
        _assert_same_outputs(seen, local_prep)
        assert not json.loads(seen["stats.json"])["resumed"] and ".prep/journal.jsonl" in seen, sorted(seen)

        env["YATT_MM_CACHE"] = str(tmp_path / "cache-2")  # another machine: the state comes from the bucket
        again = subprocess.run([sys.executable, "-m", "yatt_mm.cli", "prep", "images", image_list, "--out",
                                "gs://prep/ds", *ARGS], env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert again.returncode == 0, again.stderr[-2000:]
        assert "(resumed) -> gs://prep/ds" in again.stdout, again.stdout
        after = objects()  # nothing prepared or uploaded twice; the index and the stats written anew
        assert {k: v for k, v in after.items() if k.startswith("shard-")} == {
            k: v for k, v in seen.items() if k.startswith("shard-")}
        _assert_same_outputs(after, local_prep)

        monkeypatch.setenv("YATT_MM_CACHE", str(tmp_path / "cache-3"))
        from yatt_mm.cli import main

        with pytest.raises(SystemExit) as e:
            main(["prep", "images", image_list, "--out", "gs://no-such-bucket/ds", *ARGS])
        assert "gs://no-such-bucket/ds" in str(e.value) and "the bucket does not exist" in str(e.value), str(e.value)
        assert f"STORAGE_EMULATOR_HOST=http://127.0.0.1:{port}" in str(e.value), str(e.value)
    finally:
        server.stop()


def test_prep_refuses_an_out_it_cannot_write_before_any_work(image_list, s3_store, tmp_path, monkeypatch):
    for k, v in s3_store.admin.env(s3_store.endpoint).items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("YATT_MM_CACHE", str(tmp_path))
    from yatt_mm.cli import main

    for out, words in (("s3://no-such-bucket/ds", "the bucket does not exist"),
                       ("http://127.0.0.1:9/ds", "http(s) storage is read-only"),
                       ("s3://prep/ds?X-Amz-Signature=hunter2", "credentials in the URL")):
        with pytest.raises(SystemExit) as e:
            main(["prep", "images", image_list, "--out", out, *ARGS])
        assert words in str(e.value) and "hunter2" not in str(e.value), str(e.value)
    for k, v in s3_store.nobody.env(s3_store.endpoint).items():
        monkeypatch.setenv(k, v)
    s3_store.client().create_bucket(Bucket="prep-denied")
    with pytest.raises(SystemExit) as e:
        main(["prep", "images", image_list, "--out", "s3://prep-denied/ds", *ARGS])
    assert "s3://prep-denied/ds" in str(e.value) and "access denied (403)" in str(e.value), str(e.value)
    assert s3_store.nobody.secret_key not in str(e.value)
