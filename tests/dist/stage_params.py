"""Each rank's parameter count of a model as Megatron builds it at TP x PP (random weights: the
counts need no checkpoint), for each layout given (one launch; Megatron's groups remade between
them). Rank 0 prints one JSON line: {"TP,PP": {"ranks": [{rank, tp_rank, stage, params}, ...]}}.

    torchrun --nproc-per-node 2 tests/dist/stage_params.py tiny:qwen3vl 2,1 1,2   # TP 2, then PP 2
"""

from __future__ import annotations

import argparse
import json

import models  # noqa: F401 - CPU runtime hooks first
import torch
import torch.distributed as dist

from models.comm import destroy_parallel, init_parallel
from models.family import family_of
from yatt_mm.plan import load_spec


def rank_params(model: str, tp: int, pp: int) -> list[dict]:
    from megatron.core import parallel_state

    groups = init_parallel(tp, pipeline_parallel=pp)
    spec = load_spec(model)
    module = family_of(spec).build_model(spec, torch.float32, tp, "none", pp)
    mine = {"rank": dist.get_rank(), "tp_rank": groups.tp_rank,
            "stage": parallel_state.get_pipeline_model_parallel_rank(),
            "params": sum(p.numel() for p in module.parameters())}
    ranks = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, mine)
    return ranks


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", help="a model setting the plan reads (tiny:KIND, an HF directory)")
    ap.add_argument("layouts", nargs="+", metavar="TP,PP")
    args = ap.parse_args()
    results = {}
    for layout in args.layouts:
        tp, pp = (int(n) for n in layout.split(","))
        results[layout] = {"ranks": rank_params(args.model, tp, pp)}
        destroy_parallel()
    if dist.get_rank() == 0:
        print(json.dumps(results), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
