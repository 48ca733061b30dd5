"""Calibration of `yatt-mm plan` (yatt_mm/plan.py): the trainer memory it plans against the
memory real train steps use, for several model sizes, dtypes, recompute settings and TP/DP
layouts (one process, and two gloo ranks under torchrun as TP1xDP2 and TP2xDP1), with the
distributed optimizer on and off.

What is measured, per config, on rank 0 (the planner's own formula is never used for it):

- persistent: the trainer's weights, gradient buffers and optimizer state, from the real tensors
  after a first train step (Adam creates its state lazily), counted once per storage
  (`VLMTrainer.device_bytes`, as the offload code sees them);
- step: the peak of the bytes allocated by torch's CPU allocator during a second, identical
  train_step (forward, backward, optimizer), from torch.profiler's memory events: the running
  sum of every allocation and free the step makes, i.e. what it allocated and has not freed yet.
  That is the CPU counterpart of torch.cuda.max_memory_allocated: every tensor the step makes,
  saved activations and transients (logits' gradients, weight-gradient temporaries) alike. Process RSS is not used: glibc keeps freed memory in its arenas and the
  safetensors files stay mapped, so it says more about the allocator than about the tensors.

measured = persistent + step. planned = the plan's weights + gradients + optimizer + peak
activations (Adam runs fused: no temporaries) for the same model, settings and micro-batch (CPU kernels,
see `plan.Kernels`; no allocator slack, which is a CUDA caching-allocator margin). The models are
random Qwen2-VL / Qwen2.5-VL directories of a few to ~30 M parameters built offline; each
micro-batch holds images (the vision tower runs) and scores a response span like RL does.

    python benchmarks/bench_memory_plan.py

Prints a table, then one JSON line: {"configs": [{"name", "planned_gb", "measured_gb", "rel_err",
"step_rel_err", ...}], "max_rel_err", "within_15pct", "max_step_rel_err", "params_exact",
"activation_calibration"}. rel_err is of the whole trainer (persistent state included, which the
plan counts exactly); step_rel_err of the step's peak alone, the part the activation formula
predicts.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

importlib.import_module("models")  # first: the CPU runtime hooks, before torch and megatron load
import torch  # noqa: E402
from _common import SMOKE  # noqa: E402

REPO = Path(__file__).resolve().parents[1]

# Widths of the random test models (text, vision). Head dims 64 / 48 / 64 keep M-RoPE's
# sections whole; KV heads divide by TP 2.
MODELS = {
    "S": dict(hidden=256, inter=704, layers=2, heads=4, kv=2, vocab=8192, vdepth=2, vdim=96, vheads=2),
    "M": dict(hidden=512, inter=1408, layers=4, heads=8, kv=2, vocab=16384, vdepth=4, vdim=192, vheads=4),
    "Q25": dict(hidden=384, inter=1024, layers=3, heads=6, kv=2, vocab=12288, vdepth=3, vdim=128, vheads=2,
                qwen25=True),
}

# (name, model, dtype, recompute, distributed optimizer, rows, seq, media tokens per row, scored per row),
# grouped by the process layout that runs them: (ranks, TP).
LAYOUTS = {
    "tp1dp1": (1, 1, [
        ("M fp32 none", "M", "fp32", "none", False, 2, 256, 64, 64),
        ("M bf16 full", "M", "bf16", "full", False, 4, 512, 128, 128),
        ("S bf16 selective", "S", "bf16", "selective", False, 2, 768, 128, 128),
        ("S fp32 none long", "S", "fp32", "none", False, 1, 1024, 192, 256),
        ("M fp32 short", "M", "fp32", "none", False, 1, 64, 16, 16),  # the weight gradients' transients dominate
        ("Q25 fp32 none", "Q25", "fp32", "none", False, 2, 224, 64, 64),
    ]),
    "tp1dp2": (2, 1, [
        ("M fp32 none distopt", "M", "fp32", "none", True, 2, 256, 64, 64),
        ("M bf16 selective distopt", "M", "bf16", "selective", True, 2, 256, 64, 64),
    ]),
    "tp2dp1": (2, 2, [
        ("M fp32 none", "M", "fp32", "none", False, 2, 256, 64, 64),
        ("Q25 bf16 selective", "Q25", "bf16", "selective", False, 2, 224, 64, 64),
    ]),
}
if SMOKE:  # every layout still launched (one process, DP 2, TP 2), one short row of the small model each
    LAYOUTS = {"tp1dp1": (1, 1, [("S fp32 none short", "S", "fp32", "none", False, 1, 64, 16, 16)]),
               "tp1dp2": (2, 1, [("S fp32 none distopt", "S", "fp32", "none", True, 1, 64, 16, 16)]),
               "tp2dp1": (2, 2, [("S bf16 selective", "S", "bf16", "selective", False, 1, 64, 16, 16)])}
def image_grid(media: int) -> tuple[int, int, int]:
    """The (t, h, w) patch grid of every image of a row with `media` image tokens: 16 x 16 patches
    (64 merged tokens), or 8 x 8 (16 tokens) where 64 does not divide the row's media."""
    return (1, 16, 16) if media % 64 == 0 else (1, 8, 8)


