"""Weight sync into the rollout engine: seconds vs model bytes, and the memory a sync adds.

Speed: yatt-mm pushes (HF name, tensor) pairs into the running vLLM engine in place
(`reload_weights` RPC, then the encoder and prefix caches are dropped). Baselines in the same
run: the same RPC fed from a checkpoint file written to disk, and what a trainer without
in-place sync does: write an HF directory and start a new engine on it.

Memory: the RL loop's own `push_weights` (rl/step.py) at tensor parallel 2 (two ranks under
torchrun, each gathering full tensors from the TP shards, as on a GPU node), in one launch: with
buckets of `--bucket-mb`, then with one bucket (the whole model gathered, renamed and handed over
at once: what a sync without buckets does). Measured on rank 0 as the rise of the process's
resident memory above what it held before the sync (Linux VmHWM after resetting it; large
allocations are mmap'd so freed memory leaves the process at once), beside the model's bytes.

Last line: JSON with seconds and bytes (yatt-mm's in-place sync), the baselines, and
peak_extra_bytes_{one_bucket,bucketed} with model_bytes.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import models  # noqa: F401
from _common import full_or_smoke

# a smoke run: the tiny model (3 MB) in buckets of 1 MB, so that it still syncs in several
BUCKET_MB = full_or_smoke(16.0, 1.0)


def main(rounds: int = full_or_smoke(5, 1), bucket_mb: float = BUCKET_MB) -> None:
    from safetensors.torch import load_file, save_file

    from models.tiny import tiny_model_dir
    from yatt_mm.engines.engine import EngineConfig, RolloutEngine

    path = tiny_model_dir("policy")
    engine = RolloutEngine(EngineConfig(model=str(path)))
    weights = load_file(str(path / "model.safetensors"))
    nbytes = sum(t.numel() * t.element_size() for t in weights.values())
    ours, disk = [], []
    with tempfile.TemporaryDirectory() as tmp:
        f = Path(tmp) / "model.safetensors"
        for i in range(rounds):
            new = {k: v + 1e-3 * (i + 1) for k, v in weights.items()}
            ours.append(engine.update_weights(new.items())["seconds"])
            start = time.perf_counter()
            save_file(new, str(f))
            engine.update_weights(load_file(str(f)).items())  # same engine path, via the disk
            disk.append(time.perf_counter() - start)
        from models.hf_io import save_hf_dir

        start = time.perf_counter()
        fresh = RolloutEngine(EngineConfig(model=str(save_hf_dir(new, path, Path(tmp) / "hf"))))
        restart = time.perf_counter() - start
        fresh.shutdown()
    engine.update_weights(weights.items())
    engine.shutdown()
    s, d = statistics.median(ours), statistics.median(disk)
    print(f"in-place sync of {nbytes / 1e6:.2f} MB: {s * 1e3:.1f} ms ({nbytes / s / 1e9:.3f} GB/s); same RPC fed "
          f"through a checkpoint file: {d * 1e3:.1f} ms (medians of {rounds}); new engine on a saved HF "
          f"directory: {restart:.2f} s ({restart / s:.0f}x)", flush=True)
    memory = sync_memory(bucket_mb)
    print(f"memory a sync adds at TP 2 ({memory['model_bytes'] / 1e6:.0f} MB model): one bucket "
          f"{memory['peak_extra_bytes_one_bucket'] / 1e6:.0f} MB, buckets of {bucket_mb} MB "
          f"{memory['peak_extra_bytes_bucketed'] / 1e6:.0f} MB ({memory['buckets']} buckets)")
    print(json.dumps({"seconds": round(s, 4), "bytes": nbytes, "gb_per_s": round(nbytes / s / 1e9, 4),
                      "via_disk_seconds": round(d, 4), "restart_engine_seconds": round(restart, 3), **memory}))


# -- memory: two ranks under torchrun -------------------------------------------------------
def sync_memory(bucket_mb: float) -> dict:
    from models.tiny import tiny_model_dir, wide_model_dir

    path = full_or_smoke(wide_model_dir, lambda: tiny_model_dir("policy"))()  # ~36M parameters, 8 text layers
    env = os.environ | {"MALLOC_MMAP_THRESHOLD_": str(1 << 20)}  # freed tensors leave the process
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           __file__, "--worker", str(path), "--bucket-mb", str(bucket_mb)]
    lines = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout.splitlines()
    out = json.loads([x for x in lines if x.startswith("{")][-1])
    out["bucket_mb"] = bucket_mb
    out["extra_ratio_bucketed"] = round(out["peak_extra_bytes_bucketed"] / out["model_bytes"], 3)
    out["extra_ratio_one_bucket"] = round(out["peak_extra_bytes_one_bucket"] / out["model_bytes"], 3)
    return out


def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def worker(path: str, bucket_mb: float) -> None:
    """One rank: the trainer at TP 2 and its own rollout engine; one warm-up sync, then the
    measured ones through the RL loop's push_weights: buckets of `bucket_mb`, then one bucket
    (each from the resident memory after the one before was freed)."""
    from models.comm import init_parallel
    from models.trainer import TrainerConfig, VLMTrainer
    from yatt_mm.engines.engine import EngineConfig, RolloutEngine
    from yatt_mm.rl.config import SyncConfig
    from yatt_mm.rl.step import push_weights

    ranks = init_parallel(2)
    trainer = VLMTrainer(path, TrainerConfig(tensor_parallel=2))
    engine = RolloutEngine(EngineConfig(model=path))
    cfg = SimpleNamespace(rollout=SimpleNamespace(engine=engine.cfg), sync=SyncConfig(bucket_mb=bucket_mb))
    run = SimpleNamespace(trainer=trainer, engine=engine, ranks=ranks, cfg=cfg)
    push_weights(run)  # warm-up: vLLM's reload bookkeeping is made once
    out = {}
    for mode, mb in (("bucketed", bucket_mb), ("one_bucket", 1e6)):
        cfg.sync = SyncConfig(bucket_mb=mb)
        gc.collect()
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        before = _status_kb("VmRSS")
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
        metrics = push_weights(run)
        out[f"peak_extra_bytes_{mode}"] = _status_kb("VmHWM") - before
        if mode == "bucketed" and ranks.rank == 0:  # the sync's figures are the controller's
            out["model_bytes"], out["buckets"] = int(metrics["sync/bytes"]), int(metrics["sync/buckets"])
    if ranks.rank == 0:  # the controller, whose engine the sync fills (its TP peer only gathers)
        print(json.dumps(out), flush=True)
    engine.shutdown()


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--bucket-mb", type=float, default=BUCKET_MB, help="bucket size of the bucketed sync")
    args = ap.parse_args()
    if args.worker:
        worker(args.worker, args.bucket_mb)
    else:
        main(bucket_mb=args.bucket_mb)
