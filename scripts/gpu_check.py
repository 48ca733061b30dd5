"""The GPU path in one process on one GPU, checked and measured, stage by stage; `scripts/gpu_check.sh`
runs it (its header gives the exact steps on a lent GPU machine).

A Qwen2-VL with the real 2B model's widths (text 1536 wide, 12 heads / 2 KV heads, MLP 8960,
vocabulary 151,936; vision tower 1280 wide, 16 heads, MLP x4) and 2 layers each, random weights,
built here (no hub). Then, on the GPU (`--cpu`: the same steps on the CPU at small sizes, where
the CUDA-only figures are skipped and say so), each stage in its own guard:

  comm         torch.distributed with one rank and a one-element all-reduce on it (NCCL on a GPU,
               gloo on the CPU) before anything else, then Megatron's groups; CUDA context and
               NCCL memory per process (torch.cuda.mem_get_info before/after)
  build        the HF Qwen2-VL directory
  parity       Megatron's logits vs transformers' on the same weights and inputs, fp32 (TF32 off
               for matmuls and cuDNN) and bf16, each against its own tolerance (PARITY_TOLERANCE)
  rl           GRPO steps through the real `Actor` and `VLMTrainer` (NCCL, one rank; the loss's
               token counts over `models.comm`'s gloo group beside it)
  memory       the trainer's peak memory per phase (old logprobs, update) beside what
               `yatt-mm plan` predicts for the same model, settings and micro-batch; the
               allocator's slack and the memory outside torch's allocator after training
  offload      the trainer released to host memory and back, bit for bit; device memory freed;
               pinned host memory held, beside the plan's figure
  qwen3vl      parity of a Qwen3-VL (Qwen3-VL-8B's widths, 2 layers; the tiny one under --cpu)
  qwen3vl_moe  parity of the tiny Qwen3-VL-MoE (4 experts, top-2)
  qwen35       parity of the tiny Qwen3.5 (gated DeltaNet and gated attention layers; Megatron's
               pure-torch delta rule where fla is missing, transformers' own fallback beside it)
  qwen35_moe   parity of the tiny Qwen3.5-MoE (the same layers, 4 experts, top-2, a shared expert)
  speed        one training step on a batch large enough to keep an H200 busy (16 GRPO groups of
               4 responses of 1024 tokens; a few short ones under --cpu): Megatron vs transformers
               + AdamW, paired rounds, step ms, tokens/s and MFU from the model's FLOPs

Output: as soon as a stage ends, its figures (or its error) are written to `$OUT/gpu_check.json`
(the whole file, rewritten atomically: a kill at any point leaves the finished stages readable);
`$OUT` defaults to runs/gpu_check/ in the repo (git-ignored). gpu_check.sh copies all output to
`$OUT/gpu_check.log`. The last line printed is the same report as one JSON object. A stage that
raises is recorded as "error" and the others still run (those that need it are "skipped", saying
why); SIGTERM (gpu_check.sh's time limit) records the running stage as stopped. Exit code: 0 when
every stage ran and passed its checks, 1 otherwise, 2 without a GPU (and without --cpu), 124 when
stopped by the time limit.

YATT_MM_GPU_CHECK_FAIL=STAGE makes that stage raise at its start: a fault injection for
tests/cli/test_gpu_check.py only (it shows one stage's failure is recorded without losing the others).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import signal
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the repo, when run as a script

import models  # noqa: E402,F401 - the CPU runtime hooks (none act on a GPU machine but torchvision's)
import torch  # noqa: E402

GIB = 2**30
# the family stages' tiny models (models/tiny.py kinds)
TINY_KIND = {"qwen3vl": "qwen3vl", "qwen3vl_moe": "qwen3vlmoe", "qwen35": "qwen35", "qwen35_moe": "qwen35moe"}
STAGES = ("comm", "build", "parity", "rl", "memory", "offload", *TINY_KIND, "speed")
# the stages each stage needs: without them it is skipped, and --only runs them too
NEEDS = {"parity": ("build",), "rl": ("comm", "build"), "memory": ("rl",), "offload": ("rl",),
         **{kind: ("comm",) for kind in TINY_KIND}, "speed": ("rl",)}
DEFAULT_OUT = ROOT / "runs" / "gpu_check"
FAULT_ENV = "YATT_MM_GPU_CHECK_FAIL"
# Modules the GPU machine does not have (../shared/RUNTIME.md): the check must not import them
# (wandb is absent there too, but Megatron imports it only where it is installed).
ABSENT_ON_GPU_MACHINE = ("vllm", "webdataset", "decord", "torchdata")

# Parity is judged on max |logit difference| / max |reference logit| (bf16's error grows with the
# logits' size, and random 2B-width logits reach several units):
# - fp32: both sides in IEEE fp32 differ only in summation order (~1e-6 relative; the --cpu run
#   measures ~1e-6). 1e-4 sits well above that and well below TF32's 10-bit mantissa (~5e-4
#   relative a matmul): a reference silently running in TF32 fails instead of passing.
# - bf16: 8 mantissa bits, ~4e-3 relative rounding at every op, compounded over the layers and
#   rounded at different points by the two implementations (fused kernels, softmax precision).
#   5e-2 is ~12 bf16 steps of the largest logit (--cpu measures 8e-3 for Qwen2-VL, 1.1e-2 for
#   Qwen3-VL); a wrong weight or position moves logits by O(1).
# - bf16, mixture of experts: also a token whose top-2 router scores are within bf16's rounding
#   can go to another expert on one side (--cpu measures 3.7e-2 on the tiny Qwen3-VL-MoE), so
#   0.2; a broken expert layout or router still moves logits by O(1).
PARITY_TOLERANCE = {"fp32": 1e-4, "bf16": 5e-2, "bf16_moe": 0.2}

# Dense bf16 tensor-core peak of the GPUs MFU is reported for (NVIDIA's datasheets, SXM parts).
PEAK_BF16_FLOPS = {"H200": 989.4e12, "H100": 989.4e12}

# Qwen2-VL-2B-Instruct's widths (its config.json), 2 layers each instead of 28 and 32; "small"
# keeps its head sizes (text 128, vision 80) at a sixth of the widths and a twentieth of the
# vocabulary, for the CPU run (2 shared cores).
WIDTHS = {
    "2b": (dict(hidden_size=1536, intermediate_size=8960, num_attention_heads=12, num_key_value_heads=2,
                vocab_size=151936, mrope_section=[16, 24, 24]),
           dict(embed_dim=1280, num_heads=16, mlp_ratio=4, hidden_size=1536)),
    "small": (dict(hidden_size=256, intermediate_size=1024, num_attention_heads=2, num_key_value_heads=1,
                   vocab_size=8192, mrope_section=[16, 24, 24]),
              dict(embed_dim=160, num_heads=2, mlp_ratio=4, hidden_size=256)),
}


class TimeUp(BaseException):
    """SIGTERM (gpu_check.sh's `timeout`): not an Exception, so no library's handler swallows it."""


def _on_sigterm(signum, frame):
    raise TimeUp()


class Report:
    """The report: run facts and one entry per stage, rewritten whole to `path` after every change."""

    def __init__(self, path: Path, facts: dict, selected: set[str]):
        self.path = path
        self.selected = selected
        self.data: dict = {**facts, "ok": False, "stages": {s: {"status": "pending"} for s in STAGES}}
        self.write()

    def write(self) -> None:
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(self.data, indent=1, default=str))
        os.replace(tmp, self.path)  # atomic: a reader or a kill never sees half a file

    def status(self, name: str) -> str:
        return self.data["stages"][name]["status"]

    def ran(self, name: str) -> bool:
        return self.status(name) in ("ok", "failed")

    def run(self, name: str, fn):
        """Run stage `name` (fn() -> figures, optionally with "checks": {check: bool}); record
        ok / failed (a check did not hold) / error (raised) / skipped (not selected, or a stage
        it NEEDS did not run). Returns fn's figures or None."""
        if name not in self.selected:
            return self._end(name, {"status": "skipped", "reason": "not in --only"})
        missing = [n for n in NEEDS.get(name, ()) if not self.ran(n)]
        if missing:
            return self._end(name, {"status": "skipped", "reason": f"needs {', '.join(missing)}, which did not run"})
        self.data["stages"][name] = {"status": "running"}
        self.write()
        print(f"== {name}", flush=True)
        start = time.perf_counter()
        try:
            if os.environ.get(FAULT_ENV) == name:
                raise RuntimeError(f"fault injected by {FAULT_ENV}={name} (tests/cli/test_gpu_check.py only)")
            figures = fn() or {}
        except TimeUp:
            self._end(name, {"status": "error", "error": "stopped by the time limit (SIGTERM) during this stage",
                             "seconds": time.perf_counter() - start})
            for other in STAGES:
                if self.status(other) == "pending":
                    self.data["stages"][other] = {"status": "skipped", "reason": "time limit"}
            self.write()
            raise
        except Exception as e:  # noqa: BLE001 - recorded, and the other stages still run
            traceback.print_exc()
            self._end(name, {"status": "error", "error": f"{type(e).__name__}: {e}"[:2000],
                             "where": traceback.format_exc().strip().splitlines()[-3:],
                             "seconds": time.perf_counter() - start})
            del e  # its frames hold the stage's models: free them for the stages after
            _free(torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu"))
            return None
        checks = figures.get("checks", {})
        status = "ok" if all(checks.values()) else "failed"
        self._end(name, {"status": status, **figures, "seconds": round(time.perf_counter() - start, 2)})
        return figures

    def _end(self, name: str, entry: dict) -> None:
        self.data["stages"][name] = entry
        self.write()
        shown = {k: v for k, v in entry.items() if k not in ("where",)}
        print(f"   {name}: {json.dumps(shown, default=str)[:1500]}", flush=True)
        return None

    def finish(self) -> dict:
        self.data["ok"] = all(self.status(s) == "ok" for s in STAGES if s in self.selected)
        self.data["plan_vs_measured"] = plan_vs_measured(self.data["stages"])
        self.write()
        return self.data


# -- comm: process group, one all-reduce, CUDA context and NCCL memory -------------------------

def comm_stage(cpu: bool) -> dict:
    """torch.distributed (one rank), a one-element all-reduce on the accelerator backend at once
    (an NCCL failure costs seconds, not a model build), then Megatron's groups and the gloo ones."""
    import torch.distributed as dist

    from models.comm import init_distributed, init_parallel

    out: dict = {}
    used = _device_used()  # None on CPU
    if used is not None:
        # NVML, before this process makes a context: on a GPU nobody uses, the driver's reserve
        # (0.60 GiB on an H200), which NVML counts as used and CUDA leaves out of its total
        out["gpu_used_before_context_gib"] = used / GIB
    if torch.cuda.is_available():
        torch.cuda.set_device(0)
        free, total = torch.cuda.mem_get_info()  # makes the CUDA context
        # CUDA's own view, as the allocator and the plan see the card (the GPU is otherwise empty
        # here; subtracting NVML's figure would also subtract the driver's reserve: < 0 on an H200)
        out["cuda_context_gib"] = (total - free) / GIB
        before = total - free - torch.cuda.memory_reserved()
    else:
        out["cuda"] = "skipped: no CUDA"
        out["rss_before_gib"] = _rss() / GIB
    init_distributed()
    backend = dist.get_backend()
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    one = torch.ones(1, device=device)
    try:
        dist.all_reduce(one)
        if device.type == "cuda":
            torch.cuda.synchronize()
    except Exception as e:
        raise RuntimeError(f"the first {backend} all-reduce (one element, one rank) failed: {e}. Nothing that "
                           "trains can run; rerun with NCCL_DEBUG=INFO for NCCL's reason") from e
    if float(one) != dist.get_world_size():
        raise RuntimeError(f"the first {backend} all-reduce gave {float(one)}, not {dist.get_world_size()}")
    out |= {"backend": backend, "all_reduce": "ok"}
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info()
        out["nccl_gib"] = (total - free - torch.cuda.memory_reserved() - before) / GIB
        out["context_plus_nccl_gib"] = out["cuda_context_gib"] + out["nccl_gib"]
    init_parallel(1)  # Megatron's groups (NCCL on the GPU) and the gloo ones beside them
    if device.type == "cpu":
        out["rss_after_gib"] = _rss() / GIB
    from yatt_mm.plan import CUDA_CONTEXT_GIB

    out["plan_cuda_context_gib"] = CUDA_CONTEXT_GIB  # the plan's per process: this, then cuBLAS and kernels
    return out


def _device_used() -> int | None:
    """Bytes in use on GPU 0 without making a CUDA context (NVML), or None (no GPU, no pynvml)."""
    if not torch.cuda.is_available():
        return None
    try:
        import pynvml

        pynvml.nvmlInit()
        return int(pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(0)).used)
    except Exception:  # noqa: BLE001 - then the context figure includes whatever else is on the GPU
        return None


def _rss() -> int:
    import psutil

    return psutil.Process().memory_info().rss


# -- build ---------------------------------------------------------------------------------------

def build_model(out: Path, widths: str = "2b", layers: int = 2) -> Path:
    """An HF Qwen2-VL directory: the offline tiny tokenizer and processors (their token ids sit
    inside the 2B vocabulary), the given widths, random weights."""
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration, Qwen2VLProcessor

    from models.hf_io import save_pretrained_on_any_rank
    from models.qwen2vl.tiny import save_processor
    from models.tiny import SPECIAL_TOKENS, TinySpec, build_tokenizer, token_ids

    text_w, vision_w = WIDTHS[widths]
    tokenizer = build_tokenizer()
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    text = dict(vocab_size=text_w["vocab_size"], hidden_size=text_w["hidden_size"],
                intermediate_size=text_w["intermediate_size"], num_hidden_layers=layers,
                num_attention_heads=text_w["num_attention_heads"], num_key_value_heads=text_w["num_key_value_heads"],
                max_position_embeddings=32768,
                rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": text_w["mrope_section"]},
                bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"])
    vision = dict(depth=layers, patch_size=14, spatial_merge_size=2, temporal_patch_size=2, **vision_w)
    config = Qwen2VLConfig(text_config=text, vision_config=vision, **token_ids(ids))
    torch.manual_seed(0)
    save_pretrained_on_any_rank(Qwen2VLForConditionalGeneration(config).to(torch.float32), out)
    # images up to 448x448 (256 merged tokens), as a real 2B run would see
    save_processor(out, TinySpec(max_pixels=448 * 448), tokenizer, Qwen2VLProcessor)
    return out


# -- parity --------------------------------------------------------------------------------------

def parity_stage(hf_dir: str, device: torch.device, moe: bool = False) -> dict:
    """fp32 with TF32 off for matmuls and cuDNN (transformers' patch embedding is a Conv3d, which
    cuDNN runs in TF32 by default on Hopper: the reference itself would be off by ~1e-3), then
    bf16; the TF32 settings are restored after and recorded as they were during the comparison."""
    matmul, cudnn = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    try:
        out = {"tf32_matmul": torch.backends.cuda.matmul.allow_tf32, "tf32_cudnn": torch.backends.cudnn.allow_tf32,
               # the same settings as torch's newer API reads them ("ieee", or "none": no TF32 either)
               "fp32_precision": {"matmul": getattr(torch.backends.cuda.matmul, "fp32_precision", None),
                                  "cudnn_conv": getattr(getattr(torch.backends.cudnn, "conv", None), "fp32_precision",
                                                        None)}}
        for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
            diff, scale, dtypes = parity(hf_dir, device, dtype)
            out[name] = {"max_abs_diff": diff, "max_abs_logit": scale, "rel": diff / scale,
                         "tolerance_rel": PARITY_TOLERANCE[name + ("_moe" if moe and name == "bf16" else "")],
                         "param_dtypes": dtypes}
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = matmul, cudnn
    out["checks"] = {f"parity_{n}": out[n]["rel"] < out[n]["tolerance_rel"] for n in ("fp32", "bf16")}
    # every parameter in the model's dtype: CUDA's layer_norm refuses a bf16 input with a float32
    # weight (the first GPU run's error; the CPU's accepts it), so a norm left in float32 fails here
    out["checks"] |= {f"params_{n}": out[n]["param_dtypes"] == [str(d)] for n, d in
                      (("fp32", torch.float32), ("bf16", torch.bfloat16))}
    return out


def parity(hf_dir: str, device: torch.device, dtype: torch.dtype) -> tuple[float, float, list[str]]:
    """(max |logit difference|, max |reference logit|, our model's parameter dtypes) of Megatron
    vs transformers over the built-in probes (text, image, two images, video), both in `dtype` on
    `device`; any family (a family with timed videos gets their metadata, as its own parity does)."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from models.family import family_for_dir, read_spec
    from models.inputs import VLMInputs
    from models.qwen2vl.parity import probes
    from models.qwen3vl.parity import with_video_metadata

    family, spec = family_for_dir(hf_dir), read_spec(hf_dir)
    ours = family.build_model(spec, dtype, 1).to(device).eval()
    family.load_hf_into(ours, hf_dir, 0, 1)
    dtypes = sorted({str(p.dtype) for p in ours.parameters()})
    hf = AutoModelForImageTextToText.from_pretrained(hf_dir, dtype=dtype).to(device).eval()
    processor = AutoProcessor.from_pretrained(hf_dir)
    timed = spec.model_type in family.timed_video_types
    worst = scale = 0.0
    for messages, media in probes().values():
        batch = processor(text=[processor.apply_chat_template(messages, add_generation_prompt=True)],
                          return_tensors="pt", **(with_video_metadata(media) if timed else media))
        with torch.no_grad():
            ref = hf(**{k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.items()}).logits.float()
            got = ours(VLMInputs.from_processor(spec, dict(batch)).to(device)).float()
        worst = max(worst, float((ref - got).abs().max()))
        scale = max(scale, float(ref.abs().max()))
    del ours, hf
    _free(device)
    return worst, scale, dtypes


def family_parity_stage(kind: str, cpu: bool, device: torch.device, tmp: Path) -> dict:
    """Parity of another family's model: the tiny one (models/<family>/tiny.py through
    models/tiny.py's cache) under --cpu; on a GPU Qwen3-VL at Qwen3-VL-8B's widths with 2 layers
    (its builder's REAL_8B_WIDTHS), the others at their tiny sizes."""
    from models.tiny import tiny_model_dir

    if kind == "qwen3vl" and not cpu:
        from models.qwen3vl.tiny import REAL_8B_WIDTHS, make_tiny

        hf_dir = str(tmp / "qwen3vl-8b-widths")
        make_tiny(hf_dir, widths=REAL_8B_WIDTHS)
    else:
        hf_dir = str(tiny_model_dir(TINY_KIND[kind]))
    out = {"model": Path(hf_dir).name, "params_m": _params_m(hf_dir)}
    out |= parity_stage(hf_dir, device, moe=kind.endswith("_moe"))
    return out


def _params_m(hf_dir: str) -> float:
    from safetensors import safe_open

    n = 0
    for path in Path(hf_dir).glob("*.safetensors"):
        with safe_open(str(path), "pt") as f:
            n += sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())
    return n / 1e6


# -- RL steps ------------------------------------------------------------------------------------

def rl_samples(processor, n_groups: int, n: int, response_tokens: int, seed: int = 0):
    """GRPO groups as the controller builds them: a prompt with an image, n responses of random
    tokens, rewards 0/1 with group-relative advantages."""
    import numpy as np
    from PIL import Image

    from yatt_mm.rl.advantages import advantages
    from yatt_mm.rl.samples import TrainSample

    rng = random.Random(seed)
    np_rng = np.random.default_rng(seed)
    vocab = len(processor.tokenizer) - 20  # ordinary tokens, not the special ones at the end
    out = []
    for g in range(n_groups):
        image = Image.fromarray(np_rng.integers(0, 255, (224, 224, 3), dtype=np.uint8))
        msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What colour is the square?"}]}]
        enc = processor(text=[processor.apply_chat_template(msgs, add_generation_prompt=True)], images=[image],
                        return_tensors="pt")
        prompt = enc["input_ids"][0]
        rewards = torch.tensor([float(rng.random() < 0.5) for _ in range(n)])
        adv = advantages("grpo", rewards, [f"g{g}"] * n)
        for i in range(n):
            ids = torch.cat([prompt, torch.randint(0, vocab, (response_tokens,), generator=torch.Generator().manual_seed(g * 97 + i))])
            mask = torch.zeros(ids.numel())
            mask[prompt.numel() - 1 : -1] = 1.0
            out.append(TrainSample(input_ids=ids, loss_mask=mask, rollout_logprobs=torch.zeros(ids.numel()),
                                   advantage=float(adv[i]), reward=float(rewards[i]), group_id=f"g{g}",
                                   pixel_values=enc["pixel_values"], image_grid_thw=enc["image_grid_thw"]))
    return out


def make_actor(hf_dir: str, dtype: str, micro_batch_tokens: int):
    """The real Actor over a VLMTrainer, 2 PPO mini-batches a step (an old-logprob pass, then the
    clipped loss). No vLLM on the check machine: its logprobs are absent, so the sampler
    correction and the trainer/sampler gap guard are off here (the CPU tests cover both)."""
    from transformers import AutoProcessor

    from models.trainer import TrainerConfig, VLMTrainer
    from yatt_mm.rl.actor import Actor
    from yatt_mm.rl.algorithms import AlgorithmConfig

    trainer = VLMTrainer(hf_dir, TrainerConfig(dtype=dtype, lr=1e-5, offload="always"))
    processor = AutoProcessor.from_pretrained(hf_dir)
    algorithm = AlgorithmConfig(mini_batches=2)
    algorithm.rollout_correction.level = "none"  # random tokens: no sampler to correct for
    actor = Actor(trainer, algorithm, micro_batch_tokens=micro_batch_tokens,
                  pad_id=processor.tokenizer.pad_token_id, max_logprob_diff=float("inf"))
    return actor, processor


def rl_stage(actor, samples, steps: int) -> dict:
    losses, changed = [], []
    for _ in range(steps):
        minis = actor.prepare(samples)
        actor.old_logprobs(minis)
        actor.batch_advantages(minis)
        m = actor.update(minis)
        losses.append(m["train/loss"])
        changed.append(m["train/weights_checksum_after"] != m["train/weights_checksum_before"])
    return {"losses": losses, "weights_changed_every_step": all(changed), "grad_norm": m["train/grad_norm"],
            "checks": {"losses_finite": all(map(math.isfinite, losses)), "weights_changed": all(changed),
                       "grad_norm_positive": m["train/grad_norm"] > 0}}


# -- memory: the trainer's phases, measured beside the plan --------------------------------------

def memory_stage(actor, samples, device: torch.device) -> dict:
    """One more RL step, each phase's peak measured (CUDA: max_memory_allocated; CPU: the peak of
    the bytes the phase allocated and has not freed, from torch.profiler's memory events, as
    benchmarks/bench_memory_plan.py measures it, on top of the trainer's resident bytes), beside
    the plan's figures for the same model, settings and largest micro-batch (CUDA or CPU kernels)."""
    from yatt_mm import plan

    trainer = actor.trainer
    trainer.acquire("all")
    minis = actor.prepare(samples)
    resident = trainer.device_bytes()
    measured = {}
    for phase, run in (("logprobs", lambda: actor.old_logprobs(minis)),
                       ("train", lambda: (actor.batch_advantages(minis), actor.update(minis)))):
        measured[phase] = _phase_peak(run, device, resident)
    shape = _plan_shape(max((mb for mini in minis for mb in mini), key=lambda mb: mb.inputs.input_ids.numel()),
                        trainer.spec)
    planned = plan.trainer_memory(trainer.spec, trainer.cfg, 1, shape, plan.CUDA if device.type == "cuda" else plan.CPU)
    out = {"micro_batch": {"rows": shape.rows, "seq": shape.seq, "scored": shape.scored,
                           "media_tokens": shape.media_tokens, "frame_tokens": shape.frame_tokens},
           "resident_gib": {"plan": planned.persistent / GIB, "measured": resident / GIB},
           "logprobs_peak_gib": {"plan": (planned.persistent + planned.activations.forward_only) / GIB,
                                 "measured": measured["logprobs"] / GIB},
           "train_peak_gib": {"plan": planned.peak / GIB, "measured": measured["train"] / GIB}}
    if device.type == "cuda":
        reserved, allocated = torch.cuda.max_memory_reserved(), torch.cuda.max_memory_allocated()
        free, total = torch.cuda.mem_get_info()
        out["allocator_slack"] = {"plan": plan.ALLOCATOR_SLACK, "measured": reserved / allocated - 1}
        # what the plan's CUDA_CONTEXT_GIB stands for, after real training: context, NCCL, cuBLAS
        # and kernels' workspaces outside torch's allocator
        out["outside_allocator_gib"] = {"plan": plan.CUDA_CONTEXT_GIB,
                                        "measured": (total - free - torch.cuda.memory_reserved()) / GIB}
    else:
        out["cuda"] = "skipped: no CUDA (peaks from torch.profiler's CPU memory events, CPU kernels' plan)"
    return out


def _phase_peak(run, device: torch.device, resident: int) -> int:
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        run()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated()
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from bench_memory_plan import step_peak_bytes

    return resident + step_peak_bytes(run)


def _plan_shape(mb, spec):
    """The plan's MicroBatchShape of a real micro-batch: rows, padded length, scored positions,
    media tokens and merged tokens per image."""
    from yatt_mm.plan import MicroBatchShape

    rows, seq = mb.inputs.input_ids.shape
    scored = int(mb.score_mask.sum()) if mb.score_mask is not None else rows * seq
    media = int((mb.inputs.input_ids == spec.image_token_id).sum())
    grid = mb.inputs.image_grid_thw
    frame = int(grid[0].prod()) // spec.spatial_merge_size**2 if grid is not None and len(grid) else 1
    return MicroBatchShape(rows=rows, seq=seq, scored=scored, media_tokens=media, frame_tokens=frame)


# -- offload -------------------------------------------------------------------------------------

def offload_stage(trainer, device: torch.device) -> dict:
    """release("none") and acquire("all"): bytes back bit for bit, device memory freed, the host
    memory held meanwhile (pinned on a GPU) beside the plan's trainer offload figure."""
    from models.offload import optimizer_tensors
    from yatt_mm import plan

    def snapshot():
        return [t.detach().clone().cpu() for t in list(trainer.module.parameters()) + optimizer_tensors(trainer.optimizer)]

    trainer.acquire("all")
    before, resident = snapshot(), trainer.device_bytes()
    allocated, rss = _allocated(device), _rss()
    release_s = trainer.release("none")
    host = _held_host(trainer)
    out = {"resident_gib": resident / GIB, "release_seconds": release_s,
           "host_gib": {"plan": plan.trainer_memory(trainer.spec, trainer.cfg, 1, _tiny_shape(),
                                                    plan.CUDA).host_offload / GIB,
                        "measured": sum(h.nbytes for h in host) / GIB},
           "host_pinned": bool(host) and all(h.is_pinned() for h in host)}
    if device.type == "cuda":
        out["freed_gpu_gib"] = (allocated - _allocated(device)) / GIB
        # the pinned-memory allocator's own count (torch.cuda.host_memory_stats, where torch has it)
        stats = torch.cuda.host_memory_stats() if hasattr(torch.cuda, "host_memory_stats") else {}
        pinned = stats.get("allocated_bytes.current")
        out["pinned_allocator_gib"] = pinned / GIB if pinned is not None else None
    else:
        out["cuda"] = "skipped: no CUDA"
        out["rss_growth_gib"] = (_rss() - rss) / GIB  # same memory on a CPU: the host copies
    out["acquire_seconds"] = trainer.acquire("all")
    after = snapshot()
    out["bitwise"] = len(before) == len(after) and all(torch.equal(a, b) for a, b in zip(before, after))
    checks = {"bitwise": out["bitwise"], "host_copy_held": out["host_gib"]["measured"] > 0}
    if device.type == "cuda":
        checks |= {"pinned": out["host_pinned"], "freed": out["freed_gpu_gib"] > 0}
    out["checks"] = checks
    return out


def _held_host(trainer) -> list[torch.Tensor]:
    """The host copies a released trainer holds (models/offload.py's HostOffload entries; gradient
    buffers are dropped, not copied)."""
    return [h.host for part in (trainer._state, trainer._weights) for h in part._held if h.host is not None]


def _tiny_shape():
    """host_offload (weights + optimizer state) does not depend on the micro-batch."""
    from yatt_mm.plan import MicroBatchShape

    return MicroBatchShape(rows=1, seq=1, scored=1, media_tokens=0, frame_tokens=1)


# -- speed ---------------------------------------------------------------------------------------

def speed_stage(hf_dir: str, actor, samples, device: torch.device, dtype: str, rounds: int) -> dict:
    """One training step on the same micro-batches and token-mean loss: the Megatron trainer vs
    transformers' model + torch AdamW (fp32 weights, bf16 autocast on a GPU), both resident, in
    paired rounds (which goes first alternates); step ms as medians, the ratio as the median of
    the rounds' ratios, MFU from the batch's model FLOPs (`train_flops`)."""
    from transformers import AutoModelForImageTextToText

    trainer = actor.trainer
    trainer.acquire("all")
    mbs = actor.micro_batches(samples)
    tokens = sum(int(mb.inputs.attention_mask.sum()) for mb in mbs)
    target = sum(float(mb.extra["loss_mask"].sum()) for mb in mbs)

    def megatron_step():
        trainer.train_step(mbs, lambda lp, mb: (-(lp * mb.extra["loss_mask"]).sum() / target, {}))

    hf = AutoModelForImageTextToText.from_pretrained(hf_dir, dtype=torch.float32).to(device).train()
    opt = torch.optim.AdamW(hf.parameters(), lr=1e-5, weight_decay=0.0)
    image_token = hf.config.image_token_id

    def hf_step():
        opt.zero_grad(set_to_none=True)
        for mb in mbs:
            x = mb.inputs.to(device)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=dtype == "bf16"):
                logits = hf(input_ids=x.input_ids, attention_mask=x.attention_mask, pixel_values=_per_occurrence(x),
                            image_grid_thw=x.image_grid_thw,
                            mm_token_type_ids=(x.input_ids == image_token).int()).logits
            lp = torch.log_softmax(logits.float(), -1).gather(-1, mb.labels.to(device).unsqueeze(-1)).squeeze(-1)
            (-(lp * mb.extra["loss_mask"].to(device)).sum() / target).backward()
        torch.nn.utils.clip_grad_norm_(hf.parameters(), 1.0)
        opt.step()

    steps = {"megatron": megatron_step, "transformers": hf_step}
    times: dict[str, list[float]] = {k: [] for k in steps}
    extra: dict[str, int] = {}
    for name, step in steps.items():  # warm-up (allocations, kernels), the step's own memory measured
        extra[name] = _step_extra_bytes(step, device)
    for r in range(rounds):
        order = list(steps) if r % 2 == 0 else list(steps)[::-1]
        for name in order:
            times[name].append(_seconds(steps[name], device))
    flops = train_flops(trainer.spec, mbs)
    peak = _peak_flops(device, dtype)
    out = {"micro_batches": len(mbs), "tokens_per_step": tokens, "scored_per_step": int(target),
           "model_tflop_per_step": flops / 1e12, "peak_tflops": peak and peak / 1e12, "rounds": rounds}
    for name in steps:
        s = statistics.median(times[name])
        out[name] = {"step_ms": s * 1e3, "tokens_per_s": tokens / s, "model_tflops": flops / s / 1e12,
                     "mfu": flops / s / peak if peak else None,
                     "step_extra_gib": extra[name] / GIB if device.type == "cuda" else None}
    out["ratio_to_transformers"] = statistics.median(b / a for a, b in zip(times["megatron"], times["transformers"]))
    del hf, opt
    _free(device)
    out["checks"] = {"timed": all(out[n]["tokens_per_s"] > 0 for n in steps)}
    return out


def train_flops(spec, mbs) -> int:
    """Model FLOPs of one training step (forward + backward = 3 x forward, 2 per multiply-add) on
    the micro-batches' real tokens, by the plan's formula (yatt_mm/plan/flops.py) on each row's
    real length and each distinct image's patches (each image once, as the trainer encodes it,
    attending within itself). Padding, recompute and transformers' per-occurrence image encoding
    are work the model's FLOPs do not count."""
    from yatt_mm.plan.flops import language_forward_flops, vision_forward_flops

    flops = 0
    for mb in mbs:
        flops += language_forward_flops(spec, mb.inputs.attention_mask.sum(-1).tolist())
        if mb.inputs.image_grid_thw is not None:
            patches = _distinct_image_patches(mb.inputs)
            flops += vision_forward_flops(spec, sum(patches), patches)
    return 3 * flops


def _distinct_image_patches(x) -> list[int]:
    """Patches of each distinct image of a micro-batch, in pixel_values' order (a group's shared
    image once: `VLMInputs.image_sources` maps each occurrence to its distinct image)."""
    sources = x.image_sources.tolist() if x.image_sources is not None else range(len(x.image_grid_thw))
    sizes: dict[int, int] = {}
    for src, grid in zip(sources, x.image_grid_thw):
        sizes.setdefault(src, int(grid.prod()))
    return [sizes[i] for i in range(len(sizes))]


def _peak_flops(device: torch.device, dtype: str) -> float | None:
    if device.type != "cuda" or dtype != "bf16":
        return None
    name = torch.cuda.get_device_name()
    return next((f for gpu, f in PEAK_BF16_FLOPS.items() if gpu in name), None)


def _per_occurrence(x) -> torch.Tensor:
    """The micro-batch's pixel values with a copy per image occurrence, as transformers takes them
    (the trainer encodes a group's shared image once; `VLMInputs.image_sources`)."""
    if x.image_sources is None:
        return x.pixel_values
    distinct = torch.split(x.pixel_values, _distinct_image_patches(x))
    return torch.cat([distinct[s] for s in x.image_sources.tolist()])


def _step_extra_bytes(step, device: torch.device) -> int:
    """Run `step` once; on CUDA, the peak it allocated above what was allocated before it."""
    _sync(device)
    before = _allocated(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    step()
    _sync(device)
    return torch.cuda.max_memory_allocated() - before if device.type == "cuda" else 0


def _seconds(step, device: torch.device) -> float:
    _sync(device)
    t0 = time.perf_counter()
    step()
    _sync(device)
    return time.perf_counter() - t0


def _allocated(device: torch.device) -> int:
    return torch.cuda.memory_allocated() if device.type == "cuda" else 0


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _free(device: torch.device) -> None:
    import gc

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# -- the report's plan-vs-measured lines ---------------------------------------------------------

def plan_vs_measured(stages: dict) -> dict:
    """Every {"plan", "measured"} pair the stages recorded, as "stage.figure": [plan, measured]."""
    out = {}
    for stage, entry in stages.items():
        for key, value in entry.items():
            if isinstance(value, dict) and {"plan", "measured"} <= value.keys():
                out[f"{stage}.{key}"] = [value["plan"], value["measured"]]
    # (the plan's CUDA_CONTEXT_GIB is what stays outside the allocator after training, compared in
    # memory.outside_allocator_gib; comm's context + NCCL right after start is a part of it)
    return out


def _print_plan_vs_measured(pairs: dict) -> None:
    if pairs:
        print(f"{'plan vs measured':<34}{'plan':>10}{'measured':>10}")
        for key, (p, m) in pairs.items():
            print(f"  {key:<32}{p:>10.3f}{m:>10.3f}")


# -- main ----------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cpu", action="store_true", help="no GPU: run everything that does not need CUDA, small")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--widths", choices=sorted(WIDTHS), default=None, help="default: 2b on a GPU, small with --cpu")
    ap.add_argument("--steps", type=int, default=None, help="RL steps (default 3; --cpu 2)")
    ap.add_argument("--groups", type=int, default=None, help="GRPO groups of 4 responses in an RL step (4; --cpu 2)")
    ap.add_argument("--speed-groups", type=int, default=None, help="GRPO groups in the speed batch (16; --cpu 1)")
    ap.add_argument("--speed-tokens", type=int, default=None, help="response tokens in the speed batch (1024; --cpu 32)")
    ap.add_argument("--rounds", type=int, default=None, help="paired timed rounds (5; --cpu 1)")
    ap.add_argument("--only", default=",".join(STAGES),
                    help="comma-separated stages to run (a rerun of what failed); the stages they need run too")
    args = ap.parse_args(argv)
    cpu = args.cpu
    if not cpu and not torch.cuda.is_available():
        print("gpu_check: no GPU visible; run with --cpu for the CPU part", file=sys.stderr)
        return 2
    steps = args.steps or (2 if cpu else 3)
    groups = args.groups or (2 if cpu else 4)
    speed_groups, speed_tokens = args.speed_groups or (1 if cpu else 16), args.speed_tokens or (32 if cpu else 1024)
    rounds = args.rounds or (1 if cpu else 5)
    widths = args.widths or ("small" if cpu else "2b")
    dtype = "fp32" if cpu else "bf16"
    selected = _with_needs({s.strip() for s in args.only.split(",") if s.strip()})

    out_dir = Path(os.environ.get("OUT") or DEFAULT_OUT)
    out_dir.mkdir(parents=True, exist_ok=True)
    device = torch.device("cpu") if cpu else torch.device("cuda", 0)
    report = Report(out_dir / "gpu_check.json",
                    {"device": torch.cuda.get_device_name(0) if not cpu else "cpu", "torch": torch.__version__,
                     "widths": widths, "layers": args.layers, "train_dtype": dtype, "argv": sys.argv[1:],
                     "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}, selected)
    signal.signal(signal.SIGTERM, _on_sigterm)
    start = time.perf_counter()
    code = 0
    state: dict = {}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            report.run("comm", lambda: comm_stage(cpu))

            def build():
                state["hf_dir"] = str(build_model(Path(tmp) / f"qwen2vl-{widths}-widths", widths, args.layers))
                return {"params_m": _params_m(state["hf_dir"])}

            report.run("build", build)
            report.run("parity", lambda: parity_stage(state["hf_dir"], device))

            def rl():
                state["actor"], processor = make_actor(state["hf_dir"], dtype, 4096)
                state["processor"] = processor
                state["samples"] = rl_samples(processor, groups, 4, 64)
                return rl_stage(state["actor"], state["samples"], steps)

            report.run("rl", rl)
            report.run("memory", lambda: memory_stage(state["actor"], state["samples"], device))
            report.run("offload", lambda: offload_stage(state["actor"].trainer, device))
            for kind in TINY_KIND:
                report.run(kind, lambda k=kind: family_parity_stage(k, cpu, device, Path(tmp)))

            def speed():
                samples = rl_samples(state["processor"], speed_groups, 4, speed_tokens, seed=1)
                return speed_stage(state["hf_dir"], state["actor"], samples, device, dtype, rounds)

            report.run("speed", speed)
    except TimeUp:
        code = 124
    report.data["absent_on_gpu_machine_imported"] = sorted(m for m in ABSENT_ON_GPU_MACHINE if m in sys.modules)
    report.data["seconds"] = time.perf_counter() - start
    data = report.finish()
    _print_plan_vs_measured(data["plan_vs_measured"])
    _teardown()
    print(json.dumps(data, default=str), flush=True)
    return code or (0 if data["ok"] else 1)



def _with_needs(names: set[str]) -> set[str]:
    unknown = names - set(STAGES)
    if unknown:
        raise SystemExit(f"gpu_check: --only: unknown stage(s) {sorted(unknown)}; stages: {', '.join(STAGES)}")
    out, todo = set(), list(names)
    while todo:
        name = todo.pop()
        if name not in out:
            out.add(name)
            todo.extend(NEEDS.get(name, ()))
    return out


def _teardown() -> None:
    """Megatron's groups and the default group gone before the JSON line (no warning after it,
    no teardown left to stall at exit)."""
    import torch.distributed as dist

    try:
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()
    except Exception:  # noqa: BLE001 - megatron absent or never initialised: nothing to destroy
        pass
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    raise SystemExit(main())
