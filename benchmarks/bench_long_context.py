"""Context parallelism on one long video sample: activation memory per rank and tokens/s at CP 1
and CP 2, and the logprob difference between them, measured in the same run.

The model: a small Qwen3-VL built offline (models/qwen3vl/tiny.py's recipe at the widths below:
4 text layers of hidden 512, 8 query / 2 KV heads of 64, MLP 1536; a 2-block vision tower of
hidden 256 with both blocks feeding DeepStack features; ~13 M parameters, fp32). The sample: the
chat template around a 256-frame 128 x 128 video (128 temporal patches of 16 merged tokens, each
with its timestamp as text: 2048 video tokens) and a long response filling the sequence to
--tokens (default 8192; more takes minutes per step on two shared cores).

Both layouts run in one torchrun of 2 ranks, so they share the machine and the process state:
- CP 2: the trainer's context-parallel forward (models/context.py), the sequence split over both
  ranks;
- CP 1: the same model with the context-parallel plan switched off, each rank computing the
  whole sequence on its own (what two data-parallel ranks holding one such sample each do).
Throughput is tokens/s of the two ranks together: 2 x tokens / t(CP 1) against tokens / t(CP 2),
so a ratio of 1.0 would be CP without any cost; the sequence's own speed-up is t(CP 1) / t(CP 2)
(at most 2). Timed: forward and backward of the logprob loss over every token (the optimizer
step is the same at both layouts), in paired rounds (CP 1 then CP 2), the median of the rounds'
ratios reported.

Activation memory: the bytes of the tensors autograd saves for the backward pass (every
distinct storage once, parameters excluded), counted with torch.autograd.graph.
saved_tensors_hooks during one forward per layout; the vision tower's share counted apart. It
is what the backward keeps alive, not the transient peak inside a kernel.

Core attention at CP 2 both ways (policy.trainer.context_parallel_comm): all_gather (K and V of
the whole rows gathered; the trainer's default) and a2a (heads traded for positions by
all-to-all, each rank attending over the whole rows for half the heads), each measured and timed.

The vision tower: at CP > 1 Qwen3-VL splits its frames over the CP ranks and all-gathers the
features (models/qwen3vl/model.py). One more measured forward at CP 2 runs it whole on every
rank instead (the split switched off), to show what the split saves.

`--kind qwen35`: a small Qwen3.5 instead (models/qwen35/tiny.py's recipe at the same widths: 4
text layers of hidden 512, DeltaNet / attention / DeltaNet / attention; the DeltaNets with 4 key
and 8 value heads of 64, the attention 4 query / 2 KV heads of 128; the same vision tower without
DeepStack). Its DeltaNet layers split heads over CP, not positions (models/qwen35/model.py).

    python benchmarks/bench_long_context.py [--kind qwen3vl|qwen35] [--tokens 8192] [--frames 256] [--rounds 2]

The last line is one JSON object: cp_max_logprob_diff (CP 2, every way, against CP 1),
activation_ratio_cp2 (target <= 0.6), throughput_ratio_cp2, their a2a twins
(activation_ratio_cp2_a2a, throughput_ratio_cp2_a2a), and the figures behind them.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from _common import full_or_smoke

TEXT = dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=4, num_attention_heads=8,
            num_key_value_heads=2, head_dim=64, max_position_embeddings=65536)
VISION = dict(depth=2, hidden_size=256, num_heads=4, intermediate_size=512)
# kind -> (text, vision) widths over the family's tiny recipe, and the model's line in the JSON
WIDTHS = {
    "qwen3vl": ((TEXT, {**VISION, "deepstack_visual_indexes": [0, 1]}),
                "Qwen3-VL, 4 x 512 text layers, 2 x 256 vision blocks (DeepStack), fp32"),
    "qwen35": (({**TEXT, "num_attention_heads": 4, "head_dim": 128, "linear_num_key_heads": 4,
                 "linear_num_value_heads": 8}, VISION),
               "Qwen3.5, 4 x 512 text layers (2 gated DeltaNet, 2 gated attention), 2 x 256 vision blocks, fp32"),
}
VERSION = 1  # bump when the widths change: the cached model is rebuilt


def model_dir(kind: str) -> Path:
    """The bench's model of `kind`, built once into the cache (before the ranks start) by the
    family's tiny-model recipe at this bench's widths."""
    from models.family import family_for_tiny_kind
    from models.tiny import cache_root

    path = cache_root() / "bench" / f"{kind}-long-v{VERSION}"
    if not (path / "config.json").is_file():
        tmp = path.with_name(path.name + f".tmp{os.getpid()}")
        family_for_tiny_kind(kind).make_tiny(tmp, widths=WIDTHS[kind][0])
        os.rename(tmp, path)
    return path


def long_sample(processor, spec, tokens: int, frames: int):
    """One micro-batch: the video prompt and a response of random tokens up to `tokens`."""
    import random

    import torch

    from dataio.synth import moving_ball_video
    from models.inputs import VLMInputs
    from models.trainer import MicroBatch

    v = moving_ball_video(random.Random(0), frames=frames, size=128)
    messages = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": v.question}]}]
    prompt = processor.apply_chat_template(messages, add_generation_prompt=True)
    # the frames as given at 2 fps (Qwen3-VL writes each temporal patch's timestamp into the
    # prompt), 128 x 128 (the tiny processor's cap would shrink them to 64 x 64)
    meta = {"fps": 2.0, "total_num_frames": frames, "duration": frames / 2.0, "frames_indices": list(range(frames))}
    batch = processor(text=[prompt], videos=[v.video], video_metadata=[meta], do_sample_frames=False,
                      size={"shortest_edge": 32 * 32, "longest_edge": 128 * 128 * frames}, return_tensors="pt")
    ids = batch["input_ids"]
    if ids.shape[1] >= tokens:
        raise SystemExit(f"--tokens {tokens}: the video prompt alone is {ids.shape[1]} tokens; raise it or lower --frames")
    response = torch.randint(5, 300, (1, tokens - ids.shape[1]), generator=torch.Generator().manual_seed(0))
    batch["input_ids"] = torch.cat([ids, response], 1)
    batch["attention_mask"] = torch.ones_like(batch["input_ids"])
    inputs = VLMInputs.from_processor(spec, batch)
    video = int((inputs.input_ids == spec.video_token_id).sum())
    return MicroBatch(inputs), video


class SavedBytes:
    """Bytes autograd saves for the backward (distinct storages, parameters excluded), split into
    the vision tower's and the rest, while the context is open."""

    def __init__(self, model, vision):
        import torch

        self.params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.seen: set[int] = set()
        self.total = self.vision = 0
        self.in_vision = False
        self.vision_seconds = 0.0
        self._hooks = [vision.register_forward_pre_hook(self._enter), vision.register_forward_hook(self._leave)]
        self._saved = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda x: x)

    def _enter(self, *_):
        self.in_vision, self._t0 = True, time.perf_counter()

    def _leave(self, *_):
        self.in_vision = False
        self.vision_seconds += time.perf_counter() - self._t0

    def _pack(self, t):
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key not in self.params and key not in self.seen and storage.nbytes():
            self.seen.add(key)
            self.total += storage.nbytes()
            if self.in_vision:
                self.vision += storage.nbytes()
        return t

    def __enter__(self):
        self._saved.__enter__()
        return self

    def __exit__(self, *exc):
        self._saved.__exit__(*exc)
        for h in self._hooks:
            h.remove()


