"""A tiny random Qwen3-VL, built offline (the recipe of shared/recipes/newer_models/build_tiny_newer.py):
the project's tiny byte-level BPE tokenizer and chat template (models/tiny.py), a Qwen3VLProcessor
with patch 16, merge 2 (one merged token = 32 x 32 pixels), and ~1 M random parameters.

Sizes are chosen so that vLLM's CPU kernels take the model (text head_dim 64) and so that
conversion mistakes cannot hide: 4 text layers and two DeepStack features (vision blocks 0 and 1
feed text layers 0 and 1, both on the first stage at PP 2), norms and biases perturbed off their
initial 1 and 0, an intermediate size unlike the hidden size. Deterministic for a seed; cached
by models.tiny.tiny_model_dir("qwen3vl") through the family (models/qwen3vl/family.py).
"""

from __future__ import annotations

from pathlib import Path

from models.tiny import FACTORY_VERSION

# Bump when anything below changes: it invalidates cached builds.
VERSION = 2  # 2: the image processor normalises like the released checkpoints (mean = std = 0.5)
KINDS = {"qwen3vl": f"{FACTORY_VERSION}.q3-{VERSION}"}  # kind -> cache version (models/family.py)

TEXT = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=2,
            num_key_value_heads=2, head_dim=64, max_position_embeddings=4096,
            # interleaved M-RoPE: the three sections sum to head_dim / 2
            rope_parameters={"rope_type": "default", "rope_theta": 5000000.0, "mrope_section": [12, 10, 10],
                             "mrope_interleaved": True})
VISION = dict(depth=2, hidden_size=64, num_heads=2, intermediate_size=128, patch_size=16, spatial_merge_size=2,
              temporal_patch_size=2, num_position_embeddings=256,  # a 16 x 16 learned grid
              deepstack_visual_indexes=[0, 1])
NORM = [0.5, 0.5, 0.5]  # the processors' image_mean and image_std
MERGED_PX = 32 * 32  # pixels of one merged token (patch 16, merge 2)
MIN_PIXELS, MAX_PIXELS = MERGED_PX * 4, MERGED_PX * 64


# Qwen3-VL-8B's widths with 2 text layers and 2 vision blocks (`make_tiny(DIR, widths=REAL_8B_WIDTHS)`):
# a check that head, group and merger layouts hold at real sizes (GQA 32/8, head_dim 128).
REAL_8B_WIDTHS = (
    dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=2, num_attention_heads=32,
         num_key_value_heads=8, head_dim=128,
         rope_parameters={"rope_type": "default", "rope_theta": 5000000.0, "mrope_section": [24, 20, 20],
                          "mrope_interleaved": True}),
    dict(depth=2, hidden_size=1152, num_heads=16, intermediate_size=4304, num_position_embeddings=2304,
         deepstack_visual_indexes=[0, 1]),
)


def make_tiny(out_dir: str | Path, kind: str = "qwen3vl", spec=None,
              widths: tuple[dict, dict] | None = None) -> dict:
    """Build the tiny Qwen3-VL into `out_dir` (created): weights, config, tokenizer, processor.
    `spec` (models.tiny.TinySpec, as the family hook passes it) gives the seed and the output
    layer's init scale; the sizes are this module's, with `widths` (text, vision) overriding them. Returns the stamp's fields (models/tiny.py
    writes yatt_tiny.json when it builds through the family)."""
    import torch
    import transformers as tf

    from models.hf_io import save_pretrained_on_any_rank
    from models.tiny import SPECIAL_TOKENS, build_tokenizer

    seed, lm_head_std = (spec.seed, spec.lm_head_std) if spec is not None else (0, 0.5)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer()
    ids = {t: tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    text_sizes, vision_sizes = ({**TEXT, **widths[0]}, {**VISION, **widths[1]}) if widths else (TEXT, VISION)
    text = dict(text_sizes, vocab_size=len(tok), tie_word_embeddings=False, bos_token_id=ids["<|endoftext|>"],
                eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"])
    cfg = tf.Qwen3VLConfig(text_config=text, vision_config=dict(vision_sizes, out_hidden_size=text_sizes["hidden_size"]),
                           image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
                           vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
                           tie_word_embeddings=False)
    torch.manual_seed(seed)  # the weights follow from the seed alone
    model = tf.Qwen3VLForConditionalGeneration(cfg).to(torch.float32)
    with torch.no_grad():
        model.lm_head.weight.normal_(0.0, lm_head_std)  # a larger init makes sampled outputs vary
        for name, p in model.named_parameters():  # off 1 and 0, so a dropped or swapped norm/bias shows in parity
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
            if name.endswith("pos_embed.weight"):  # a smooth-looking table would hide interpolation mistakes
                p.normal_(0.0, 0.5)
    model.generation_config.eos_token_id = ids["<|im_end|>"]
    model.generation_config.pad_token_id = ids["<|endoftext|>"]
    save_pretrained_on_any_rank(model, out)
    save_processor(out, tok)
    return {"kind": kind, "seed": seed, "arch": "qwen3_vl", "qwen3vl_version": VERSION, "text": text_sizes,
            "vision": vision_sizes}


def save_processor(out, tok) -> None:
    """The tiny Qwen3-VL-style processor (also Qwen3-VL-MoE's and Qwen3.5's): patch 16, merge 2,
    temporal patch 2, the pixel bounds above, the project's tokenizer and chat template."""
    import transformers as tf

    from models.tiny import CHAT_TEMPLATE

    size = {"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS}
    tf.Qwen3VLProcessor(
        # mean = std = 0.5 for images, as the released Qwen3-VL checkpoints and the video processor
        # have (Qwen2VLImageProcessor's defaults are CLIP's): vLLM 0.32 normalises videos with the
        # image processor's values (yatt_mm/engines/vllm_fixes.py)
        image_processor=tf.Qwen2VLImageProcessor(size=size, patch_size=16, merge_size=2, temporal_patch_size=2,
                                                 image_mean=NORM, image_std=NORM),
        tokenizer=tok,
        video_processor=tf.Qwen3VLVideoProcessor(size=size, patch_size=16, merge_size=2, temporal_patch_size=2,
                                                 image_mean=NORM, image_std=NORM,
                                                 fps=2, cap_pixels_per_frame=True),  # qwen-vl-utils' per-frame cap
        chat_template=CHAT_TEMPLATE,
    ).save_pretrained(out)
