"""Shards in object storage (dataio/storage.py): the real s3fs client against moto's real S3
server on 127.0.0.1, gcsfs against a real GCS-protocol server (the gcp-storage-emulator package),
and fsspec's HTTP client against a real HTTP server (tests/s3_store.py).
Latency and faults (503, a reset mid-body, a stalled answer) come from a small proxy between
client and server: the server cannot be made to fail on cue, the proxy can."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from dataio import storage
from dataio.index import check_shard_specs, expand_shards, open_dataset
from dataio.reader import DataConfig, DataReader
from yatt_mm.rl.sources import to_prompt
from s3_store import Fault, FaultProxy, free_port, serve_directory

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def proxy(s3_store, monkeypatch):
    """A fault proxy in front of the S3 server, and this process's AWS variables pointing at it."""
    p = FaultProxy(int(s3_store.endpoint.rsplit(":", 1)[1]))
    for k, v in s3_store.admin.env(p.url).items():
        monkeypatch.setenv(k, v)
    yield p
    p.close()


def _cfg(shards, **kw) -> DataConfig:
    return DataConfig(shards=[str(s) for s in shards], seed=5, video_isolation="none", **kw)


def _digest(sample) -> str:
    """The sample's key, answer, pixels and the draw that seeds its rollouts (the same wherever
    its shard sits, so a seeded run samples alike from a bucket and from disk)."""
    prompt = to_prompt(sample)
    h = hashlib.sha1(sample.key.encode() + str(sample.answer).encode() + (prompt.origin if prompt else "").encode())
    for im in sample.images:
        h.update(np.asarray(im).tobytes())
    for v in sample.videos:
        h.update(v.tobytes())
    return h.hexdigest()


def _read(reader: DataReader) -> list[tuple[str, str]]:
    try:
        return [(s.key, _digest(s)) for s in reader.iter_epoch()]
    finally:
        reader.close()


def _ranges(requests: list[str]) -> list[tuple[str, int, int]]:
    """(object path, start, end) of each ranged GET the proxy saw ("GET /bucket/key bytes=a-b")."""
    out = []
    for r in requests:
        if r.startswith("GET ") and "bytes=" in r:
            path, spec = r.split()[1], r.rsplit("bytes=", 1)[1]
            a, b = spec.split("-")
            out.append((path.split("?")[0], int(a), int(b) + 1))
    return out


def test_s3_shards_give_the_same_samples_as_local_ones_in_merged_ranged_gets(s3_dataset, proxy):
    """The same keys in the same order with the same decoded pixels as from disk. By default a
    ranged GET brings a sample with its neighbours in the shard (this reader's, read soon): far
    fewer GETs than samples, no byte read twice, only bytes between samples' spans read beside
    theirs. With data.read_merge_mb=0 each sample's members (a frame sequence has 9) come in one
    ranged GET of their own, over a few reused connections."""
    local, url = s3_dataset
    want = _read(DataReader(_cfg([local], workers=2)))
    reader = DataReader(_cfg([url], workers=2, read_ahead=4))
    proxy.reset_counts()  # what opening cost (a listing, the tar scan) is not what reading costs
    got = _read(reader)
    assert got == want and len(got) == 24
    ranges = _ranges(proxy.requests)
    assert len(ranges) == len(proxy.requests) <= 6, proxy.requests  # 3 shards of 8 samples
    spans = [reader.decoder.span(i) for i in range(24)]
    for path in {p for p, _, _ in ranges}:  # each shard's bytes read at most once, and only where samples are
        read = sorted((a, b) for p, a, b in ranges if p == path)
        assert all(b0 <= a1 for (_, b0), (a1, _) in zip(read, read[1:])), read
        mine = [(a, b) for u, a, b in spans if u.endswith(path)]
        assert min(a for a, _ in read) == min(a for a, _ in mine) and max(b for _, b in read) == max(b for _, b in mine)
    assert reader.remote_retries == 0 and not reader.skips
    # decode processes get each sample's own bytes from a merged read, as threads do
    assert _read(DataReader(_cfg([url], workers=2, worker_kind="process"))) == want

    small = DataReader(_cfg([url], workers=2, read_ahead=4, read_merge_mb=0.02))  # bytes ahead bounded
    proxy.reset_counts()
    assert _read(small) == want
    ranges = _ranges(proxy.requests)
    own = {("/" + u.split("://", 1)[1], a, b) for u, a, b in spans}
    assert 6 < len(ranges) < 24 and all(b - a <= 0.02 * 2**20 or (p, a, b) in own for p, a, b in ranges), ranges

    reader = DataReader(_cfg([url], workers=2, read_ahead=4, read_merge_mb=0))
    proxy.reset_counts()
    assert _read(reader) == want
    assert sorted(_ranges(proxy.requests)) == sorted(("/" + u.split("://", 1)[1], a, b) for u, a, b in spans)
    assert len(proxy.ranged_gets()) == len(proxy.requests) == 24, proxy.requests
    assert proxy.connections <= 5, proxy.connections  # the window's 4 (+1 asked for), each reused


