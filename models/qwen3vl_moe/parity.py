"""Megatron Qwen3-VL-MoE vs transformers on the same weights and inputs: logits side by side, at a
tensor-, pipeline- and expert-parallel layout.

`python -m models.qwen3vl_moe.parity HF_DIR [--tp T] [--pp P] [--ep E]` (under torchrun on
T x P x DP ranks, E dividing DP; `yatt-mm model parity` launches it). The probes and what is
compared are Qwen3-VL's (models/qwen3vl/parity.py); under expert parallelism the experts of a
layer are spread over E ranks, each probe's tokens going to their experts through the all-to-all
dispatcher. The export check ("export_equal": 1.0) gathers the experts back from every EP rank.
Every rank of a DP group gets the same probes, so under EP each rank's logits are compared.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.distributed as dist

from models.comm import comm
from models.qwen3vl import parity as dense


def run_parity(hf_dir: str, tp: int = 1, pp: int = 1, ep: int = 1, layers=()) -> dict[str, float]:
    """Qwen3-VL's comparison (models/qwen3vl/parity.py) at this layout, the worst over every rank."""
    result = dense.run_parity(hf_dir, tp, pp, ep, layers)
    worst = torch.tensor(list(result.values()), dtype=torch.float64)
    worst[0] = -worst[0]  # export_equal: the smallest over ranks, the diffs: the largest
    dist.all_reduce(worst, op=dist.ReduceOp.MAX, group=comm().world_cpu)
    worst[0] = -worst[0]
    return dict(zip(result, worst.tolist()))


def main(argv: list[str] | None = None, run=None) -> int:
    """`run`: the comparison (default this module's run_parity; models/qwen35_moe/parity.py passes its own)."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("hf_dir")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--ep", type=int, default=1, help="expert-parallel size")
    parser.add_argument("--pipeline-layers", default="", help="language layers per stage, e.g. 1,3")
    args = parser.parse_args(argv)
    layers = tuple(int(n) for n in args.pipeline_layers.split(",") if n.strip())
    result = (run or run_parity)(args.hf_dir, args.tp, args.pp, args.ep, layers)
    if dist.get_rank() == 0:
        for name, diff in result.items():
            print(f"{name:12s} max |logits diff| = {diff:.3e}")
        print(json.dumps({"tp": args.tp, "pp": args.pp, "ep": args.ep, "max_abs_diff": result}))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
