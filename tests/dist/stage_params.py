"""Each rank's parameter count of a model as Megatron builds it at TP x PP (random weights: the
counts need no checkpoint). Rank 0 prints one JSON line: {"ranks": [{rank, tp_rank, stage,
params}, ...]}.

    torchrun --nproc-per-node 2 tests/dist/stage_params.py tiny:qwen3vl --tp 2
    torchrun --nproc-per-node 2 tests/dist/stage_params.py tiny:qwen3vl --pp 2
"""

from __future__ import annotations

import argparse
import json

import models  # noqa: F401 - CPU runtime hooks first
import torch
import torch.distributed as dist

from models.comm import init_parallel
from models.family import family_of
from yatt_mm.plan import load_spec


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", help="a model setting the plan reads (tiny:KIND, an HF directory)")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    args = ap.parse_args()
    groups = init_parallel(args.tp, pipeline_parallel=args.pp)
    spec = load_spec(args.model)
    module = family_of(spec).build_model(spec, torch.float32, args.tp, "none", args.pp)
    from megatron.core import parallel_state

    mine = {"rank": dist.get_rank(), "tp_rank": groups.tp_rank,
            "stage": parallel_state.get_pipeline_model_parallel_rank(),
            "params": sum(p.numel() for p in module.parameters())}
    ranks = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, mine)
    if dist.get_rank() == 0:
        print(json.dumps({"ranks": ranks}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