def model_dir(name: str) -> Path:
    """A random Qwen2-VL (or Qwen2.5-VL) HF directory with MODELS[name]'s widths, built offline
    once and cached (the tiny models' tokenizer, as models/tiny.py builds it)."""
    from models.tiny import cache_root

    out = cache_root() / "bench-memory-plan" / f"{name}-v1"
    if (out / "config.json").is_file():
        return out
    w = MODELS[name]
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=out.parent))  # renamed into place when complete
    _write_model(tmp, **w)
    os.rename(tmp, out)
    return out


def _write_model(out: Path, hidden, inter, layers, heads, kv, vocab, vdepth, vdim, vheads, qwen25=False) -> None:
    from transformers import (Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2VLConfig,
                              Qwen2VLForConditionalGeneration)

    from models.tiny import SPECIAL_TOKENS, build_tokenizer, token_ids

    tokenizer = build_tokenizer()  # its special tokens (ids < 700) sit inside every vocabulary here
    ids = token_ids({t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS})
    hd = hidden // heads
    text = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=4096,
                rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [hd // 4, hd // 8, hd // 8]},
                bos_token_id=ids["bos_token_id"], eos_token_id=ids["eos_token_id"], pad_token_id=ids["pad_token_id"])
    vision = dict(depth=vdepth, num_heads=vheads, patch_size=14, spatial_merge_size=2, temporal_patch_size=2)
    if qwen25:
        vision.update(hidden_size=vdim, out_hidden_size=hidden, intermediate_size=2 * vdim, hidden_act="silu",
                      window_size=56, fullatt_block_indexes=[vdepth - 1])
        config, cls = Qwen2_5_VLConfig(text_config=text, vision_config=vision, **ids), Qwen2_5_VLForConditionalGeneration
    else:
        vision.update(embed_dim=vdim, hidden_size=hidden, mlp_ratio=4)
        config, cls = Qwen2VLConfig(text_config=text, vision_config=vision, **ids), Qwen2VLForConditionalGeneration
    torch.manual_seed(0)
    cls(config).to(torch.float32).save_pretrained(out, safe_serialization=True)


def micro_batch(spec, rows: int, seq: int, media: int, scored: int):
    """Right-padded rows of random text with `media` image tokens each (distinct images of `image_grid`'s
    grid), the loss on the last `scored` positions of every row: an RL micro-batch's shape."""
    from models.inputs import VLMInputs
    from models.trainer import MicroBatch

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 600, (rows, seq), generator=g)
    batch = dict(input_ids=ids, attention_mask=torch.ones_like(ids))
    t, h, w = image_grid(media)
    per_image = t * h * w // spec.spatial_merge_size**2
    ids[:, 4:4 + media] = spec.image_token_id
    images = rows * media // per_image
    batch["pixel_values"] = torch.randn(images * t * h * w, spec.in_channels * spec.temporal_patch_size
                                        * spec.patch_size**2, generator=g)
    batch["image_grid_thw"] = torch.tensor([[t, h, w]] * images)
    score = torch.zeros(rows, seq, dtype=torch.bool)
    score[:, seq - scored - 1: seq - 1] = True
    return MicroBatch(VLMInputs.from_processor(spec, batch), {"mask": score.float()}, score_mask=score)


def _loss(lp, mb):
    return -(lp * mb.extra["mask"]).sum() / mb.extra["mask"].sum(), {}


def step_peak_bytes(step) -> int:
    """Peak of the bytes allocated during `step()` and not yet freed, from torch.profiler's
    memory events: the running sum of every allocation (+) and free (-) the step makes. (The
    events' own "Total Allocated" is a process-wide counter that drifts across profiling
    sessions: a tensor allocated in one session and freed outside any is never subtracted.)"""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(trace))
        events = json.loads(trace.read_text())["traceEvents"]
    memory = sorted((e for e in events if e.get("name") == "[memory]"), key=lambda e: e["ts"])
    alive = peak = 0
    for e in memory:
        alive += e["args"]["Bytes"]
        peak = max(peak, alive)
    return peak


