"""The tiny Qwen3-VL end to end on video: `yatt-mm rl` (2 ranks, vLLM sampling it) and
`yatt-mm sft`, then their exports in transformers, Megatron and vLLM. The RL run is the issue's
reproduction: its trainer/vLLM logprob gap was 2.2 per token on video (the fp32 guard stopped
it) before the trainer's samples got the video metadata vLLM gets and the tiny model's image
processor normalised like its video processor (yatt_mm/engines/media.py, vllm_fixes.py)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from dataio.synth import write_shards
from subproc import run_json
from test_rl import _steps, _tiny_rl

ROOT = Path(__file__).resolve().parents[2]


def _export_matches_transformers_megatron_and_vllm(hf_dir: Path, trained_from: Path) -> None:
    """The exported directory: other weights than the start, Megatron (loaded from it) gives
    transformers' logits on text, images and a video, and vLLM gives transformers' logprobs
    on an image and a video, with the settings yatt-mm's engine uses."""
    from safetensors.torch import load_file

    final, start = load_file(hf_dir / "model.safetensors"), load_file(trained_from / "model.safetensors")
    assert final.keys() == start.keys() and any(not final[k].equal(start[k]) for k in start)
    parity = run_json([sys.executable, "-m", "models.qwen3vl.parity", str(hf_dir)], timeout=300)
    print("export: Megatron vs transformers:", parity)
    assert parity["max_abs_diff"].pop("export_equal") == 1.0, parity  # exported again bit for bit
    assert all(d <= 1e-5 for d in parity["max_abs_diff"].values()), parity  # measured 0.0
    engine = run_json([sys.executable, str(ROOT / "scripts/repro_vllm_qwen3vl_video.py"), str(hf_dir),
                       "--as-yatt-mm"], timeout=300)
    print("export: vLLM vs transformers:", engine)
    assert engine["fix_kwargs"] == {}  # its processors normalise alike: vLLM's defaults
    # measured 1.4e-6 to 6.2e-6 (image), 2.9e-6 to 3.8e-6 (video)
    assert engine["as_yatt_mm_image_gap"] < 1e-4 and engine["as_yatt_mm_video_gap"] < 1e-4, engine


@pytest.mark.slow  # ~2 min on 2 shared cores: a 2-rank launch (the export is checked after SFT below)
def test_rl_on_video_keeps_the_trainer_and_vllm_together(tmp_path):
    write_shards(str(tmp_path / "train"), images=0, videos=8, samples_per_shard=4, seed=5)
    run_dir = tmp_path / "run"
    # the untrained model never answers right, so every group's rewards are equal: dynamic
    # sampling off and an entropy bonus give every step a real gradient through the videos
    cmd = _tiny_rl(run_dir, tmp_path / "train", "run.steps=2", "eval.every=0", "reward.judges=[]",
                   "dynamic_sampling.enabled=false", "algorithm.entropy_coef=0.01", "run.save_final=false",
                   policy="tiny:qwen3vl")
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=900, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-8000:]
    assert "step 2/2" in proc.stdout
    assert "factor: 32" in (run_dir / "config.yaml").read_text()  # data.media.factor 0 -> the model's 16 x 2
    steps = _steps(run_dir)
    assert [r["step"] for r in steps] == [1, 2]
    probe = [r["sync/probe_logprob_diff"] for r in steps]  # a video prompt: the first trained
    gap = [r["train/logprob_diff_vs_rollout"] for r in steps]
    print("Qwen3-VL video: sync probe |trainer - vLLM| per step:", probe, "trainer vs rollout gap:", gap)
    for r in steps:
        assert r["train/grad_norm"] > 0
        assert r["train/weights_checksum_after"] != r["train/weights_checksum_before"], r["step"]
        # mean |diff| per token: measured probe 4e-7 to 2.2e-6, gap 1.7e-6 to 2.0e-6 (2.2 before
        # the fix); run.max_logprob_diff (the guard) would stop the run far above these
        assert r["sync/probe_logprob_diff"] < 2e-5 and r["train/logprob_diff_vs_rollout"] < 2e-5, r
    assert steps[1]["train/weights_checksum_before"] == steps[0]["train/weights_checksum_after"]


@pytest.mark.slow  # ~2.5 min: a 2-rank SFT launch, then the export's checks
def test_sft_on_images_and_videos_exports_a_model_transformers_and_vllm_agree_on(tmp_path):
    from models.tiny import tiny_model_dir

    write_shards(str(tmp_path / "data"), images=24, videos=24, samples_per_shard=8, seed=7)
    out = tmp_path / "hf"
    result = run_json([sys.executable, "-m", "yatt_mm.cli", "sft", "--config", "configs/tiny_sft.yaml", "--nproc", "2",
                       "model=tiny:qwen3vl", f"data.shards=[{tmp_path / 'data'}]", "tasks=[]", "steps=6",
                       "batch_size=4", "micro_batch_size=2", "eval.every=0", f"run_dir={tmp_path / 'run'}",
                       f"output_dir={out}"], timeout=900)
    print("SFT on tiny Qwen3-VL:", {k: result[k] for k in ("first_loss", "last_loss")})
    assert result["last_loss"] < result["first_loss"], result  # measured 15.8 -> 5.4
    lines = [json.loads(ln) for ln in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert sum("train/loss" in ln for ln in lines) == 6
    _export_matches_transformers_megatron_and_vllm(out, tiny_model_dir("qwen3vl"))
