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

from models.comm import init_parallel
from models.qwen2vl.parity import probes, stage_logits
from models.qwen3vl.parity import exports_the_checkpoint, with_video_metadata


def run_parity(hf_dir: str, tp: int = 1, pp: int = 1, ep: int = 1, layers=()) -> dict[str, float]:
    import models  # noqa: F401 - CPU runtime hooks
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from models.family import family_for_dir, read_spec
    from models.inputs import VLMInputs
    from models.trainer import MicroBatch, Pipeline, forward_only

    groups = init_parallel(tp, seed=0, pipeline_parallel=pp, expert_parallel=ep)
    family, spec = family_for_dir(hf_dir), read_spec(hf_dir)
    model = family.build_model(spec, torch.float32, tp, "none", pp, tuple(layers), ep).eval()
    family.load_hf_into(model, hf_dir, groups.tp_rank, tp)
    hf = AutoModelForImageTextToText.from_pretrained(hf_dir, dtype=torch.float32).eval()
    processor = AutoProcessor.from_pretrained(hf_dir)

    result = {"export_equal": exports_the_checkpoint(family, model, hf_dir, groups)}
    for name, (messages, media) in probes().items():
        text = processor.apply_chat_template(messages, add_generation_prompt=True)
        batch = processor(text=[text], return_tensors="pt", **with_video_metadata(media))
        with torch.no_grad():
            ref = hf(**batch).logits.float()
        inputs = VLMInputs.from_processor(spec, dict(batch))
        (out,) = forward_only(model, [MicroBatch(inputs)], lambda m, mb: stage_logits(m, mb.inputs),
                              Pipeline.of(groups))
        result[name] = float((ref - out["logits"].float()).abs().max())
    worst = torch.tensor(list(result.values()), dtype=torch.float64)
    worst[0] = -worst[0]  # export_equal: the smallest over ranks, the diffs: the largest
    dist.all_reduce(worst, op=dist.ReduceOp.MAX, group=groups.world_cpu)
    worst[0] = -worst[0]
    return dict(zip(result, worst.tolist()))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("hf_dir")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--ep", type=int, default=1, help="expert-parallel size")
    parser.add_argument("--pipeline-layers", default="", help="language layers per stage, e.g. 1,3")
    args = parser.parse_args(argv)
    layers = tuple(int(n) for n in args.pipeline_layers.split(",") if n.strip())
    result = run_parity(args.hf_dir, args.tp, args.pp, args.ep, layers)
    if dist.get_rank() == 0:
        for name, diff in result.items():
            print(f"{name:12s} max |logits diff| = {diff:.3e}")
        print(json.dumps({"tp": args.tp, "pp": args.pp, "ep": args.ep, "max_abs_diff": result}))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
