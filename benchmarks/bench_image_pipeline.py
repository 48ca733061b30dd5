"""Image pipeline throughput: dataio (read shards by offset, decode, resize to the Qwen2-VL size)
with 2 workers, against (a) the compute limit: the same decode+resize with PIL in a tight loop
over in-memory bytes, one process per core, no I/O and no framework; (b) plain webdataset +
torch DataLoader with 2 worker processes doing the same decode+resize. Rounds are interleaved
and the best of each is kept (other tenants' load swings wall-clock figures); also reported:
the median of the per-round ratios (each from runs seconds apart), and images per CPU-second
of each (all threads and processes of the run), which other tenants' load hardly moves.

Also reported separately: the draft-mode configuration (target smaller than half the source:
JPEG DCT-domain downscale), against its own tight-loop limit.

Last line: one JSON object.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import resource
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._common import full_or_smoke, photo_like_jpeg, write_shards  # noqa: E402
from dataio.decode import MediaConfig, decode_image  # noqa: E402

N_IMAGES = int(os.environ.get("BENCH_IMAGES", full_or_smoke(600, 16)))
ROUNDS = int(os.environ.get("BENCH_ROUNDS", full_or_smoke(5, 1)))
CORES = 2
FULL = MediaConfig(image_draft=False)  # 512x512 -> 504x504 (target is not smaller: no draft anyway)
DRAFT = MediaConfig(image_max_pixels=224 * 224, image_draft=True)  # -> 224x224 via a 1/2-scale decode


def _cpu_s() -> float:
    """CPU seconds of this process (all threads) and its reaped children."""
    a, b = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return a.ru_utime + a.ru_stime + b.ru_utime + b.ru_stime


def _limit_worker(args):
    datas, media, barrier = args
    barrier.wait()
    t, c = time.perf_counter(), time.process_time()
    for d in datas:
        decode_image(d, media)
    return time.perf_counter() - t, time.process_time() - c


def limit(datas, media) -> tuple[float, float]:
    """PIL decode+resize in a tight loop, the images split over CORES processes started together.
    (images/s, images per CPU-second)"""
    ctx = mp.get_context("fork")
    with ctx.Manager() as m:
        barrier = m.Barrier(CORES)
        parts = [datas[i::CORES] for i in range(CORES)]
        with ctx.Pool(CORES) as pool:
            res = pool.map(_limit_worker, [(p, media, barrier) for p in parts])
    return len(datas) / max(t for t, _ in res), len(datas) / sum(c for _, c in res)


def dataio_rate(root, media, workers=2) -> tuple[float, float]:
    from dataio.reader import DataConfig, DataReader

    reader = DataReader(DataConfig(shards=[root], workers=workers, media=media, seed=1))
    t, c = time.perf_counter(), _cpu_s()
    n = sum(1 for _ in reader.iter_epoch())
    dt, dc = time.perf_counter() - t, _cpu_s() - c
    reader.close()
    assert n == N_IMAGES, n
    return n / dt, n / dc


def _wds_decode(sample):
    return np.asarray(decode_image(sample["jpg"], FULL))


def webdataset_rate(paths, workers=2) -> tuple[float, float]:
    import torch
    import webdataset as wds

    ds = wds.WebDataset(paths, shardshuffle=False, nodesplitter=None, workersplitter=wds.split_by_worker,
                        empty_check=False).map(_wds_decode)
    loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=workers, prefetch_factor=4)
    t, c = time.perf_counter(), _cpu_s()
    n = sum(1 for _ in loader)
    del loader  # joins the worker processes, so that their CPU time is counted
    dt, dc = time.perf_counter() - t, _cpu_s() - c
    assert n == N_IMAGES, n
    return n / dt, n / dc


def main() -> None:
    rng = np.random.default_rng(0)
    datas = [photo_like_jpeg(rng) for _ in range(N_IMAGES)]
    kb = sum(map(len, datas)) / len(datas) / 1024
    with tempfile.TemporaryDirectory() as tmp:
        paths = write_shards(tmp, [(f"k{i:06d}", "jpg", d) for i, d in enumerate(datas)], per_shard=N_IMAGES // 8)
        from dataio.index import build_index

        build_index(paths, os.path.join(tmp, "index.parquet"))
        keys = ("limit", "dataio", "webdataset", "draft_limit", "draft_dataio")
        rounds = []
        load0 = os.getloadavg()[0]
        for r in range(ROUNDS):
            got = {"limit": limit(datas, FULL), "dataio": dataio_rate(tmp, FULL), "webdataset": webdataset_rate(paths),
                   "draft_limit": limit(datas, DRAFT), "draft_dataio": dataio_rate(tmp, DRAFT)}
            rounds.append(got)
            print(f"round {r + 1}/{ROUNDS} (load {os.getloadavg()[0]:.1f}): "
                  + ", ".join(f"{k} {v[0]:.0f} img/s ({v[1]:.0f}/cpu-s)" for k, v in got.items()), flush=True)
        load1 = os.getloadavg()[0]
    best = {k: max(g[k][0] for g in rounds) for k in keys}
    per_cpu = {k: float(np.median([g[k][1] for g in rounds])) for k in keys}

    def med_ratio(a, b):
        return round(float(np.median([g[a][0] / g[b][0] for g in rounds])), 3)

    out = {
        "images": N_IMAGES, "image_kb": round(kb, 1), "source": "512x512 JPEG", "target": "504x504 (full decode)",
        "workers": 2, "cores": os.cpu_count(), "rounds": ROUNDS, "load_avg_start_end": [round(load0, 1), round(load1, 1)],
        "img_per_s": round(best["dataio"], 1),
        "limit_img_per_s": round(best["limit"], 1),
        "webdataset_img_per_s": round(best["webdataset"], 1),
        "ratio_to_limit": round(best["dataio"] / best["limit"], 3),
        "ratio_to_webdataset": round(best["dataio"] / best["webdataset"], 3),
        "median_round_ratio_to_limit": med_ratio("dataio", "limit"),
        "median_round_ratio_to_webdataset": med_ratio("dataio", "webdataset"),
        "img_per_cpu_s": round(per_cpu["dataio"], 1), "limit_img_per_cpu_s": round(per_cpu["limit"], 1),
        "webdataset_img_per_cpu_s": round(per_cpu["webdataset"], 1),
        "cpu_ratio_to_limit": round(per_cpu["dataio"] / per_cpu["limit"], 3),
        "draft_target": "224x224 (JPEG draft 1/2 scale)",
        "draft_img_per_s": round(best["draft_dataio"], 1),
        "draft_limit_img_per_s": round(best["draft_limit"], 1),
        "draft_ratio_to_draft_limit": round(best["draft_dataio"] / best["draft_limit"], 3),
        "draft_median_round_ratio": med_ratio("draft_dataio", "draft_limit"),
        "draft_cpu_ratio_to_draft_limit": round(per_cpu["draft_dataio"] / per_cpu["draft_limit"], 3),
        "draft_ratio_to_full_limit": round(best["draft_dataio"] / best["limit"], 3),
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
