"""The GPU path in one process on one GPU, checked and measured, stage by stage (a module each in
scripts/gpu_stages/); `scripts/gpu_check.sh` runs it (its header says how).

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
  checkpoint   the trainer's state saved as a distributed checkpoint (the default format) and
               resumed bit for bit after a step moved it: the snapshot's seconds (device to host,
               what a step waits for), the write's and the resume's, the bytes written
  lora         the trainer with rank-16 LoRA adapters: RL steps move the adapter alone, its
               export (what sync.lora=adapter sends) against the full one, its memory per phase
               beside the full-weight trainer's and the plan's
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
import importlib.util
import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the repo, when run as a script (scripts/ itself is on the path: gpu_stages)

import models  # noqa: E402,F401 - the CPU runtime hooks (none act on a GPU machine but torchvision's)
import torch  # noqa: E402

from gpu_stages.build import WIDTHS, build_model  # noqa: E402
from gpu_stages.checkpoint import checkpoint_stage  # noqa: E402
from gpu_stages.comm import comm_stage  # noqa: E402
from gpu_stages.common import params_m  # noqa: E402
from gpu_stages.lora import lora_stage  # noqa: E402
from gpu_stages.memory import memory_stage  # noqa: E402
from gpu_stages.offload import offload_stage  # noqa: E402
from gpu_stages.parity import family_parity_stage, parity_stage  # noqa: E402
from gpu_stages.report import (STAGES, TINY_KIND, Report, TimeUp, on_sigterm, print_plan_vs_measured,  # noqa: E402
                               with_needs)
from gpu_stages.rl import make_actor, rl_samples, rl_stage  # noqa: E402
from gpu_stages.speed import speed_stage  # noqa: E402

DEFAULT_OUT = ROOT / "runs" / "gpu_check"
# Modules the GPU machine does not have (../shared/RUNTIME.md): the check must not import them
# (wandb is absent there too, but Megatron imports it only where it is installed).
ABSENT_ON_GPU_MACHINE = ("vllm", "webdataset", "decord", "torchdata")


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
    selected = with_needs({s.strip() for s in args.only.split(",") if s.strip()})

    out_dir = Path(os.environ.get("OUT") or DEFAULT_OUT)
    out_dir.mkdir(parents=True, exist_ok=True)
    device = torch.device("cpu") if cpu else torch.device("cuda", 0)
    report = Report(out_dir / "gpu_check.json",
                    {"device": torch.cuda.get_device_name(0) if not cpu else "cpu", "torch": torch.__version__,
                     "widths": widths, "layers": args.layers, "train_dtype": dtype, "argv": sys.argv[1:],
                     "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                     # Qwen3.5's DeltaNet: fla's kernels where it is installed, else the pure-torch rule
                     "fla": importlib.util.find_spec("fla") is not None}, selected)
    signal.signal(signal.SIGTERM, on_sigterm)
    start = time.perf_counter()
    code = 0
    state: dict = {}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            report.run("comm", lambda: comm_stage(cpu))

            def build():
                state["hf_dir"] = str(build_model(Path(tmp) / f"qwen2vl-{widths}-widths", widths, args.layers))
                return {"params_m": params_m(state["hf_dir"])}

            report.run("build", build)
            report.run("parity", lambda: parity_stage(state["hf_dir"], device))

            def rl():
                state["actor"], processor = make_actor(state["hf_dir"], dtype, 4096)
                state["processor"] = processor
                state["samples"] = rl_samples(processor, groups, 4, 64)
                return rl_stage(state["actor"], state["samples"], steps)

            report.run("rl", rl)
            state["memory"] = report.run("memory", lambda: memory_stage(state["actor"], state["samples"], device))
            report.run("offload", lambda: offload_stage(state["actor"].trainer, device))
            report.run("checkpoint", lambda: checkpoint_stage(state["actor"], state["samples"], device, Path(tmp)))
            report.run("lora", lambda: lora_stage(state["hf_dir"], state["actor"], state["samples"], device, dtype, steps,
                                                  state.get("memory")))
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
    print_plan_vs_measured(data["plan_vs_measured"])
    _teardown()
    print(json.dumps(data, default=str), flush=True)
    return code or (0 if data["ok"] else 1)


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
