"""Megatron Qwen3-VL vs transformers on the same weights and inputs: logits side by side.

`yatt-mm model parity HF_DIR [--tp T] [--pp P] [--pipeline-layers 3,1]` runs this through the
model's family (under torchrun on T x P ranks when that is > 1; `--pipeline-layers`: language
layers per stage, the DeepStack layers all on the first). The probes, the vocabulary gather and the stage
handling are Qwen2-VL's harness (models/qwen2vl/parity.py); what differs is only what a family
provides: `run_parity` builds, loads and feeds the model through models/family.py's hooks and
transformers' Auto classes, so it runs any registered family. A video goes in with its metadata
(fps and frame indices, frames taken as given): Qwen3-VL's processor writes each temporal
patch's timestamp into the prompt, and without an fps it guesses 24. The last line printed is
one JSON object with the max abs logit difference per probe, and whether the model's HF export
gives back the checkpoint bit for bit ("export_equal": 1.0).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.distributed as dist

from models.comm import init_parallel
from models.qwen2vl.parity import logit_diffs, parse_layers

VIDEO_FPS = 2.0


def with_video_metadata(media: dict) -> dict:
    """The processor kwargs with each video's metadata, its frames taken as they are."""
    if "videos" not in media:
        return media
    meta = [{"fps": VIDEO_FPS, "total_num_frames": len(v), "duration": len(v) / VIDEO_FPS,
             "frames_indices": list(range(len(v)))} for v in media["videos"]]
    return {**media, "video_metadata": meta, "do_sample_frames": False}


def run_parity(hf_dir: str, tp: int = 1, pp: int = 1, ep: int = 1, layers=()) -> dict[str, float]:
    """This rank's max abs logit difference per probe, and "export_equal". `ep` > 1 and
    `layers` (language layers per stage) for a family whose hooks take them (Qwen3-VL-MoE's)."""
    import models  # noqa: F401 - CPU runtime hooks
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from models.family import family_for_dir, read_spec

    groups = init_parallel(tp, seed=0, pipeline_parallel=pp, expert_parallel=ep)  # torchrun's ranks, or one process
    family, spec = family_for_dir(hf_dir), read_spec(hf_dir)
    model = family.build_model(spec, torch.float32, tp, "none", pp, tuple(layers), *((ep,) if ep > 1 else ())).eval()
    family.load_hf_into(model, hf_dir, groups.tp_rank, tp)
    hf = AutoModelForImageTextToText.from_pretrained(hf_dir, dtype=torch.float32).eval()
    processor = AutoProcessor.from_pretrained(hf_dir)
    timed = spec.model_type in family.timed_video_types

    media = with_video_metadata if timed else lambda media: media
    result = {"export_equal": exports_the_checkpoint(family, model, hf_dir, groups),
              **logit_diffs(model, hf, processor, spec, groups, media)}
    if tp > 1 and not getattr(spec, "num_experts", 0):  # dense: every row-parallel layer is an nn.Linear
        sum_as_tensor_parallel(hf, tp)
        result |= {f"tp_order/{k}": v for k, v in logit_diffs(model, hf, processor, spec, groups, media).items()}
    return result


def sum_as_tensor_parallel(hf, tp: int) -> None:
    """Make transformers' Qwen3-VL sum its row-parallel products (attention output and MLP down
    projections, in the language model and the vision tower) as Megatron does at `tp`: one
    product per input shard, added in rank order, the bias after. The "tp_order/" probes compare
    against it: everything else at TP > 1 (column-parallel shards, per-head q/k norms, the
    vocabulary-parallel head, the DeepStack additions) must then agree bit for bit, so a
    TP-specific mistake cannot hide in the float32 summation-order difference (1.3e-5 on the
    tiny model's logits of magnitude 24; measured 0.0 here)."""
    import torch.nn.functional as F

    def split_k(linear: torch.nn.Linear) -> None:
        def forward(x):
            shards = zip(x.chunk(tp, -1), linear.weight.chunk(tp, -1))
            out = sum(F.linear(xs.contiguous(), ws.contiguous()) for xs, ws in shards)
            return out if linear.bias is None else out + linear.bias
        linear.forward = forward

    for layer in hf.model.language_model.layers:
        # Qwen3.5's DeltaNet layers have their output projection where attention has o_proj
        attention = layer.self_attn.o_proj if hasattr(layer, "self_attn") else layer.linear_attn.out_proj
        split_k(attention), split_k(layer.mlp.down_proj)
    for block in hf.model.visual.blocks:
        split_k(block.attn.proj), split_k(block.mlp.linear_fc2)


def exports_the_checkpoint(family, model, hf_dir: str, groups) -> float:
    """1.0 when the model's HF export (gathered over TP, handed between pipeline stages, in
    small buckets) is the checkpoint it loaded, tensor for tensor and bit for bit; else 0.0."""
    from safetensors.torch import load_file

    exported = {k: t for bucket in family.export_hf_buckets(model, groups.tp, None, 1 << 18)
                for k, t in bucket.items()}
    checkpoint = {k: t for f in sorted(Path(hf_dir).glob("*.safetensors")) for k, t in load_file(str(f)).items()}
    same = exported.keys() == checkpoint.keys() and all(torch.equal(exported[k], checkpoint[k]) for k in checkpoint)
    return float(same)


def main(argv: list[str] | None = None, run=None) -> int:
    """`run`: the comparison (default this module's run_parity; a family's parity module passes its own)."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("hf_dir")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--pipeline-layers", type=parse_layers, default=(),
                        help="language layers per stage, comma-separated (default: an even split)")
    args = parser.parse_args(argv)
    result = (run or run_parity)(args.hf_dir, args.tp, args.pp, layers=args.pipeline_layers)
    if dist.get_rank() == 0:
        for name, diff in result.items():
            print(f"{name:12s} max |logits diff| = {diff:.3e}")
        print(json.dumps({"tp": args.tp, "pp": args.pp, "pipeline_layers": list(args.pipeline_layers),
                          "max_abs_diff": result}))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
