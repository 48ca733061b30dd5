"""How a video's frames are described to a processor, the same on both sides of RL.

Videos reach yatt-mm as plain uint8 frame arrays [T, H, W, 3], already sampled. For model types
whose video positions or prompt follow time (`ModelFamily.timed_video_types`: Qwen2.5-VL's
temporal M-RoPE spacing, Qwen3-VL's "<0.3 seconds>" text before each temporal patch) the frame
rate matters, so vLLM (the rollout engine) and the HF processor (the trainer's samples, SFT)
are both told the same thing: every frame as given, at `RAW_VIDEO_FPS`, no frame sampling.

Without it the two disagree: Qwen3-VL's video processor samples frames by default (fps 2 out of
the 24 it assumes for a plain array: 8 frames became 4) while vLLM, given metadata, keeps them
all; the trainer then scored vLLM's tokens against another video and other timestamps.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# What transformers' processors assume for a plain frame array (`VideoMetadata` without fps).
RAW_VIDEO_FPS = 24.0


def has_timed_videos(model_dir: str | Path) -> bool:
    """Whether `model_dir` is of a model type whose videos need their timing. A judge may be any
    model vLLM runs, so an unknown model type (or no config.json) is no error here: False."""
    from models.family import families

    config = Path(model_dir) / "config.json"
    model_type = json.loads(config.read_text()).get("model_type") if config.is_file() else None
    return any(model_type in family.timed_video_types for family in families())


# The tokens that stand for media in a prompt. Sampled into a response (an untrained policy does,
# and a policy early in RL now and then) they cannot be trained on (the trainer's M-RoPE positions
# and vision features would look for a medium behind them) nor scored by a distillation teacher
# (vLLM would look for a medium for each), and no answer needs them, so engines keep them out
# (`no_media_tokens`, EngineConfig.media_tokens_in_responses).
PLACEHOLDER_IDS = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")


def no_media_tokens(model_dir: str | Path) -> dict[int, float]:
    """vLLM's logit_bias that keeps `model_dir`'s media placeholder tokens out of sampled
    responses ({} when its config names none). vLLM's logprobs are the raw logits' (before any
    bias), so the sampled tokens' logprobs still match the trainer's."""
    config = Path(model_dir) / "config.json"
    data = json.loads(config.read_text()) if config.is_file() else {}
    return {int(data[key]): -100.0 for key in PLACEHOLDER_IDS if isinstance(data.get(key), int)}


def frame_metadata(video) -> dict[str, Any]:
    """A frame array's metadata: every frame, in order, at RAW_VIDEO_FPS."""
    n = int(len(video))
    return {"fps": RAW_VIDEO_FPS, "total_num_frames": n, "frames_indices": list(range(n)),
            "duration": n / RAW_VIDEO_FPS}


def vllm_video(video, timed: bool):
    """A video as vLLM's multi_modal_data takes it: with its metadata (frames as given) when the
    model is timed, else the plain array."""
    return (video, {**frame_metadata(video), "do_sample_frames": False}) if timed else video


def processor_media(images=(), videos=(), timed: bool = False) -> dict[str, Any]:
    """Keyword arguments of an HF processor call for these media, videos described as vLLM gets
    them (`vllm_video`)."""
    media: dict[str, Any] = {}
    if len(images):
        media["images"] = list(images)
    if len(videos):
        media["videos"] = list(videos)
        if timed:
            media.update(video_metadata=[frame_metadata(v) for v in videos], do_sample_frames=False)
    return media


def media_for_model(media, model_dir: str | Path, setting: str = "data.media.factor"):
    """`media` (dataio's MediaConfig) with the model's side multiple (its family's `media_factor`:
    patch size x spatial merge) where its factor is 0; ValueError naming `setting` where it is
    set to another value (the processor would resize every image and frame a second time)."""
    import dataclasses

    from models.family import family_for_dir, read_spec

    family, spec = family_for_dir(model_dir), read_spec(model_dir)
    factor = family.media_factor(spec)
    if media.factor not in (0, factor):
        raise ValueError(f"{setting}={media.factor}: {family.name} takes media in multiples of {factor} px (patch "
                         f"{spec.patch_size} x merge {spec.spatial_merge_size}); set {setting}={factor}, or 0 for "
                         "the model's")
    media = dataclasses.replace(media, factor=factor)
    try:
        media.validate()
    except ValueError as e:
        raise ValueError(f"{setting.rsplit('.', 1)[0]}: {e}") from None
    return media
