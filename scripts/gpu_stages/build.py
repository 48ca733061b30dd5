"""build: an HF Qwen2-VL directory at the real 2B model's widths (or the small ones for --cpu)."""

from __future__ import annotations

from pathlib import Path

import torch


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
