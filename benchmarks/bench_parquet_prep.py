"""Memory of `yatt-mm prep images` on a large Hugging Face parquet file, against reading the
file whole.

Writes a `datasets`-style parquet (an `images` column of {bytes, path} structs, chat-message
prompts, reward_model.ground_truth answers; 100 rows per row group, no compression and no
dictionary, so the file is as large as its images) of about --mb MiB, then in the same run:
- prep: `yatt-mm prep images FILE --out OUT --workers 2`, its process tree's peak memory (the sum
  of PSS) sampled every 50 ms (the parent reads the parquet one row group at a time and stages the
  bytes; the workers decode and re-encode);
- baseline: `pyarrow.parquet.read_table(FILE)` in a fresh process (what loading the file whole
  costs), its peak RSS.
Last line: JSON with file_mb, prep_peak_rss_mb (PSS of the tree), read_table_peak_rss_mb,
prep_rss_over_file (the prep's peak as a share of the file size), samples and prep_seconds.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

import psutil

from _common import full_or_smoke

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROWS_PER_GROUP = 100


def write_parquet(path: str, mb: int, side: int = 320) -> int:
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq
    from PIL import Image

    rng = np.random.default_rng(0)
    pool = []
    for _ in range(64):  # distinct noise JPEGs (incompressible), reused across rows
        buf = io.BytesIO()
        Image.fromarray(rng.integers(0, 255, (side, side, 3), dtype=np.uint8)).save(buf, "JPEG", quality=95)
        pool.append(buf.getvalue())
    per_row = sum(map(len, pool)) / len(pool)
    rows = int(mb * 2**20 / per_row)
    struct = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    schema = pa.schema([("images", pa.list_(struct)), ("prompt", pa.list_(pa.struct([("role", pa.string()),
                                                                                      ("content", pa.string())]))),
                        ("reward_model", pa.struct([("ground_truth", pa.string())]))])
    with pq.ParquetWriter(path, schema, compression="none", use_dictionary=False) as w:
        for start in range(0, rows, ROWS_PER_GROUP):
            n = min(ROWS_PER_GROUP, rows - start)
            w.write_table(pa.table({
                "images": [[{"bytes": pool[(start + i) % len(pool)], "path": f"{start + i}.jpg"}] for i in range(n)],
                "prompt": [[{"role": "user", "content": f"<image>What is in picture {start + i}?"}] for i in range(n)],
                "reward_model": [{"ground_truth": str((start + i) % 7)} for i in range(n)],
            }, schema=schema))
    return rows


def tree_peak_rss(cmd: list[str]) -> tuple[float, float, int]:
    """(peak memory in MiB of the process and its children, seconds, exit code). Memory is the
    sum of PSS (forked workers share the parent's pages: summing RSS would count them twice)."""
    t0 = time.time()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    root = psutil.Process(proc.pid)
    peak = 0
    while proc.poll() is None:
        try:
            procs = [root] + root.children(recursive=True)
            peak = max(peak, sum(p.memory_full_info().pss for p in procs if p.is_running()))
        except psutil.Error:
            pass
        time.sleep(0.05)
    err = proc.stderr.read().decode()[-2000:]
    if proc.returncode:
        sys.exit(f"failed: {' '.join(cmd)}\n{err}")
    return peak / 2**20, time.time() - t0, proc.returncode


def read_whole(path: str) -> None:
    import pyarrow.parquet as pq

    table = pq.read_table(path)
    print(json.dumps({"rows": table.num_rows, "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=int, default=full_or_smoke(2048, 4), help="size of the parquet file to write")
    ap.add_argument("--read-whole", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.read_whole:
        return read_whole(args.read_whole)
    with tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR", "/tmp")) as tmp:
        src = os.path.join(tmp, "train.parquet")
        t0 = time.time()
        rows = write_parquet(src, args.mb)
        file_mb = os.path.getsize(src) / 2**20
        print(f"wrote {src}: {rows} rows, {file_mb:.0f} MiB in {time.time() - t0:.0f}s", flush=True)
        prep_peak, prep_s, _ = tree_peak_rss([sys.executable, "-m", "yatt_mm.cli", "prep", "images", src, "--out",
                                              os.path.join(tmp, "out"), "--workers", "2", "--no-progress"])
        stats = json.load(open(os.path.join(tmp, "out", "stats.json")))
        print(f"prep: {stats['samples']} samples in {prep_s:.0f}s, peak {prep_peak:.0f} MiB (PSS of the process tree)")
        out = subprocess.run([sys.executable, __file__, "--read-whole", src], capture_output=True, text=True, check=True)
        whole = json.loads(out.stdout.strip().splitlines()[-1])
        print(f"baseline pyarrow.parquet.read_table: peak RSS {whole['peak_rss_mb']:.0f} MiB")
        print(json.dumps({"file_mb": round(file_mb), "prep_peak_rss_mb": round(prep_peak),
                          "read_table_peak_rss_mb": round(whole["peak_rss_mb"]),
                          "prep_rss_over_file": round(prep_peak / file_mb, 3), "samples": stats["samples"],
                          "prep_seconds": round(prep_s, 1)}))


if __name__ == "__main__":
    main()
