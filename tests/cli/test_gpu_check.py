"""`scripts/gpu_check.sh --cpu`: the GPU check's script, run here up to its CUDA-only parts, so
that the command a GPU session runs is known to work before a GPU is ever lent."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
STAGES = ["comm", "build", "parity", "rl", "memory", "offload", "checkpoint", "lora", "qwen3vl", "qwen3vl_moe", "qwen35",
          "qwen35_moe", "speed"]
BROKEN = "qwen3vl"  # the stage made to raise (scripts/gpu_check.py's fault injection for this test)


@pytest.mark.slow
def test_gpu_check_runs_on_cpu_stage_by_stage(tmp_path):
    """One run with one stage made to raise: every stage's figures or error are in
    $OUT/gpu_check.json, the log in $OUT/gpu_check.log, the stages after the broken one still
    run and pass, and the last line printed is the same report."""
    env = {**os.environ, "PYTHON": sys.executable, "OUT": str(tmp_path), "YATT_MM_GPU_CHECK_FAIL": BROKEN}
    proc = subprocess.run(["bash", "scripts/gpu_check.sh", "--cpu"], cwd=ROOT, capture_output=True, text=True,
                          timeout=900, env=env)
    assert proc.returncode == 1, (proc.stdout[-3000:], proc.stderr[-3000:])  # 1: a stage did not pass
    printed = json.loads(proc.stdout.strip().splitlines()[-1])
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    print("GPU check report (--cpu):", json.dumps(report))
    assert printed == report
    log = (tmp_path / "gpu_check.log").read_text()
    assert "== comm" in log and "fault injected" in log and proc.stdout.strip().splitlines()[-1] in log

    stages = report["stages"]
    assert list(stages) == STAGES
    assert stages[BROKEN]["status"] == "error" and "fault injected" in stages[BROKEN]["error"]
    assert {s: e["status"] for s, e in stages.items() if s != BROKEN} == {s: "ok" for s in STAGES if s != BROKEN}
    assert report["ok"] is False and report["device"] == "cpu"
    assert report["absent_on_gpu_machine_imported"] == []  # nothing the GPU machine lacks (vLLM, ...)

    comm = stages["comm"]
    assert comm["backend"] == "gloo" and comm["all_reduce"] == "ok" and comm["cuda"] == "skipped: no CUDA"
    # max |logit diff| / max |logit| vs transformers, ~10x the measured figures (the CPU's kernels,
    # AMX or AVX-512, set the bf16 ones): Qwen2-VL fp32 8.6e-7, bf16 7.7e-3; Qwen3-VL-MoE fp32
    # 4.5e-7, bf16 3.7e-2 (a routing flip); Qwen3.5 fp32 6.0e-7, bf16 8.8e-3; Qwen3.5-MoE fp32
    # 1.1e-6, bf16 0.13 (routing flips)
    parity, moe = stages["parity"], stages["qwen3vl_moe"]
    # TF32 off for the comparison (the default reads "none"; setting allow_tf32 = False makes it "ieee")
    assert parity["tf32_matmul"] is False and parity["tf32_cudnn"] is False
    assert parity["fp32_precision"]["matmul"] == "ieee"
    assert parity["fp32"]["rel"] < 1e-5 and parity["bf16"]["rel"] < 0.08
    assert moe["fp32"]["rel"] < 1e-5 and moe["bf16"]["rel"] < 0.2
    assert stages["qwen35"]["fp32"]["rel"] < 1e-5 and stages["qwen35"]["bf16"]["rel"] < 0.05
    assert stages["qwen35_moe"]["fp32"]["rel"] < 1e-5 and stages["qwen35_moe"]["bf16"]["rel"] < 0.2
    rl = stages["rl"]
    assert len(rl["losses"]) == 2 and rl["weights_changed_every_step"] and rl["grad_norm"] > 0
    # the plan beside the real trainer (CPU kernels): resident state counted exactly, phase peaks
    # measured 0.7% (logprobs) and 11% (train) off the plan
    memory = stages["memory"]
    assert abs(memory["resident_gib"]["measured"] / memory["resident_gib"]["plan"] - 1) < 0.01
    for phase in ("logprobs_peak_gib", "train_peak_gib"):
        assert abs(memory[phase]["measured"] / memory[phase]["plan"] - 1) < 0.25, (phase, memory[phase])
    offload = stages["offload"]
    assert offload["bitwise"] and offload["host_gib"]["measured"] > 0.05
    assert abs(offload["host_gib"]["measured"] / offload["host_gib"]["plan"] - 1) < 0.01  # weights + Adam state
    assert report["plan_vs_measured"]["offload.host_gib"] == [offload["host_gib"]["plan"], offload["host_gib"]["measured"]]
    # LoRA: the adapter alone moved and synced; the LoRA trainer's memory beside the plan's (CPU
    # kernels) and below the full-weight trainer's on the same samples
    checkpoint = stages["checkpoint"]  # the distributed checkpoint: saved, moved by a step, resumed bit for bit
    assert checkpoint["checks"] == {"bitwise": True, "moved_between": True, "resumed_step_1": True}, checkpoint
    assert checkpoint["snapshot_seconds"] > 0 and checkpoint["written_gib"] > 0.05, checkpoint
    lora = stages["lora"]
    assert lora["checks"] == {"losses_finite": True, "adapter_moved": True, "base_unchanged": True,
                              "adapter_sync_smaller": True}, lora
    assert abs(lora["resident_gib"]["measured"] / lora["resident_gib"]["plan"] - 1) < 0.01, lora["resident_gib"]
    for phase in ("logprobs_peak_gib", "train_peak_gib"):
        assert abs(lora[phase]["measured"] / lora[phase]["plan"] - 1) < 0.25, (phase, lora[phase])
    assert 0 < lora["train_peak_vs_full_weights"] < 1, lora
    speed = stages["speed"]
    assert speed["megatron"]["tokens_per_s"] > 0 and speed["transformers"]["tokens_per_s"] > 0
    assert speed["model_tflop_per_step"] > 0 and speed["megatron"]["mfu"] is None  # no peak FLOPs on a CPU


def _cuda_present() -> bool:
    import torch

    return torch.cuda.is_available()


@pytest.mark.skipif(_cuda_present(), reason="a GPU is present: the check runs there instead of refusing")
def test_gpu_check_without_a_gpu_says_to_use_cpu():
    proc = subprocess.run([sys.executable, "scripts/gpu_check.py"], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 2 and "--cpu" in proc.stderr


def test_gpu_check_counts_a_real_batch_by_the_plans_flops():
    """The GPU check's MFU (scripts/gpu_stages/speed.py) counts the FLOPs of a real batch (each
    row's real length, each distinct image's patches) with the plan's formula: on rows and images the plan's shape
    describes, the two agree exactly, MoE included (gpu_check's own copy counted all 128 experts
    of Qwen3-VL-30B-A3B a token: 8.1x the plan's figure here; Qwen2-VL and Qwen3-VL: the same
    figures before and after)."""
    import sys
    from types import SimpleNamespace

    import torch

    from yatt_mm.plan import MicroBatchShape, load_spec, train_flops

    sys.path.insert(0, str(ROOT / "scripts"))
    from gpu_stages.speed import train_flops as batch_flops

    spec = load_spec("Qwen/Qwen3-VL-30B-A3B-Instruct")
    # two rows of 1024 real tokens, each with its own image of 32 x 32 patches (256 merged tokens)
    grid = torch.tensor([[1, 32, 32], [1, 32, 32]])
    mb = SimpleNamespace(inputs=SimpleNamespace(attention_mask=torch.ones(2, 1024, dtype=torch.long),
                                                image_grid_thw=grid, image_sources=None))
    shape = MicroBatchShape(rows=2, seq=1024, scored=256, media_tokens=512, frame_tokens=256)
    assert batch_flops(spec, [mb]) == train_flops(spec, shape)
    # a shorter row counts its own length: less than the padded shape
    mb.inputs.attention_mask[1, 512:] = 0
    assert batch_flops(spec, [mb]) < train_flops(spec, shape)
