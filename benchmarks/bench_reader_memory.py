"""A reader's peak RSS with 1x and 10x the shards (same shard contents copied under new names):
each reader runs in a fresh process, indexes its shards and decodes a whole epoch (10x the
samples for 10x), with 2 decode threads. Memory must not grow with the dataset: the index is
flat arrays, open files are capped, and nothing decoded is buffered beyond the mapper's queues.
Last line: one JSON object."""

from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._common import full_or_smoke  # noqa: E402

SHARDS_1X = full_or_smoke(4, 2)
PER_SHARD = full_or_smoke(60, 8)
VIDEOS = full_or_smoke(8, 2)  # of each 1x copy's samples


def child(root: str) -> None:
    from dataio.reader import DataConfig, DataReader

    reader = DataReader(DataConfig(shards=[root], workers=2))
    n = sum(1 for _ in reader.iter_epoch())
    reader.close()
    peak_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"samples": n, "skips": sum(reader.skips.values()), "peak_rss_mb": peak_kb / 1024}))


def run(root: str) -> dict:
    out = subprocess.run([sys.executable, __file__, "--child", root], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    from dataio.synth import write_shards

    with tempfile.TemporaryDirectory() as tmp:
        one, ten = os.path.join(tmp, "x1"), os.path.join(tmp, "x10")
        paths = write_shards(one, images=SHARDS_1X * PER_SHARD - VIDEOS, videos=VIDEOS, samples_per_shard=PER_SHARD,
                             image_size=448, video_size=112, seed=1)
        os.makedirs(ten)
        for c in range(10):
            for p in paths:
                shutil.copy(p, os.path.join(ten, f"c{c}-{os.path.basename(p)}"))
        a, b = run(one), run(ten)
    assert a["samples"] * 10 == b["samples"] and a["skips"] == b["skips"] == 0, (a, b)
    print(f"1x: {a['samples']} samples, peak RSS {a['peak_rss_mb']:.0f} MB; 10x: {b['samples']} samples, "
          f"peak RSS {b['peak_rss_mb']:.0f} MB")
    print(json.dumps({"shards_1x": SHARDS_1X, "samples_1x": a["samples"], "samples_10x": b["samples"],
                      "peak_rss_mb_1x": round(a["peak_rss_mb"], 1), "peak_rss_mb_10x": round(b["peak_rss_mb"], 1),
                      "rss_ratio_10x_to_1x": round(b["peak_rss_mb"] / a["peak_rss_mb"], 3)}))


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        child(sys.argv[2])
    else:
        main()
