"""Shards in object storage: decoded images/s read from an S3 server with 20 ms added to every
request, against the same shards on local disk, both at the reader's defaults (data.workers,
data.read_ahead, data.read_merge_mb); target remote_vs_local >= 0.8. The same rounds read the
bucket once more with one request per sample (read_merge_mb 0: `remote_unmerged_vs_local`). The
server is moto's S3 server on 127.0.0.1 (tests/s3_store.py, signatures off: its policy check would
cost the cores the readers measure on), the 20 ms added by the fault proxy of the tests, which also
counts the requests (requests_per_sample: ranged GETs while reading, per decoded image). At this
size a merged read can take a whole shard's samples, so `requests_per_sample_100k` says what the
reader's merging gives on a larger dataset: its ReadAhead run over the order of 100,000 samples
(1,000 a shard, 77 KB each) at the defaults, with storage replaced by a counter of requests (no
bytes move). The peer baseline is
Megatron-Energon's loader (`megatron-energon`, the `bench` extra) reading the same shards from
the same server through NVIDIA's multi-storage-client, after `energon prepare`, with the same
decode and resize in its 2 workers (each dropping the connections it inherits at fork: see
`fresh_connections`); where it is not installed or fails, `vs_energon` is null and
`energon_note` says why. Rounds are interleaved, the best of each kept (other tenants' load swings
wall-clock figures).

Last line: one JSON object with `remote_vs_local`, `vs_energon`, `requests_per_sample` (and
`requests_per_sample_100k`).
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from benchmarks._common import full_or_smoke, photo_like_jpeg, write_shards  # noqa: E402

N_IMAGES = int(os.environ.get("BENCH_IMAGES", full_or_smoke(480, 16)))
ROUNDS = int(os.environ.get("BENCH_ROUNDS", full_or_smoke(3, 1)))
LATENCY_S = 0.020
TARGET = 0.8


def _cpu_s() -> float:
    a = resource.getrusage(resource.RUSAGE_SELF)
    return a.ru_utime + a.ru_stime


def dataio_rate(shards: str, **settings) -> tuple[float, float]:
    """Decoded images/s of one epoch at the reader's defaults (but `settings`), and the reader's
    CPU seconds."""
    from dataio.reader import DataConfig, DataReader

    reader = DataReader(DataConfig(shards=[shards], seed=1, **settings))
    reader.order()  # opening (the index) is not reading
    t, c = time.perf_counter(), _cpu_s()
    n = sum(1 for s in reader.iter_epoch() if s.images)
    dt, dc = time.perf_counter() - t, _cpu_s() - c
    reader.close()
    assert n == N_IMAGES and not reader.skips, (n, reader.skips)
    return n / dt, dc


def _proxy_process(upstream_port: int, conn) -> None:
    """The fault proxy in a process of its own, so that the reader's CPU time is the reader's."""
    from s3_store import FaultProxy

    proxy = FaultProxy(upstream_port, latency_s=LATENCY_S)
    conn.send(proxy.url)
    while (msg := conn.recv()) != "stop":
        if msg == "reset":
            proxy.reset_counts()
        conn.send(len(proxy.ranged_gets()))
    proxy.close()


class _CountingStore:
    """Stands in for RemoteReads where only the number of requests is wanted."""

    caching = False

    def __init__(self):
        self.requests = 0

    def has(self, url, start, end) -> bool:
        return False

    def submit(self, url, start, end):
        from concurrent.futures import Future

        self.requests += 1
        done = Future()
        done.set_result(b"")
        return done


def requests_per_sample_at_scale(n: int = 100_000, per_shard: int = 1000, sample_bytes: int = 77 * 1024) -> float:
    """Ranged requests per sample the reader's merged reads make over one epoch of an n-sample
    dataset at the data defaults (seed, slices, shuffle buffer, read_ahead, read_merge_mb)."""
    from dataio.reader import DataConfig
    from dataio.split import rank_order
    from dataio.storage import ReadAhead

    c = DataConfig()
    todo = rank_order(n, 0, 1, c.seed, 0, c.slice_size, c.shuffle_buffer, c.shuffle).tolist()
    gap = 1024  # tar headers between samples

    def span(i: int):
        at = (i % per_shard) * (sample_bytes + gap)
        return f"s3://bucket/shard-{i // per_shard:06d}.tar", at, at + sample_bytes

    store = _CountingStore()
    ahead = ReadAhead(store, todo, span, c.read_ahead, merge_bytes=int(c.read_merge_mb * 2**20),
                      reach=c.slice_size + 4 * c.shuffle_buffer)
    for pos in range(len(todo)):
        ahead[pos]
    return store.requests / n


class Proxy:
    def __init__(self, upstream_port: int):
        import psutil

        self.conn, child = mp.get_context("fork").Pipe()
        self.proc = mp.get_context("fork").Process(target=_proxy_process, args=(upstream_port, child), daemon=True)
        self.proc.start()
        self.url = self.conn.recv()
        self.ps = psutil.Process(self.proc.pid)

    def ask(self, msg: str) -> int:
        self.conn.send(msg)
        return self.conn.recv()

    def close(self) -> None:
        self.conn.send("stop")
        self.proc.join(10)


def _cpu_of(ps) -> float:
    t = ps.cpu_times()
    return t.user + t.system


ENERGON_CHILD = r"""
import json, os, sys, time
import numpy as np
from megatron.energon import WorkerConfig, get_loader, get_train_dataset, basic_sample_keys, stateless
from megatron.energon.flavors.webdataset import DefaultDecoderWebdatasetFactory
from megatron.energon.task_encoder import DefaultTaskEncoder
from megatron.energon.task_encoder.cooking import Cooker
from dataio.decode import MediaConfig, decode_image
path, n_images = sys.argv[1], int(sys.argv[2])
media = MediaConfig()