def test_a_merged_read_hands_out_each_samples_own_bytes_and_falls_back_to_its_own_read_when_it_keeps_failing(s3_dataset, proxy):
    """One shard's 8 samples in one merged GET, each handed out as its own bytes. That GET cut
    mid-body on both its attempts: each sample is then read on its own (8 ranged GETs, each its span) and decoded, nothing skipped; with
    the shard failing for good, each sample carries its own read's error (a skip each)."""
    from dataio.storage import ReadAhead, RemotePolicy, RemoteReads

    _, url = s3_dataset
    reader = DataReader(_cfg([url]))
    shard = reader.index.shards[0]
    mine = [i for i in range(len(reader.index)) if reader.index.shard_of(i) == shard]
    spans = [reader.decoder.span(i) for i in mine]
    path = shard.split("://", 1)[1]
    reads = RemoteReads(RemotePolicy(attempts=2, backoff_s=0.01))
    own = [reads.read(shard, a, b) for _, a, b in spans]
    proxy.reset_counts()  # merged, as decoders get it: each sample its own bytes (a process worker's pickle)
    ahead = ReadAhead(reads, mine, reader.decoder.span, window=2, merge_bytes=1 << 30, reach=100)
    assert [ahead[pos] for pos in range(len(mine))] == [(i, (a, b)) for i, (_, a, _), b in zip(mine, spans, own)]
    assert len(proxy.ranged_gets()) == 1, proxy.requests
    proxy.reset_counts()
    proxy.rules = [Fault("reset", 2, match=path)]
    ahead = ReadAhead(reads, mine, reader.decoder.span, window=2, merge_bytes=1 << 30, reach=100)
    got = [ahead[pos] for pos in range(len(mine))]
    assert len(proxy.injected) == 2 and reads.retries == 1, proxy.injected
    merged = (f"/{path}", spans[0][1], spans[-1][2])
    assert _ranges(proxy.requests) == [merged, merged] + [(f"/{path}", a, b) for _, a, b in spans], proxy.requests
    assert got == [(i, (a, b)) for i, (_, a, _), b in zip(mine, spans, own)]
    proxy.rules = [Fault("reset", 100, match=path)]
    ahead = ReadAhead(reads, mine, reader.decoder.span, window=2, merge_bytes=1 << 30, reach=100)
    errors = [ahead[pos][1] for pos in range(len(mine))]
    assert all(isinstance(e, storage.RemoteReadError) for e in errors), errors
    assert [str(e).split(": ")[1] for e in errors] == [f"reading bytes {a}-{b} of it failed 2 times, last" for _, a, b in spans]


def test_the_read_ahead_window_overlaps_storage_latency(s3_dataset, proxy):
    """100 ms added to every request: 24 samples one after another would take 2.4 s; with 8 reads
    in flight they take about a tenth of that, plus decoding."""
    _, url = s3_dataset
    reader = DataReader(_cfg([url], workers=1, read_ahead=8, read_merge_mb=0))  # a request per sample
    proxy.latency_s = 0.1
    start = time.perf_counter()
    n = len(_read(reader))
    took = time.perf_counter() - start
    assert n == 24 and took < 1.2, took


def test_timeouts_503s_and_resets_mid_body_are_retried_and_counted(s3_dataset, proxy):
    """Two 503s, two resets half way through the body and a stalled answer (the 1 s timeout):
    every sample still decoded, the five retries counted."""
    local, url = s3_dataset
    want = _read(DataReader(_cfg([local], workers=0)))
    # a request per sample: the faults fall on five different ones
    reader = DataReader(_cfg([url], workers=2, read_timeout_s=1.0, read_merge_mb=0))
    proxy.rules = [Fault("503", 2), Fault("reset", 2), Fault("stall", 1)]
    proxy.stall_s = 3.0
    got = _read(reader)
    assert got == want
    assert len(proxy.injected) == 5 and reader.remote_retries == 5, proxy.injected
    assert not reader.skips and reader.state_dict()["remote_retries"] == 5