def rank_main(args) -> None:
    import models  # noqa: F401 - CPU runtime hooks first
    import torch
    import torch.distributed as dist
    from transformers import AutoProcessor

    import models.context as context_mod
    from models.comm import destroy_parallel, init_parallel
    from models.context import ContextParallel
    from models.trainer import TrainerConfig, VLMTrainer, _forward_scores, _module

    init_parallel(1, 0, context_parallel=2)
    path = str(model_dir(args.kind))
    trainer = VLMTrainer(path, TrainerConfig(context_parallel=2))
    processor = AutoProcessor.from_pretrained(path)
    mb, video_tokens = long_sample(processor, trainer.spec, args.tokens, args.frames)
    real_plan = context_mod.plan  # the trainer imports it at each forward

    def step(cp: int, measure: bool = False, cp_comm: str = "all_gather"):
        """Forward and backward of the sum of logprobs; CP 1: the plan switched off on this rank."""
        context_mod.plan = real_plan if cp == 2 else (lambda *a, **k: None)
        trainer.model.zero_grad_buffer()
        dist.barrier()
        t0 = time.perf_counter()
        if measure:
            with SavedBytes(trainer.model, _module(trainer.model).vision) as saved:
                lp, _ = _forward_scores(trainer.model, mb, trainer.device, with_entropy=False, cp_comm=cp_comm)
        else:
            saved = None
            lp, _ = _forward_scores(trainer.model, mb, trainer.device, with_entropy=False, cp_comm=cp_comm)
        lp.sum().backward()
        dist.barrier()  # the layout's time is its slowest rank's
        return time.perf_counter() - t0, lp.detach(), saved

    # one measured (and warm-up) step per layout, then the timed rounds
    _, lp1, mem1 = step(1, measure=True)
    _, lp2, mem2 = step(2, measure=True)
    _, lp_a2a, mem_a2a = step(2, measure=True, cp_comm="a2a")
    split = ContextParallel.media_bounds
    ContextParallel.media_bounds = lambda self, patches: None  # CP 2, the vision tower whole on each rank
    _, lp_whole, whole = step(2, measure=True)
    ContextParallel.media_bounds = split
    times = {1: [], 2: [], "a2a": []}
    for _ in range(args.rounds):
        for cp in (1, 2, "a2a"):
            times[cp].append(step(2, cp_comm="a2a")[0] if cp == "a2a" else step(cp)[0])
    context_mod.plan = real_plan

    mem = torch.tensor([[m.total, m.vision, m.vision_seconds] for m in (mem1, mem2, whole, mem_a2a)],
                       dtype=torch.float64)
    per_rank = [torch.zeros_like(mem) for _ in range(dist.get_world_size())]
    dist.all_gather(per_rank, mem)
    rank = dist.get_rank()
    # both ranks stop their groups' threads before exiting: a live gloo thread at interpreter
    # exit aborts the process ("terminate called without an active exception")
    destroy_parallel()
    dist.destroy_process_group()
    if rank:
        return
    mib = 1 << 20
    tokens = args.tokens
    tps1 = [2 * tokens / t for t in times[1]]  # both ranks, a sequence each
    tps2 = [tokens / t for t in times[2]]  # both ranks, one sequence
    ratios = [b / a for a, b in zip(tps1, tps2)]
    ratios_a2a = [tokens / t / a for a, t in zip(tps1, times["a2a"])]
    act1 = max(float(r[0, 0]) for r in per_rank)
    act2 = max(float(r[1, 0]) for r in per_rank)
    act_whole = max(float(r[2, 0]) for r in per_rank)
    act_a2a = max(float(r[3, 0]) for r in per_rank)
    vis1, vis2, vis_whole = (max(float(r[i, 1]) for r in per_rank) for i in (0, 1, 2))
    vis_s1, vis_s2, vis_s_whole = (statistics.median(float(r[i, 2]) for r in per_rank) for i in (0, 1, 2))
    result = {
        "model": WIDTHS[args.kind][1],
        "tokens": tokens, "video_tokens": video_tokens, "frames": args.frames, "rounds": args.rounds,
        "cp_max_logprob_diff": float(max((lp2 - lp1).abs().max(), (lp_whole - lp1).abs().max(),
                                         (lp_a2a - lp1).abs().max())),
        "max_abs_logprob": float(lp1.abs().max()),
        "activation_mib_cp1": act1 / mib, "activation_mib_cp2": act2 / mib,
        "activation_ratio_cp2": act2 / act1,
        "vision_activation_mib_cp1": vis1 / mib, "vision_activation_mib_cp2": vis2 / mib,
        "vision_share_of_activations_cp2": vis2 / act2,
        "vision_forward_s_cp1": vis_s1, "vision_forward_s_cp2": vis_s2,
        # CP 2 with the vision tower run whole on every rank (the split switched off)
        "activation_mib_cp2_vision_whole": act_whole / mib, "activation_ratio_cp2_vision_whole": act_whole / act1,
        "vision_activation_mib_cp2_vision_whole": vis_whole / mib, "vision_forward_s_cp2_vision_whole": vis_s_whole,
        "step_s_cp1": statistics.median(times[1]), "step_s_cp2": statistics.median(times[2]),
        "tokens_per_s_cp1": statistics.median(tps1), "tokens_per_s_cp2": statistics.median(tps2),
        "throughput_ratio_cp2": statistics.median(ratios),
        "sequence_speedup_cp2": statistics.median(a / b for a, b in zip(times[1], times[2])),
        # core attention by all-to-all (context_parallel_comm=a2a)
        "activation_mib_cp2_a2a": act_a2a / mib, "activation_ratio_cp2_a2a": act_a2a / act1,
        "step_s_cp2_a2a": statistics.median(times["a2a"]), "throughput_ratio_cp2_a2a": statistics.median(ratios_a2a),
    }
    print(f"{tokens} tokens ({video_tokens} video, {args.frames} frames) on 2 ranks:")
    print(f"  activations per rank (saved for backward): CP 1 {act1 / mib:.0f} MiB, CP 2 {act2 / mib:.0f} MiB "
          f"(ratio {act2 / act1:.2f}); the vision tower's {vis1 / mib:.0f} / {vis2 / mib:.0f} MiB of them")
    print(f"  CP 2 with the vision tower whole on each rank: {act_whole / mib:.0f} MiB (ratio {act_whole / act1:.2f}), "
          f"the tower's {vis_whole / mib:.0f} MiB")
    print(f"  fwd+bwd: CP 1 {result['step_s_cp1']:.2f} s a sequence per rank, CP 2 {result['step_s_cp2']:.2f} s "
          f"(speed-up {result['sequence_speedup_cp2']:.2f}); tokens/s of both ranks {result['tokens_per_s_cp1']:.0f} "
          f"vs {result['tokens_per_s_cp2']:.0f} (ratio {result['throughput_ratio_cp2']:.2f})")
    print(f"  CP 2, core attention by all-to-all (a2a): {act_a2a / mib:.0f} MiB (ratio {act_a2a / act1:.2f}), "
          f"fwd+bwd {result['step_s_cp2_a2a']:.2f} s (throughput ratio {result['throughput_ratio_cp2_a2a']:.2f})")
    print(f"  vision forward {vis_s1:.2f} s at CP 1, {vis_s2:.2f} s per rank at CP 2 (its frames split), "
          f"{vis_s_whole:.2f} s run whole")
    print(f"  max |logprob CP 2 - CP 1| = {result['cp_max_logprob_diff']:.2e} (largest |logprob| "
          f"{result['max_abs_logprob']:.1f})")
    print(json.dumps(result), flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kind", choices=sorted(WIDTHS), default="qwen3vl", help="the model family")
    # a smoke run: 16 frames (8 temporal patches of 16 tokens) in a 512-token sequence, one round
    ap.add_argument("--tokens", type=int, default=full_or_smoke(8192, 512), help="sequence length of the sample")
    ap.add_argument("--frames", type=int, default=full_or_smoke(256, 16), help="video frames (two per temporal patch)")
    ap.add_argument("--rounds", type=int, default=full_or_smoke(2, 1), help="timed rounds, each CP 1 then CP 2")
    args = ap.parse_args()
    if "RANK" in os.environ:
        rank_main(args)
        return 0
    model_dir(args.kind)  # built once, before the ranks start
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    return subprocess.call([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                            __file__, *sys.argv[1:]], env=env)


if __name__ == "__main__":
    raise SystemExit(main())