def fresh_connections():
    # Energon forks its workers after this process has opened a kept-alive connection (reading the
    # dataset's metadata through multi-storage-client's boto3 client); without this both workers
    # send on that one socket and get each other's bytes. Each worker drops the inherited pools.
    import gc
    import urllib3

    for obj in gc.get_objects():
        if isinstance(obj, urllib3.PoolManager):
            obj.clear()


os.register_at_fork(after_in_child=fresh_connections)

@stateless
def cook(sample):  # the bytes as read, decoded and resized as dataio does
    return np.asarray(decode_image(sample["jpg"], media))

class Encoder(DefaultTaskEncoder):
    decoder = None  # the bytes as stored: the cooker decodes them as dataio does
    cookers = [Cooker(cook)]
    def encode_sample(self, sample):
        return sample
    def batch(self, samples):
        return samples

ds = get_train_dataset(path, batch_size=1, shuffle_buffer_size=None, max_samples_per_sequence=None,
                       worker_config=WorkerConfig(rank=0, world_size=1, num_workers=2), task_encoder=Encoder())
loader = get_loader(ds)
it = iter(loader)
next(it)  # the workers started and the first sample read: the start is not the rate
t = time.perf_counter()
n = 1
while n < n_images:
    n += len(next(it))
print(json.dumps({"img_per_s": (n - 1) / (time.perf_counter() - t)}))
"""


def energon_setup(local: str, store, proxy_url: str, tmp: str) -> tuple[str, dict] | str:
    """`energon prepare` on a copy of the shards, uploaded to the bucket with its .nv-meta; the
    multi-storage-client profile pointing at the proxy. (dataset path, env) or why not."""
    try:
        import megatron.energon  # noqa: F401
    except ImportError as e:
        return f"megatron-energon is not installed (pip install 'yatt-mm[bench]'): {e}"
    import shutil

    ds = os.path.join(tmp, "energon")
    shutil.copytree(local, ds, ignore=shutil.ignore_patterns("index.parquet"))
    prep = subprocess.run([sys.executable, "-m", "megatron.energon.cli.main", "prepare", ds, "--non-interactive",
                           "--split-ratio", "1,0,0", "--sample-type", "CrudeWebdataset", "--no-progress",
                           "--num-workers", "1"], capture_output=True, text=True, timeout=600)
    if prep.returncode != 0:
        return f"energon prepare failed: {(prep.stderr or prep.stdout)[-400:]}"
    s3 = store.client()
    prefix = f"energon-{os.getpid()}-{time.time_ns()}"  # fresh names: nothing cached under them from a run before
    for p in sorted(Path(ds).rglob("*")):
        if p.is_file():
            s3.upload_file(str(p), "bench", f"{prefix}/{p.relative_to(ds)}")
    msc = os.path.join(tmp, "msc.json")
    with open(msc, "w") as f:
        json.dump({"profiles": {"bench": {"storage_provider": {"type": "s3", "options": {
            "base_path": "bench", "endpoint_url": proxy_url, "region_name": "us-east-1"}},
            "credentials_provider": {"type": "S3Credentials", "options": {
                "access_key": store.admin.access_key, "secret_key": store.admin.secret_key}}}}}, f)
    return f"msc://bench/{prefix}", {"MSC_CONFIG": msc}


def energon_rate(path: str, env: dict) -> float | str:
    done = subprocess.run([sys.executable, "-c", ENERGON_CHILD, path, str(N_IMAGES)], capture_output=True, text=True,
                          timeout=900, env={**os.environ, "PYTHONPATH": str(ROOT), **env}, cwd=ROOT)
    if done.returncode != 0:
        return f"Energon's loader failed on these shards: {done.stderr.strip().splitlines()[-1][-400:]}"
    return json.loads(done.stdout.strip().splitlines()[-1])["img_per_s"]


def main() -> None:
    import psutil

    from dataio.index import build_index
    from s3_store import S3Store

    rng = np.random.default_rng(0)
    datas = [photo_like_jpeg(rng) for _ in range(N_IMAGES)]
    kb = sum(map(len, datas)) / len(datas) / 1024
    store = S3Store.start(auth=False)
    server = psutil.Process(store.proc.pid)
    proxy = Proxy(int(store.endpoint.rsplit(":", 1)[1]))
    saved = {k: os.environ.get(k) for k in store.admin.env(proxy.url)}
    os.environ.update(store.admin.env(proxy.url))
    try:
        with tempfile.TemporaryDirectory() as tmp:
            local = os.path.join(tmp, "ds")
            paths = write_shards(local, [(f"k{i:06d}", "jpg", d) for i, d in enumerate(datas)],
                                 per_shard=max(8, N_IMAGES // 8))
            build_index(paths, os.path.join(local, "index.parquet"))
            url = store.upload_dir(local, "bench", "ds")  # the shards and their index
            energon = energon_setup(local, store, proxy.url, tmp)
            energon_note = energon if isinstance(energon, str) else ""
            rounds = []
            for r in range(ROUNDS):
                got = {}
                got["local"], cpu = dataio_rate(local)
                got["local_cpu_ms"] = cpu / N_IMAGES * 1000
                proxy.ask("reset")
                s0, p0 = _cpu_of(server), _cpu_of(proxy.ps)
                got["remote"], cpu = dataio_rate(url)
                got["remote_cpu_ms"] = cpu / N_IMAGES * 1000
                got["server_cpu_ms"] = (_cpu_of(server) - s0) / N_IMAGES * 1000
                got["proxy_cpu_ms"] = (_cpu_of(proxy.ps) - p0) / N_IMAGES * 1000
                got["requests_per_sample"] = proxy.ask("count") / N_IMAGES
                got["remote_unmerged"], _ = dataio_rate(url, read_merge_mb=0)  # a request per sample
                if not energon_note:
                    rate = energon_rate(*energon)
                    if isinstance(rate, str):
                        energon_note = rate
                    else:
                        got["energon"] = rate
                rounds.append(got)
                print(f"round {r + 1}/{ROUNDS} (load {os.getloadavg()[0]:.1f}): local {got['local']:.1f} img/s, "
                      f"s3 +{LATENCY_S * 1000:.0f} ms {got['remote']:.1f} img/s "
                      f"({got['requests_per_sample']:.2f} requests/sample; a request per sample "
                      f"{got['remote_unmerged']:.1f} img/s); CPU ms per image: reader "
                      f"{got['local_cpu_ms']:.1f} local, {got['remote_cpu_ms']:.1f} remote, S3 server "
                      f"{got['server_cpu_ms']:.1f}, proxy {got['proxy_cpu_ms']:.1f}"
                      + (f", Energon from s3 {got['energon']:.1f} img/s" if "energon" in got else ""), flush=True)
    finally:
        proxy.close()
        store.stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    best = {k: max(g[k] for g in rounds) for k in ("local", "remote", "remote_unmerged")}
    cpu_ms = {k: float(np.median([g[k] for g in rounds]))
              for k in ("local_cpu_ms", "remote_cpu_ms", "server_cpu_ms", "proxy_cpu_ms")}
    energon_best = max((g["energon"] for g in rounds if "energon" in g), default=None)
    if energon_note:
        print(f"Energon baseline: none ({energon_note})")
    out = {
        "images": N_IMAGES, "image_kb": round(kb, 1), "rounds": ROUNDS, "latency_ms": LATENCY_S * 1000,
        "local_img_per_s": round(best["local"], 1), "remote_img_per_s": round(best["remote"], 1),
        "remote_vs_local": round(best["remote"] / best["local"], 3), "target": TARGET,
        "met": best["remote"] / best["local"] >= TARGET,
        # the same without merged reads (data.read_merge_mb=0): one ranged GET per sample
        "remote_unmerged_vs_local": round(best["remote_unmerged"] / best["local"], 3),
        "requests_per_sample": round(max(g["requests_per_sample"] for g in rounds), 3),
        "requests_per_sample_100k": round(requests_per_sample_at_scale(full_or_smoke(100_000, 5_000)), 3),
        # CPU per decoded image: the reader's process (decode, the S3 client), and where the
        # server and the proxy take theirs from the same cores (a real store's are elsewhere)
        **{k: round(v, 2) for k, v in cpu_ms.items()},
        "remote_vs_local_reader_cpu": round(cpu_ms["local_cpu_ms"] / cpu_ms["remote_cpu_ms"], 3),
        "energon_img_per_s": None if energon_best is None else round(energon_best, 1),
        "vs_energon": None if energon_best is None else round(best["remote"] / energon_best, 3),
        "energon_note": energon_note or None,
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