def measure(name, model, dtype, recompute, distopt, rows, seq, media, scored, tp, world) -> dict:
    """Build the real trainer, take a warm-up step, then measure a second one; plan the same."""
    from models.trainer import TrainerConfig, VLMTrainer
    from yatt_mm import plan

    cfg = TrainerConfig(tensor_parallel=tp, dtype=dtype, recompute=recompute, distributed_optimizer=distopt,
                        lr=1e-4, offload="never")
    trainer = VLMTrainer(str(model_dir(model)), cfg)
    mb = micro_batch(trainer.spec, rows, seq, media, scored)
    trainer.train_step([mb], _loss)  # Adam's state is created here
    persistent = trainer.device_bytes()
    start = time.perf_counter()
    step = step_peak_bytes(lambda: trainer.train_step([mb], _loss))
    seconds = time.perf_counter() - start
    shape = plan.MicroBatchShape(rows=rows, seq=seq, scored=rows * scored, media_tokens=rows * media,
                                 frame_tokens=math.prod(image_grid(media)) // trainer.spec.spatial_merge_size**2)
    planned = plan.trainer_memory(trainer.spec, cfg, world // tp, shape, plan.CPU)
    params = sum(p.numel() for p in trainer.module.parameters())
    return {"name": f"{name} TP{tp}xDP{world // tp}", "params": params, "planned_params": planned.params.total,
            "measured_persistent": persistent, "planned_persistent": planned.persistent, "measured_step": step,
            "planned_step": planned.step_extra, "planned_activations": planned.activations.peak,
            "step_seconds": round(seconds, 1)}


def worker(layout: str) -> None:
    import torch.distributed as dist

    from models.comm import init_parallel

    world, tp, configs = LAYOUTS[layout]
    init_parallel(tp)
    for config in configs:
        result = measure(*config, tp=tp, world=world)
        gc.collect()  # the trainer measured is gone before the next one is built
        if dist.get_rank() == 0:
            print(json.dumps(result), flush=True)
    dist.destroy_process_group()


def run_layout(layout: str) -> list[dict]:
    world = LAYOUTS[layout][0]
    me = [str(Path(__file__).resolve()), "--worker", layout]
    cmd = ([sys.executable, *me] if world == 1 else
           [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world), *me])
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"{layout} failed (rc {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def main() -> int:
    start = time.perf_counter()
    for name in {config[1] for _, _, configs in LAYOUTS.values() for config in configs}:  # before the ranks start
        model_dir(name)
    results = [r for layout in LAYOUTS for r in run_layout(layout)]
    for r in results:
        r["measured_gb"] = (r["measured_persistent"] + r["measured_step"]) / 1e9
        r["planned_gb"] = (r["planned_persistent"] + r["planned_step"]) / 1e9
        r["rel_err"] = round((r["planned_gb"] - r["measured_gb"]) / r["measured_gb"], 4)
        r["step_rel_err"] = round((r["planned_step"] - r["measured_step"]) / r["measured_step"], 4)
    header = f"{'config':<34}{'params':>10}{'persistent MB':>20}{'step peak MB':>20}{'total MB':>20}{'err':>8}"
    print(header + "\n" + " " * 44 + "measured / planned  " * 3)
    for r in results:
        print(f"{r['name']:<34}{r['params']:>10}"
              f"{r['measured_persistent'] / 1e6:>11.1f} /{r['planned_persistent'] / 1e6:>7.1f}"
              f"{r['measured_step'] / 1e6:>11.1f} /{r['planned_step'] / 1e6:>7.1f}"
              f"{r['measured_gb'] * 1e3:>11.1f} /{r['planned_gb'] * 1e3:>7.1f}{r['rel_err']:>+8.1%}"
              f"   step {r['step_rel_err']:+.1%}")
    from yatt_mm.plan import ACTIVATION_CALIBRATION

    # the constant that makes planned activations match the measured peaks on the median config
    fitted = statistics.median(r["measured_step"] / r["planned_activations"] for r in results) \
        * ACTIVATION_CALIBRATION
    worst = max(abs(r["rel_err"]) for r in results)
    worst_step = max(abs(r["step_rel_err"]) for r in results)
    params_exact = all(r["params"] == r["planned_params"] for r in results)
    print(f"parameter counts equal Megatron's on every rank: {params_exact}; fitted activation calibration "
          f"{fitted:.3f} (in use: {ACTIVATION_CALIBRATION}); {time.perf_counter() - start:.0f} s")
    keep = ("name", "planned_gb", "measured_gb", "rel_err", "step_rel_err", "params", "planned_params")
    print(json.dumps({"configs": [{k: (round(r[k], 4) if isinstance(r[k], float) else r[k]) for k in keep}
                                  for r in results],
                      "max_rel_err": worst, "within_15pct": worst <= 0.15, "max_step_rel_err": worst_step,
                      "params_exact": params_exact,
                      "activation_calibration": round(fitted, 3)}))
    return 0


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args.worker)
    else:
        sys.exit(main())
