"""Peak RSS of the busiest process as DP groups are added: parallel controllers vs one
single controller (verl's driver pattern), same media per group.

Each DP group is a real process (gloo) with the real data and control path of `yatt-mm rl`:
a dataio reader, the controller's prompt source (`ParallelSource` or `SingleControllerSource`,
which reads every group's samples on rank 0 and sends each rank its media point to point), and a
step's worth of prompts held while a stand-in for the rollout engine "generates" (it only
touches the pixels). No vLLM engine or trainer runs here: this measures the media path alone.

Last line: JSON with parallel_rss_ratio and single_rss_ratio (largest group count over 1 group;
target: parallel within 10% of 1.0, single growing with the number of groups).
"""

from __future__ import annotations

import json
import os
import resource
import sys
import tempfile

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from _common import full_or_smoke
from models.comm import free_port

# read again by every spawned group process (it imports this module): the same in all of them
GROUP_COUNTS = full_or_smoke((1, 2, 4), (1, 2))
PROMPTS_PER_STEP = full_or_smoke(16, 2)
STEPS = full_or_smoke(3, 1)


def make_data(path: str) -> None:
    from dataio.synth import write_shards

    write_shards(path, images=2 * max(GROUP_COUNTS) * PROMPTS_PER_STEP * STEPS, videos=0,
                 samples_per_shard=64, seed=0, image_size=896, tasks=["colour"])


def worker(rank: int, world: int, port: int, data: str, mode: str, out: str) -> None:
    from dataio.decode import MediaConfig
    from dataio.reader import DataConfig, DataReader
    from yatt_mm.rl.sources import ParallelSource, SingleControllerSource

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    cfg = DataConfig(shards=[data], workers=0, media=MediaConfig(image_max_pixels=896 * 896))
    if mode == "parallel":
        source = ParallelSource(DataReader(cfg, rank, world))
    else:
        source = SingleControllerSource(DataReader(cfg, 0, 1) if rank == 0 else None, rank, world, dist.group.WORLD)
    for _ in range(STEPS):
        prompts = source.take(PROMPTS_PER_STEP)
        checksum = sum(int(np.asarray(im).sum() % 7) for p in prompts for im in p.images)  # the engine stand-in
        del prompts
        dist.barrier()
    peak = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0])  # MiB
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"peak_mib": float(peak), "checksum": checksum}, f)
    dist.destroy_process_group()


def measure(data: str, mode: str, world: int) -> float:
    port = free_port()
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = f.name
    mp.spawn(worker, args=(world, port, data, mode, out), nprocs=world)
    peak = json.load(open(out))["peak_mib"]
    os.unlink(out)
    return peak


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        data = os.path.join(tmp, "shards")
        make_data(data)
        peaks = {mode: {g: measure(data, mode, g) for g in GROUP_COUNTS} for mode in ("parallel", "single")}
    print(f"peak RSS of the busiest process (MiB), {PROMPTS_PER_STEP} prompts/step/group of 896x896 images:")
    print("groups   " + "  ".join(f"{g:>8d}" for g in GROUP_COUNTS))
    for mode, by_g in peaks.items():
        print(f"{mode:8s} " + "  ".join(f"{by_g[g]:8.0f}" for g in GROUP_COUNTS))
    top = max(GROUP_COUNTS)
    result = {f"{mode}_rss_ratio": round(peaks[mode][top] / peaks[mode][1], 3) for mode in peaks}
    result.update({f"{mode}_peak_mib": {str(g): round(v) for g, v in by.items()} for mode, by in peaks.items()})
    print(json.dumps(result))


if __name__ == "__main__":
    sys.exit(main())
