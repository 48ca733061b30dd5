"""A tiny random Qwen3-VL-MoE, built offline: the tiny Qwen3-VL (models/qwen3vl/tiny.py: tokenizer,
processor, text widths, vision tower, two DeepStack features) with every language MLP a mixture
of 4 experts, top-2, renormalised top-k probabilities (`norm_topk_prob`, which vLLM reads).

`moe_intermediate_size` 192 is unlike the hidden size 128 (and 2 x 192 unlike 128), so a
transposed or swapped expert tensor fails loudly in conversion and in vLLM. The router weights
are drawn larger than transformers' init (std 0.5) so that tokens spread over the experts and
the top-k choice is far from ties (a tie could pick different experts in two implementations).
transformers 5.19 saves the fused experts in its in-memory layout; they are rewritten in the
released layout ([E, H, 2I] / [E, I, H]), which vLLM requires and transformers reads alike.
"""

from __future__ import annotations

from pathlib import Path

from models.qwen3vl import tiny as dense
from models.tiny import FACTORY_VERSION

VERSION = 1
KINDS = {"qwen3vlmoe": f"{FACTORY_VERSION}.q3moe-{dense.VERSION}.{VERSION}"}  # kind -> cache version

MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=192, norm_topk_prob=True,
           decoder_sparse_step=1, mlp_only_layers=[], router_aux_loss_coef=0.001)
ROUTER_STD = 0.5


def make_tiny(out_dir: str | Path, kind: str = "qwen3vlmoe", spec=None) -> dict:
    """Build the tiny Qwen3-VL-MoE into `out_dir` (created). `spec` (models.tiny.TinySpec) gives
    the seed and the output layer's init scale. Returns the stamp's fields."""
    import torch
    import transformers as tf

    from models.hf_io import save_pretrained_on_any_rank
    from models.tiny import SPECIAL_TOKENS, build_tokenizer

    seed, lm_head_std = (spec.seed, spec.lm_head_std) if spec is not None else (0, 0.5)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer()
    ids = {t: tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    text = dict(dense.TEXT, **MOE, vocab_size=len(tok), tie_word_embeddings=False, bos_token_id=ids["<|endoftext|>"],
                eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"])
    cfg = tf.Qwen3VLMoeConfig(text_config=text, vision_config=dict(dense.VISION, out_hidden_size=text["hidden_size"]),
                              image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
                              vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
                              tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = tf.Qwen3VLMoeForConditionalGeneration(cfg).to(torch.float32)
    with torch.no_grad():
        model.lm_head.weight.normal_(0.0, lm_head_std)
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
            if name.endswith("pos_embed.weight"):
                p.normal_(0.0, 0.5)
            if name.endswith("mlp.gate.weight"):  # the router: spread tokens, keep the top-k far from ties
                p.normal_(0.0, ROUTER_STD)
    model.generation_config.eos_token_id = ids["<|im_end|>"]
    model.generation_config.pad_token_id = ids["<|endoftext|>"]
    save_pretrained_on_any_rank(model, out)
    _write_released_expert_layout(out)
    dense.save_processor(out, tok)
    return {"kind": kind, "seed": seed, "arch": "qwen3_vl_moe", "qwen3vlmoe_version": VERSION,
            "text": {k: v for k, v in text.items() if k not in ("vocab_size",)}, "vision": dense.VISION}


def _write_released_expert_layout(out: Path) -> None:
    """transformers 5.19 wrote gate_up_proj [E, 2I, H] and down_proj [E, H, I]: transpose both to
    the released [E, H, 2I] / [E, I, H]."""
    from safetensors.torch import load_file, save_file

    for path in sorted(out.glob("*.safetensors")):
        state = load_file(str(path))
        for key in state:
            if key.endswith("mlp.experts.gate_up_proj") or key.endswith("mlp.experts.down_proj"):
                state[key] = state[key].transpose(1, 2).contiguous()
        save_file(state, str(path), metadata={"format": "pt"})