def test_a_sample_whose_reads_keep_failing_is_a_counted_quarantined_skip(s3_dataset, proxy, tmp_path):
    """Every read of one sample is cut mid-body: after its 3 attempts it is skipped, counted and
    named in the quarantine log; every other sample is read once, and the epoch ends where it
    should. When the store recovers, the next epoch reads it."""
    _, url = s3_dataset
    log = tmp_path / "quarantine.jsonl"
    reader = DataReader(_cfg([url], workers=2, read_attempts=3, read_merge_mb=0, quarantine_log=str(log)))
    victim = int(reader.order()[5])
    shard, start, end = reader.decoder.span(victim)
    proxy.rules = [Fault("reset", 100, match=f"{shard.split('://', 1)[1].split('/', 1)[1]} bytes={start}-{end - 1}")]
    got = [k for k, _ in _read(reader)]
    key = reader.index.sample_key[victim]
    assert len(proxy.injected) == 3 and reader.remote_retries == 2, proxy.injected
    assert dict(reader.skips) == {"remote_read_error": 1} and key not in got and len(got) == 23
    assert reader.epoch == 1 and reader.position == 0  # the whole epoch consumed, the skip included
    (line,) = [json.loads(x) for x in log.read_text().splitlines()]
    assert (line["reason"], line["key"], line["shard"]) == ("remote_read_error", key, shard)
    assert f"{shard}: reading bytes {start}-{end} of it failed 3 times, last: " in line["detail"], line
    proxy.rules = []
    assert key in [k for k, _ in _read(reader)]


READ_AND_RECORD = """
import json, os, sys
from dataio.reader import DataConfig, DataReader
from yatt_mm.rl.sources import to_prompt
log, url = sys.argv[1], sys.argv[2]
# reads merged 2-3 samples at a time (the samples are ~7 KB), so that several rounds of them are in flight
reader = DataReader(DataConfig(shards=[url], seed=5, workers=2, read_ahead=8, read_merge_mb=0.02, video_isolation="none"))
lines = [json.loads(x) for x in open(log).read().splitlines()] if os.path.exists(log) else []
if lines:
    reader.load_state_dict(lines[-1]["state"])
with open(log, "a") as f:
    for s in reader.iter_epoch():  # a line per sample: its key and the state after it (a checkpoint)
        f.write(json.dumps({"key": s.key, "state": reader.state_dict()}) + "\\n")
        f.flush()
"""


def test_kill_9_mid_read_and_resume_read_each_sample_once(s3_dataset, proxy, tmp_path):
    """A reader of S3 shards with reads in flight is killed -9; a new one resumes from the last
    state it recorded and reads the rest: together, the epoch's samples once each, in order."""
    _, url = s3_dataset
    proxy.latency_s = 0.05  # reads are in flight when the kill lands
    log = tmp_path / "consumed.jsonl"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-c", READ_AND_RECORD, str(log), url], env=env, cwd=ROOT,
                            stderr=subprocess.PIPE)
    deadline = time.time() + 60
    while time.time() < deadline and (not log.exists() or len(log.read_text().splitlines()) < 8):
        assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)
    first = [json.loads(x)["key"] for x in log.read_text().splitlines()]
    assert 8 <= len(first) < 24, len(first)
    again = subprocess.run([sys.executable, "-c", READ_AND_RECORD, str(log), url], env=env, cwd=ROOT,
                           capture_output=True, text=True, timeout=120)
    assert again.returncode == 0, again.stderr[-2000:]
    keys = [json.loads(x)["key"] for x in log.read_text().splitlines()]
    assert keys == DataReader(_cfg([url])).keys(0)


