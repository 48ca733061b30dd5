"""Tiny random Qwen3.5 and Qwen3.5-MoE models, built offline (the recipe of
shared/recipes/newer_models/build_tiny_newer.py): the project's tiny byte-level BPE tokenizer and
chat template (models/tiny.py), a Qwen3VLProcessor with patch 16, merge 2 (one merged token =
32 x 32 pixels; transformers maps both model types to that processor), and ~1 M random parameters.

Qwen3.5 interleaves gated DeltaNet layers (linear attention, a recurrent state) with gated
full-attention layers. The sizes are chosen so that vLLM's CPU kernels take the model and so that
conversion mistakes cannot hide:
- 4 text layers, linear / full / linear / full: at PP 2 each stage holds both kinds, and the
  layer pattern must be read from `layer_types` (the released checkpoints' every-4th rule would
  put full attention at layer 3 only).
- full attention: head_dim 128 (2 heads x 128 = 256, unlike the hidden size 128), partial rotary
  0.25 (rotary dim 32) with interleaved M-RoPE sections [6, 5, 5] (they sum to rotary dim / 2).
- DeltaNet: 2 key heads / 4 value heads (grouped, as released: 16 / 32), head dims 64, conv
  kernel 4.
- MoE: 4 experts, top 2, `moe_intermediate_size` 192 and a shared expert of 160, both unlike the
  hidden size, so a transposed or swapped tensor fails loudly; `norm_topk_prob` (vLLM reads it);
  the router drawn wide (std 0.5) so tokens spread and the top-k is far from ties.
- norms and biases perturbed off their initial values (1 or 0; Qwen3.5's RMSNorm scales by
  1 + weight, initial 0), so a dropped or swapped one shows in parity.

Deterministic for a seed; cached by models.tiny.tiny_model_dir(kind) through the families
(models/qwen35/family.py registers `KINDS`, models/qwen35_moe/family.py `MOE_KINDS`; both point
their `make_tiny` hook at `make_tiny` here, which builds either kind).
transformers (so vLLM too) loads the tokenizer of these model types as Qwen3_5Tokenizer, whose
pre-tokenizer splits numbers into digits, as the released tokenizer does: the same vocabulary and
special tokens as the other tiny kinds, "42" is two tokens here.
vLLM runs these models in bf16 only on CPU ("CPU GDN attention requires BF16"); the weights are
saved in fp32 like every tiny model (the trainer's parity against transformers is in fp32).
"""

from __future__ import annotations

from pathlib import Path

from models.qwen3vl.tiny import save_processor
from models.tiny import FACTORY_VERSION

# Bump when anything below changes: it invalidates cached builds.
VERSION = 1
KINDS = {"qwen35": f"{FACTORY_VERSION}.q35-{VERSION}"}  # kind -> cache version (models/family.py)
MOE_KINDS = {"qwen35moe": f"{FACTORY_VERSION}.q35moe-{VERSION}"}

TEXT = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=2,
            num_key_value_heads=2, head_dim=128, max_position_embeddings=4096,
            layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
            linear_conv_kernel_dim=4, linear_key_head_dim=64, linear_value_head_dim=64,
            linear_num_key_heads=2, linear_num_value_heads=4,
            # partial rotary inside rope_parameters (transformers 5.19); sections sum to 0.25 * 128 / 2
            rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
                             "mrope_section": [6, 5, 5], "mrope_interleaved": True})
# Qwen3.5-MoE has no dense MLP (every layer is sparse): no intermediate_size
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=192, shared_expert_intermediate_size=160,
           norm_topk_prob=True, router_aux_loss_coef=0.001)
# no DeepStack in Qwen3.5's vision tower
VISION = dict(depth=2, hidden_size=64, num_heads=2, intermediate_size=128, patch_size=16, spatial_merge_size=2,
              temporal_patch_size=2, num_position_embeddings=256)  # a 16 x 16 learned grid
ROUTER_STD = 0.5

# kind -> (transformers config class, model class, model_type)
_CLASSES = {"qwen35": ("Qwen3_5Config", "Qwen3_5ForConditionalGeneration", "qwen3_5"),
            "qwen35moe": ("Qwen3_5MoeConfig", "Qwen3_5MoeForConditionalGeneration", "qwen3_5_moe")}


def text_sizes(kind: str) -> dict:
    """The language model's sizes of a tiny kind (no token ids, no vocabulary)."""
    if kind not in _CLASSES:
        raise ValueError(f"tiny kind {kind!r} is not a Qwen3.5 kind; known: {', '.join(_CLASSES)}")
    if kind == "qwen35moe":
        return {**{k: v for k, v in TEXT.items() if k != "intermediate_size"}, **MOE}
    return dict(TEXT)


def make_tiny(out_dir: str | Path, kind: str = "qwen35", spec=None,
              widths: tuple[dict, dict] | None = None) -> dict:
    """Build the tiny Qwen3.5 (`kind` "qwen35") or Qwen3.5-MoE ("qwen35moe") into `out_dir`
    (created): weights (fp32), config, tokenizer, processor. `spec` (models.tiny.TinySpec, as the
    family hook passes it) gives the seed and the output layer's init scale; the sizes are this
    module's, with `widths` (text, vision) overriding them (benchmarks). Returns the stamp's
    fields (models/tiny.py writes yatt_tiny.json)."""
    import torch
    import transformers as tf

    from models.hf_io import save_pretrained_on_any_rank
    from models.tiny import SPECIAL_TOKENS, build_tokenizer

    sizes, vision = text_sizes(kind), dict(VISION)
    if widths:
        sizes, vision = {**sizes, **widths[0]}, {**vision, **widths[1]}
    config_cls, model_cls, model_type = _CLASSES[kind]
    seed, lm_head_std = (spec.seed, spec.lm_head_std) if spec is not None else (0, 0.5)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer()
    ids = {t: tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    text = dict(sizes, vocab_size=len(tok), tie_word_embeddings=False, bos_token_id=ids["<|endoftext|>"],
                eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"])
    cfg = getattr(tf, config_cls)(
        text_config=text, vision_config=dict(vision, out_hidden_size=sizes["hidden_size"]),
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False)
    torch.manual_seed(seed)  # the weights follow from the seed alone
    model = getattr(tf, model_cls)(cfg).to(torch.float32)
    with torch.no_grad():
        model.lm_head.weight.normal_(0.0, lm_head_std)  # a larger init makes sampled outputs vary
        for name, p in model.named_parameters():
            # norms (also the DeltaNet's gated norm), biases (also dt_bias): off their initial values
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
            if name.endswith("pos_embed.weight"):  # a smooth-looking table would hide interpolation mistakes
                p.normal_(0.0, 0.5)
            if name.endswith("mlp.gate.weight"):  # the router: spread tokens, keep the top-k far from ties
                p.normal_(0.0, ROUTER_STD)
    model.generation_config.eos_token_id = ids["<|im_end|>"]
    model.generation_config.pad_token_id = ids["<|endoftext|>"]
    save_pretrained_on_any_rank(model, out)
    save_processor(out, tok)  # Qwen3-VL's processor, as the released Qwen3.5 checkpoints have
    return {"kind": kind, "seed": seed, "arch": model_type, "qwen35_version": VERSION, "text": sizes,
            "vision": vision}
