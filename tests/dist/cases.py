"""Several 2-rank checks of the Megatron Qwen2-VL in one torchrun launch: a launch costs ~10 s of
imports on two cores, so tests/models/test_models.py shares one between its checks, and Megatron's
groups are remade between cases (`models.comm.destroy_parallel`), as Megatron's own tests do.

    torchrun --nproc-per-node 2 tests/dist/cases.py parity:policy:1:1 train:2:fp32 shared_media distopt

Cases:
- parity:KIND:TP:PP[:LAYERS]  `yatt-mm model parity` of a Qwen2-VL-family tiny model (models/tiny.py's
  KIND; LAYERS: language layers per pipeline stage, e.g. 1,2): the max |logits diff| against
  transformers per probe (TP 1 on two ranks is DP 2: a replica each)
- train:TP:DTYPE     tests/dist/vlm_train_steps.py's training steps (DTYPE fp32 or bf16)
- packing:TP[:KIND]  tests/dist/packing.py (packed rows against the padded micro-batch)
- recompute[:KIND]   tests/dist/recompute.py (activation recompute: gradients and saved bytes)
- shared_media       tests/dist/shared_media.py at TP 2
- distopt            tests/dist/distopt.py at DP 2
- lora:TP:PP[:KIND[:EP]]  tests/dist/lora.py (LoRA against transformers + peft; KIND a tiny model, default
  policy; EP its expert-parallel size, default 1)
Rank 0 prints a line per case as it starts (a failure's traceback follows the last one) and, at
the end, one JSON line: {case: its result}. A case that fails ends the launch (torchrun stops
the other rank), so no rank waits on a collective the other will never join.
"""

from __future__ import annotations

import json
import sys

import models  # noqa: F401 - CPU runtime hooks first
import torch.distributed as dist

from models.comm import destroy_parallel, init_distributed
from models.tiny import tiny_model_dir


def run_case(case: str) -> dict:
    name, *args = case.split(":")
    if name == "parity":
        from models.qwen2vl.parity import run_parity

        kind, tp, pp, *layers = args
        return run_parity(str(tiny_model_dir(kind)), int(tp), int(pp),
                          tuple(int(n) for n in layers[0].split(",")) if layers else ())
    if name == "train":
        from vlm_train_steps import train_case

        tp, dtype = args
        return {"kind": "policy", **train_case(str(tiny_model_dir("policy")), int(tp), dtype, steps=4)}
    if name == "packing":
        from packing import run

        tp, *kind = args
        return run(int(tp), *kind)
    if name == "recompute":
        from recompute import run

        return run(*args)
    if name == "shared_media":
        from shared_media import run

        return run(tp=2)
    if name == "distopt":
        from distopt import run

        return run()
    if name == "lora":
        from lora import run

        tp, pp, *kind_ep = args
        return run(int(tp), int(pp), *kind_ep[:1], *map(int, kind_ep[1:]))
    raise SystemExit(f"unknown case {case!r} (see this script's docstring)")


def main(cases: list[str]) -> int:
    init_distributed()
    results = {}
    for case in cases:
        if dist.get_rank() == 0:
            print(f"case {case}", flush=True)
        results[case] = run_case(case)
        destroy_parallel()
    if dist.get_rank() == 0:
        print(json.dumps(results), flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