def test_missing_shards_a_missing_bucket_and_403_are_refused_naming_the_url(s3_store, s3_dataset, proxy,
                                                                              monkeypatch, capsys):
    """What a launcher checks before any rank starts (check_shard_specs): each refusal names the
    setting and the URL, and never the secret key."""
    _, url = s3_dataset
    cases = {f"{url}/missing.tar": (FileNotFoundError, "does not exist"),
             "s3://train/nothing-here": (FileNotFoundError, "holds no shards"),
             "s3://no-such-bucket/ds": (FileNotFoundError, "the bucket does not exist"),
             f"{url}/*.zip": (FileNotFoundError, "matches no object")}
    for spec, (error, words) in cases.items():
        with pytest.raises(error) as e:
            check_shard_specs([spec], "data.shards")
        assert str(e.value).startswith(f"data.shards: {spec}") and words in str(e.value), str(e.value)
    for k, v in s3_store.nobody.env(proxy.url).items():  # a real user the server knows, without a policy
        monkeypatch.setenv(k, v)
    with pytest.raises(PermissionError) as e:
        check_shard_specs([url], "eval.shards")
    assert str(e.value).startswith(f"eval.shards: {url}: access denied (403) when listing it"), str(e.value)
    assert s3_store.nobody.secret_key not in str(e.value)
    from yatt_mm.cli import main  # the data commands: one line naming the URL, exit 2, no traceback

    assert main(["data", "keys", url, "--dp-rank", "0", "--dp-size", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"yatt-mm data: data shards: {url}: access denied (403)") and len(err.splitlines()) == 1, err


def test_credentials_in_a_url_are_refused_and_never_shown():
    for url in ("https://user:hunter2@example.com/ds", "s3://bucket/ds?X-Amz-Signature=hunter2"):
        with pytest.raises(ValueError) as e:
            DataConfig(shards=[url]).validate()
        assert "hunter2" not in str(e.value) and str(e.value).startswith("data.shards[0]: "), str(e.value)
    with pytest.raises(ValueError, match="ftp:// is not a storage yatt-mm reads"):
        DataConfig(shards=["ftp://host/ds"]).validate()
    assert storage.redact("https://u:p@h:8080/a/b.tar?sig=1#x") == "https://h:8080/a/b.tar"


def test_an_index_in_the_bucket_is_found_beside_its_shards(s3_store, s3_dataset, proxy, tmp_path):
    """`yatt-mm data index s3://...` writes index.parquet beside the shards; readers then read
    it instead of scanning the shards (no whole-shard GET), and `keys` and `inspect` read from
    the bucket as from disk."""
    local, _ = s3_dataset
    url = s3_store.upload_dir(local, "train", "with-index", "*.tar")
    env = {**os.environ, "PYTHONPATH": str(ROOT), **s3_store.admin.env(proxy.url)}

    def cli(*args: str) -> str:
        done = subprocess.run([sys.executable, "-m", "yatt_mm.cli", "data", *args], env=env, cwd=tmp_path,
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr[-3000:]
        return done.stdout

    assert "wrote s3://train/with-index/index.parquet: 3 shards, 24 samples" in cli("index", url)
    proxy.reset_counts()
    idx = open_dataset([url])
    assert len(idx) == 24 and idx.shards == expand_shards([url])
    assert not [r for r in proxy.requests if r.startswith("GET ") and "bytes=" not in r and "list-type" not in r
                and r.split()[1].endswith(".tar")], proxy.requests  # no shard read whole
    local_keys = cli("keys", str(local), "--dp-rank", "1", "--dp-size", "2")
    assert cli("keys", url, "--dp-rank", "1", "--dp-size", "2") == local_keys and local_keys.count("\n") == 12
    counts = json.loads(cli("inspect", url, "--json").splitlines()[-1])
    assert (counts["decoded"], counts["skipped"]) == (24, 0), counts


def test_http_shards_read_by_range_as_local_ones(s3_dataset):
    """http(s):// shards, read only: a web server's directory of shards gives the same samples."""
    local, _ = s3_dataset
    server, base = serve_directory(local)
    try:
        got = _read(DataReader(_cfg([f"{base}/"], workers=2)))
        assert got == _read(DataReader(_cfg([local], workers=2)))
        with pytest.raises(FileNotFoundError, match=f"data.shards: {base}/nothing.tar does not exist"):
            check_shard_specs([f"{base}/nothing.tar"], "data.shards")
    finally:
        server.shutdown()


def test_gs_shards_read_by_range_as_local_ones_and_missing_ones_are_refused(s3_dataset, monkeypatch):
    """gs:// shards through gcsfs from a GCS-protocol server on 127.0.0.1 (gcp-storage-emulator,
    found through STORAGE_EMULATOR_HOST as gcsfs finds any such server), behind the counting proxy:
    the same samples as from disk, each in one ranged GET (or a few samples in one, merged); 503s, resets mid-body and a stall each
    retried and counted once; a missing shard and a missing bucket refused by name."""
    import fsspec
    from gcp_storage_emulator.server import create_server

    local, _ = s3_dataset
    port = free_port()
    server = create_server("127.0.0.1", port, in_memory=True, default_bucket="shards")
    server.start()
    proxy = FaultProxy(port)
    try:
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", proxy.url)
        fsspec.filesystem("gcs", skip_instance_cache=True).put(f"{local}/", "shards/ds/", recursive=True)
        reader = DataReader(_cfg(["gs://shards/ds/"], workers=2, read_merge_mb=0))
        proxy.reset_counts()
        got = _read(reader)
        assert got == _read(DataReader(_cfg([local], workers=2))) and len(got) == 24
        assert len(proxy.ranged_gets()) == 24 and not proxy.whole_reads(), proxy.requests
        merged = DataReader(_cfg(["gs://shards/ds/"], workers=2))  # the default: a few samples a GET
        proxy.reset_counts()
        assert _read(merged) == got
        assert len(proxy.ranged_gets()) <= 6 and not proxy.whole_reads(), proxy.requests
        # 503s, resets mid-body and a stalled answer through gcsfs: each retried once and counted
        # (gcsfs's own retries, up to 6 a request, are off as s3fs's are), every sample decoded. The
        # timeout is 3 s, not 1: this GCS-protocol server answers one request at a time (a
        # single-threaded HTTPServer), so with 1 s reads queued behind the read-ahead window time
        # out with no fault at all (9 of 24 did)
        faulty = DataReader(_cfg(["gs://shards/ds/"], workers=2, read_timeout_s=3.0, read_merge_mb=0))
        proxy.rules = [Fault("503", 2), Fault("reset", 2), Fault("stall", 1)]
        proxy.stall_s = 5.0
        assert _read(faulty) == got
        assert len(proxy.injected) == 5 and faulty.remote_retries == 5 and not faulty.skips, proxy.injected
        with pytest.raises(FileNotFoundError, match="data.shards: gs://shards/ds/nothing.tar does not exist"):
            check_shard_specs(["gs://shards/ds/nothing.tar"], "data.shards")
        with pytest.raises(FileNotFoundError, match="gs://elsewhere/.*the bucket does not exist.*STORAGE_EMULATOR_HOST="):
            check_shard_specs(["gs://elsewhere/ds/"], "data.shards")
    finally:
        proxy.close()
        server.stop()


def test_the_local_cache_serves_later_epochs_within_its_size_limit(s3_dataset, proxy, tmp_path):
    """data.read_cache_dir: the first epoch reads the bucket (a few merged ranged GETs) and
    keeps each sample's bytes under its own span, so the second reads the cache (no GET) and
    gives the same samples; with a limit below the data's size the cache
    stays under it (least recently used out) and the rest is read from the bucket again."""
    _, url = s3_dataset
    reader = DataReader(_cfg([url], workers=2, read_cache_dir=str(tmp_path / "cache")))
    proxy.reset_counts()
    first = _read(reader)
    assert 0 < len(proxy.ranged_gets()) <= 6 and reader.decoder.remote.cache_hits == 0, (proxy.requests, reader.skips)
    proxy.reset_counts()
    cached = DataReader(_cfg([url], workers=2, read_cache_dir=str(tmp_path / "cache")))
    again = _read(cached)
    assert sorted(again) == sorted(first) and not proxy.ranged_gets(), (proxy.requests, cached.decoder.remote.cache_hits)
    spans = [reader.decoder.span(i) for i in range(24)]
    total = sum(end - start for _, start, end in spans)
    import diskcache

    with diskcache.Cache(str(tmp_path / "empty")) as empty:
        overhead = empty.volume()  # SQLite's own pages count against the limit: 32 KiB when empty
    # half the data besides: diskcache culls up to 10 entries at once, so with a third of the data
    # alone (the database itself 32-45 KiB of it) a cull could leave 0 of the 7 KB samples, and this
    # failed in 1 run of 3
    limit = overhead + total // 2
    small = DataReader(_cfg([url], workers=2, read_cache_dir=str(tmp_path / "small"), read_cache_gb=limit / 2**30))
    proxy.reset_counts()
    assert sorted(_read(small)) == sorted(first) and proxy.ranged_gets(), proxy.requests
    with diskcache.Cache(str(tmp_path / "small")) as cache:
        assert 0 < len(cache) < 24, (len(cache), cache.volume(), limit)
        kept = sum(len(cache[k]) for k in cache.iterkeys())
    assert 0 < kept <= limit - overhead < total, (kept, limit, overhead, total)
