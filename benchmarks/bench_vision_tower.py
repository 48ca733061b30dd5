"""Qwen2.5-VL's vision tower on one video clip: forward + backward time and the bytes autograd
keeps, for yatt-mm's Megatron tower and two baselines measured in the same run on the same
weights and pixels.

- yatt-mm: each block gathers its units (windows, or frames in the full-attention blocks) of one
  size into a batch and attends within them unmasked (models/qwen2vl/vision.py AttentionGroups).
- masked sequence: the same Megatron layers over all patches as one sequence under a
  patches x patches window or frame mask per block (what the tower did before).
- transformers: Qwen2_5_VLForConditionalGeneration's `visual` (SDPA, its window reordering),
  what a user would otherwise run.

The tower: the tiny `policy25` model's (2 blocks of width 64, 2 heads, 56 px windows of 2 x 2
merged tokens, block 1 full attention; models/qwen2vl/tiny.py). At real widths the MLP weighs
more beside attention, so the ratios here are this tower's, not Qwen2.5-VL-7B's; the memory a
patches x patches mask takes does not depend on the width. The clip: --frames frames of
--side x --side pixels of random patches, by default a video at the data defaults
(data.media: 16 frames of at most 256 x 28 x 28 pixels, so 448 x 448: 8 temporal patches of
32 x 32, 8,192 patches). Rounds interleave the three; the median round of each is reported.

    python benchmarks/bench_vision_tower.py [--frames 16] [--side 448] [--rounds 3]

The last line is one JSON object: patches, the three forward + backward times and saved MiB,
speedup_vs_masked, speedup_vs_transformers, saved_ratio_vs_masked, and the largest difference
of the merged features to transformers' and to the masked sequence's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import models  # noqa: F401 - CPU runtime hooks first
import torch
from _common import full_or_smoke


def saved_mib(fn, exclude) -> tuple[torch.Tensor, float]:
    """fn()'s output and the bytes autograd keeps for its backward (distinct storages, the
    parameters in `exclude` left out), MiB."""
    kept = {}

    def pack(t):
        kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sum(n for ptr, n in kept.items() if ptr not in exclude) / 2**20


def masked_sequence(vision, pixels: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
    """The same Megatron layers over every patch as one sequence, under a patches x patches
    window or frame mask per block (additive, made once)."""
    from models.qwen2vl.vision import frame_ids, window_ids

    spec = vision.spec
    x = vision.patch_embed(pixels)[:, None, :]
    rotary = vision.rotary(grid)
    window = spec.window_size // spec.spatial_merge_size // spec.patch_size

    def additive(ids):
        return torch.zeros(len(ids), len(ids)).masked_fill(ids[:, None] != ids[None, :], float("-inf"))[None, None]

    full, windows = additive(frame_ids(grid)), additive(window_ids(grid, spec.spatial_merge_size, window))
    for i, layer in enumerate(vision.decoder.layers):
        x, _ = layer(hidden_states=x, attention_mask=full if i in spec.fullatt_block_indexes else windows,
                     rotary_pos_emb=rotary)
    return vision.merger(x[:, 0, :])


def main() -> int:
    import transformers

    from models.comm import init_parallel
    from models.family import read_spec
    from models.tiny import tiny_model_dir
    from models.trainer import TrainerConfig, build_module

    ap = argparse.ArgumentParser()
    # a smoke run: one temporal patch of 112 x 112 (64 patches, 4 windows)
    ap.add_argument("--frames", type=int, default=full_or_smoke(16, 2))
    ap.add_argument("--side", type=int, default=full_or_smoke(448, 112), help="frame side in pixels (a multiple of 28)")
    ap.add_argument("--rounds", type=int, default=full_or_smoke(3, 1))
    args = ap.parse_args()
    if args.side % 28 or args.frames % 2:
        raise SystemExit("--side must be a multiple of 28 and --frames even (2 frames make a temporal patch)")

    init_parallel(1)
    path = str(tiny_model_dir("policy25"))
    spec = read_spec(path)
    ours = build_module(path, spec, TrainerConfig()).train().vision
    hf = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(path, dtype=torch.float32).train()
    theirs = hf.model.visual
    side = args.side // spec.patch_size
    grid = torch.tensor([[args.frames // 2, side, side]])
    patches = int(grid.prod())
    pixels = torch.randn(patches, spec.in_channels * spec.temporal_patch_size * spec.patch_size ** 2,
                         generator=torch.Generator().manual_seed(0))
    runs = {"yatt_mm": lambda: ours(pixels, grid),
            "masked": lambda: masked_sequence(ours, pixels, grid),
            "transformers": lambda: theirs(pixels, grid_thw=grid).pooler_output}
    weights = {p.untyped_storage().data_ptr() for m in (ours, theirs) for p in m.parameters()}
    outputs, saved = {}, {}
    for name, run in runs.items():
        outputs[name], saved[name] = saved_mib(run, weights)
        outputs[name] = outputs[name].detach()
    times = {name: [] for name in runs}
    for r in range(args.rounds):
        for name, run in runs.items():
            start = time.perf_counter()
            run().sum().backward()
            times[name].append(time.perf_counter() - start)
        print(f"round {r + 1}/{args.rounds}: " + ", ".join(f"{n} {t[-1]:.3f} s" for n, t in times.items()), flush=True)
    median = {name: statistics.median(t) for name, t in times.items()}
    print(json.dumps({
        "patches": patches, "frames": args.frames, "side": args.side,
        "fwd_bwd_s": round(median["yatt_mm"], 4), "masked_fwd_bwd_s": round(median["masked"], 4),
        "transformers_fwd_bwd_s": round(median["transformers"], 4),
        "speedup_vs_masked": round(median["masked"] / median["yatt_mm"], 2),
        "speedup_vs_transformers": round(median["transformers"] / median["yatt_mm"], 2),
        "saved_mib": round(saved["yatt_mm"], 1), "masked_saved_mib": round(saved["masked"], 1),
        "transformers_saved_mib": round(saved["transformers"], 1),
        "saved_ratio_vs_masked": round(saved["yatt_mm"] / saved["masked"], 3),
        "max_abs_diff_vs_transformers": float((outputs["yatt_mm"] - outputs["transformers"]).abs().max()),
        "max_abs_diff_vs_masked": float((outputs["yatt_mm"] - outputs["masked"]).abs().max()),
        "rounds": args.rounds, "statistic": "median round"}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
