"""The tiny Qwen2-VL (`policy`, `judge`) and Qwen2.5-VL (`policy25`) models: their configs,
weights and processors. The shared parts (tokenizer, chat template, text sizes, the cache and
its stamp) are in models/tiny.py."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

from models.tiny import CHAT_TEMPLATE, FACTORY_VERSION, SPECIAL_TOKENS, build_tokenizer, save_model, text_config, \
    token_ids

# The Qwen2.5-VL kinds have their own version on top of FACTORY_VERSION, so changing them leaves
# the Qwen2-VL kinds' cache keys (and the warm starts hashed from them) alone.
QWEN25_VERSION = 1
QWEN25_KINDS = ("policy25",)  # Qwen2.5-VL architecture (window attention vision tower)
# kind -> cache version
KINDS = {"policy": f"{FACTORY_VERSION}", "judge": f"{FACTORY_VERSION}",
         "policy25": f"{FACTORY_VERSION}.q25-{QWEN25_VERSION}"}

# The tiny Qwen2.5-VL vision tower: RMSNorm, gated SiLU MLP with bias, window attention in
# every block except the last. Windows of 56 px = 2x2 merged tokens, so the small test images
# (up to 8x8 merged tokens) hold several windows. Vision head_dim 32 (vLLM's CPU encoder
# attention takes it); text as the Qwen2-VL policy.
QWEN25_VISION = dict(intermediate_size=128, window_size=56, fullatt_block_indexes=[1], tokens_per_second=2)


def make_tiny(out: Path, kind: str, spec) -> dict:
    """A tiny Qwen2-VL (or, for the Qwen2.5-VL kinds, a tiny Qwen2.5-VL: the same tokenizer,
    text sizes and processors with Qwen2.5-VL's vision tower, QWEN25_VISION) into `out`, sized
    by `spec` (models.tiny.TinySpec). Returns the stamp's fields."""
    import torch
    from transformers import (
        Qwen2_5_VLConfig,
        Qwen2_5_VLForConditionalGeneration,
        Qwen2_5_VLProcessor,
        Qwen2VLConfig,
        Qwen2VLForConditionalGeneration,
        Qwen2VLProcessor,
    )

    tokenizer = build_tokenizer()
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    vision = dict(depth=spec.vision_depth, num_heads=spec.vision_heads, patch_size=14, spatial_merge_size=2,
                  temporal_patch_size=2)
    if kind in QWEN25_KINDS:
        vision.update(hidden_size=spec.vision_embed_dim, out_hidden_size=spec.hidden_size, hidden_act="silu",
                      **QWEN25_VISION)
        config_cls, model_cls, processor_cls = Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2_5_VLProcessor
        stamp = {"qwen25_version": QWEN25_VERSION, **asdict(spec), "arch": "qwen2_5_vl", "vision": QWEN25_VISION}
    else:
        vision.update(embed_dim=spec.vision_embed_dim, hidden_size=spec.hidden_size, mlp_ratio=2)
        config_cls, model_cls, processor_cls = Qwen2VLConfig, Qwen2VLForConditionalGeneration, Qwen2VLProcessor
        stamp = asdict(spec)
    config = config_cls(text_config=text_config(spec, len(tokenizer), ids), vision_config=vision, **token_ids(ids))
    torch.manual_seed(spec.seed)  # the initial weights follow from the seed alone
    save_model(out, spec, model_cls(config), ids, perturb_norms=kind in QWEN25_KINDS)
    save_processor(out, spec, tokenizer, processor_cls)
    return stamp


def save_processor(out: Path, spec, tokenizer, processor_cls) -> None:
    from transformers import Qwen2VLImageProcessor, Qwen2VLVideoProcessor

    processor_cls(
        image_processor=Qwen2VLImageProcessor(min_pixels=spec.min_pixels, max_pixels=spec.max_pixels,
                                              patch_size=14, merge_size=2),
        tokenizer=tokenizer,
        video_processor=Qwen2VLVideoProcessor(min_pixels=spec.min_pixels, max_pixels=spec.video_max_pixels,
                                              patch_size=14, merge_size=2,
                                              cap_pixels_per_frame=True),  # qwen-vl-utils' per-frame cap
        chat_template=CHAT_TEMPLATE,
    ).save_pretrained(out)
