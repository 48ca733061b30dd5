"""Which architecture a model setting names: a checkpoint's config.json, the tiny models, or
the built-in table of published configs (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3-VL-MoE,
Qwen3.5-MoE; new model families join here)."""

from __future__ import annotations

from pathlib import Path

from yatt_mm.plan.constants import PlanError


# The published config.json numbers of the Qwen2-VL and Qwen2.5-VL Instruct checkpoints:
# (model_type, hidden_size, intermediate_size, num_hidden_layers, num_attention_heads,
#  num_key_value_heads, vocab_size, tie_word_embeddings, vision intermediate_size (Qwen2.5-VL)).
# The vision towers: Qwen2-VL depth 32, embed_dim 1280, mlp_ratio 4, num_heads 16; Qwen2.5-VL
# depth 32, hidden_size 1280, num_heads 16, window_size 112, full attention in blocks 7/15/23/31;
# both patch 14, spatial merge 2, temporal patch 2, out width = the LLM's hidden_size.
KNOWN_MODELS = {
    "Qwen/Qwen2-VL-2B-Instruct": ("qwen2_vl", 1536, 8960, 28, 12, 2, 151936, True, 0),
    "Qwen/Qwen2-VL-7B-Instruct": ("qwen2_vl", 3584, 18944, 28, 28, 4, 152064, False, 0),
    "Qwen/Qwen2-VL-72B-Instruct": ("qwen2_vl", 8192, 29568, 80, 64, 8, 152064, False, 0),
    "Qwen/Qwen2.5-VL-3B-Instruct": ("qwen2_5_vl", 2048, 11008, 36, 16, 2, 151936, True, 3420),
    "Qwen/Qwen2.5-VL-7B-Instruct": ("qwen2_5_vl", 3584, 18944, 28, 28, 4, 152064, False, 3420),
    "Qwen/Qwen2.5-VL-72B-Instruct": ("qwen2_5_vl", 8192, 29568, 80, 64, 8, 152064, False, 3456),
}

# The Qwen3-VL (dense) Instruct checkpoints' config.json numbers: (text hidden_size,
# intermediate_size, num_hidden_layers, num_attention_heads, num_key_value_heads,
# tie_word_embeddings; vision depth, hidden_size, intermediate_size, deepstack_visual_indexes).
# All: head_dim 128, vocab 151936, rope_theta 5e6 with interleaved mrope_section [24, 20, 20];
# vision 16 heads, patch 16, spatial merge 2, temporal patch 2, 2304 (48 x 48) learned
# positions, out_hidden_size = the text hidden_size. The text widths are Qwen3-1.7B / 4B / 8B /
# 32B's. Read from copies of the published config.json files in public repositories (and
# torchtitan's experiments/qwen3_vl configs for 2B and 8B), not from the hub itself (not
# reachable here). Their totals, 2.13 / 4.44 / 8.77 / 33.36 B (tests/cli/test_plan.py): 8.77 B
# is what a copy of the 8B model card states.
QWEN3VL_SMALL_VISION = (24, 1024, 4096, (5, 11, 17))
QWEN3VL_LARGE_VISION = (27, 1152, 4304, (8, 16, 24))
KNOWN_MODELS.update({
    "Qwen/Qwen3-VL-2B-Instruct": ("qwen3_vl", 2048, 6144, 28, 16, 8, True, QWEN3VL_SMALL_VISION),
    "Qwen/Qwen3-VL-4B-Instruct": ("qwen3_vl", 2560, 9728, 36, 32, 8, True, QWEN3VL_SMALL_VISION),
    "Qwen/Qwen3-VL-8B-Instruct": ("qwen3_vl", 4096, 12288, 36, 32, 8, False, QWEN3VL_LARGE_VISION),
    "Qwen/Qwen3-VL-32B-Instruct": ("qwen3_vl", 5120, 25600, 64, 64, 8, False, QWEN3VL_LARGE_VISION),
})


# Qwen3-VL-MoE (the 30B-A3B Instruct checkpoint): Qwen3-VL's text and vision fields plus the
# experts: (experts, top-k, moe_intermediate_size). The text widths are Qwen3-30B-A3B's: hidden
# 2048, 48 layers, 32 query / 4 KV heads of 128, every layer's MLP 128 experts of width 768, top 8
# (no shared expert, norm_topk_prob, router_aux_loss_coef 0.001), untied embeddings; the vision
# tower the larger Qwen3-VL one (out width 2048). `intermediate_size` 6144 is in the config but
# no layer uses it. From a copy of the published config.json in a public repository (and
# slime's Megatron arguments for the model), not the hub itself.
KNOWN_MODELS.update({
    "Qwen/Qwen3-VL-30B-A3B-Instruct": ("qwen3_vl_moe", 2048, 6144, 48, 32, 4, False, QWEN3VL_LARGE_VISION,
                                       (128, 8, 768)),
})


# Qwen3.5-35B-A3B (issue 30): a hybrid language model, gated DeltaNet and gated attention, 3 : 1.
# (text hidden_size, num_hidden_layers, full_attention_interval, attention heads, KV heads,
# head_dim, partial_rotary_factor, DeltaNet key heads, value heads, key / value head dim, conv
# kernel, experts, top-k, moe_intermediate_size, shared_expert_intermediate_size, vocab_size).
# The numbers are transformers 5.19's Qwen3_5MoeTextConfig defaults, which its docstring names
# "Qwen/Qwen3.5-35B-A3B" style: 40 layers of hidden 2048, full attention every 4th (10 layers of
# 16 query / 2 KV heads of 256, the first quarter of each head rotated), 30 DeltaNet layers of 16
# key / 32 value heads of 128, every MLP 256 experts of 512 (top 8) plus a shared expert of 512
# behind a sigmoid gate, vocabulary 248320, untied. Vision: Qwen3-VL's larger tower without
# DeepStack (depth 27, 1152 wide, 16 heads, 4304, patch 16, 2304 positions), out width 2048;
# interleaved mrope_section [11, 11, 10] (transformers' default), rope_theta 1e7. Not read from
# the published config.json (the hub is not reachable here): the out width and rope_theta are
# from memory of the release.
KNOWN_MODELS.update({
    "Qwen/Qwen3.5-35B-A3B": ("qwen3_5_moe", 2048, 40, 4, 16, 2, 256, 0.25, 16, 32, 128, 128, 4, 256, 8, 512, 512,
                             248320),
})


def known_hf_config(model_id: str) -> dict:
    """The table row of `model_id` as a config.json (transformers 4.x layout, as published;
    Qwen3.5: transformers 5.x's, rope_parameters)."""
    if KNOWN_MODELS[model_id][0] == "qwen3_5_moe":
        return _qwen35_moe_config(*KNOWN_MODELS[model_id][1:])
    if KNOWN_MODELS[model_id][0] == "qwen3_vl":
        return _qwen3vl_config(*KNOWN_MODELS[model_id][1:])
    if KNOWN_MODELS[model_id][0] == "qwen3_vl_moe":
        *dense, (experts, topk, moe_inter) = KNOWN_MODELS[model_id][1:]
        cfg = _qwen3vl_config(*dense)
        cfg["text_config"].update(num_experts=experts, num_experts_per_tok=topk, moe_intermediate_size=moe_inter,
                                  norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
                                  router_aux_loss_coef=0.001)
        return {**cfg, "model_type": "qwen3_vl_moe"}
    kind, hidden, inter, layers, heads, kv, vocab, tie, vision_inter = KNOWN_MODELS[model_id]
    vision = dict(depth=32, num_heads=16, patch_size=14, spatial_merge_size=2, temporal_patch_size=2, in_chans=3)
    if kind == "qwen2_vl":
        vision.update(embed_dim=1280, mlp_ratio=4, hidden_size=hidden)
    else:
        vision.update(hidden_size=1280, intermediate_size=vision_inter, out_hidden_size=hidden, window_size=112,
                      fullatt_block_indexes=[7, 15, 23, 31], tokens_per_second=2, hidden_act="silu")
    return dict(model_type=kind, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                num_attention_heads=heads, num_key_value_heads=kv, vocab_size=vocab, tie_word_embeddings=tie,
                rms_norm_eps=1e-6, rope_theta=1000000.0, rope_scaling={"type": "mrope", "mrope_section": [16, 24, 24]},
                image_token_id=151655, video_token_id=151656, vision_start_token_id=151652, vision_config=vision)


def _qwen3vl_config(hidden: int, inter: int, layers: int, heads: int, kv: int, tie: bool, vision: tuple) -> dict:
    depth, width, vision_inter, deepstack = vision
    text = dict(hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers, num_attention_heads=heads,
                num_key_value_heads=kv, head_dim=128, vocab_size=151936, tie_word_embeddings=tie, rms_norm_eps=1e-6,
                hidden_act="silu", attention_bias=False, rope_theta=5000000,
                rope_scaling={"rope_type": "default", "mrope_interleaved": True, "mrope_section": [24, 20, 20]})
    return dict(model_type="qwen3_vl", tie_word_embeddings=tie, image_token_id=151655, video_token_id=151656,
                vision_start_token_id=151652, vision_end_token_id=151653, text_config=text,
                vision_config=dict(depth=depth, hidden_size=width, intermediate_size=vision_inter, num_heads=16,
                                   hidden_act="gelu_pytorch_tanh", patch_size=16, spatial_merge_size=2,
                                   temporal_patch_size=2, in_channels=3, num_position_embeddings=2304,
                                   out_hidden_size=hidden, deepstack_visual_indexes=list(deepstack)))


def _qwen35_moe_config(hidden: int, layers: int, interval: int, heads: int, kv: int, head_dim: int, rotary: float,
                       key_heads: int, value_heads: int, key_dim: int, value_dim: int, kernel: int, experts: int,
                       topk: int, moe_inter: int, shared: int, vocab: int) -> dict:
    types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(layers)]
    text = dict(hidden_size=hidden, num_hidden_layers=layers, layer_types=types, num_attention_heads=heads,
                num_key_value_heads=kv, head_dim=head_dim, vocab_size=vocab, tie_word_embeddings=False,
                rms_norm_eps=1e-6, hidden_act="silu", attention_bias=False, attn_output_gate=True,
                linear_num_key_heads=key_heads, linear_num_value_heads=value_heads, linear_key_head_dim=key_dim,
                linear_value_head_dim=value_dim, linear_conv_kernel_dim=kernel, num_experts=experts,
                num_experts_per_tok=topk, moe_intermediate_size=moe_inter, shared_expert_intermediate_size=shared,
                router_aux_loss_coef=0.001, max_position_embeddings=262144,
                rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": rotary,
                                 "mrope_section": [11, 11, 10], "mrope_interleaved": True})
    return dict(model_type="qwen3_5_moe", tie_word_embeddings=False, image_token_id=248056, video_token_id=248057,
                vision_start_token_id=248053, vision_end_token_id=248054, text_config=text,
                vision_config=dict(depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16,
                                   hidden_act="gelu_pytorch_tanh", patch_size=16, spatial_merge_size=2,
                                   temporal_patch_size=2, in_channels=3, num_position_embeddings=2304,
                                   out_hidden_size=hidden))


def spec_from_hf_config(config: dict):
    """A config.json mapping read by its model family's parser (the trainer's), so the table is
    read exactly as a checkpoint on disk would be."""
    from models.family import family_for_model_type

    return family_for_model_type(config.get("model_type"), "config.json").read_spec(config, "config.json")


def load_spec(model: str):
    """The architecture (its model family's spec, models/family.py) of a model setting: see resolve_model."""
    return resolve_model(model)[0]


def resolve_model(model: str):
    """(architecture, where it came from) of a model setting: a directory with config.json,
    tiny:KIND or warmstart:KIND (the tiny model's architecture; built offline, cached), or a
    known HF id or a path whose last part is a known model's name (/models/Qwen2-VL-7B-Instruct)."""
    from models.family import read_spec

    try:
        if model.startswith(("tiny:", "warmstart:")):
            from models.tiny import tiny_model_dir

            return read_spec(tiny_model_dir(model.split(":", 1)[1])), "the tiny model's config.json"
        if (Path(model) / "config.json").is_file():
            return read_spec(model), "its config.json"
    except ValueError as e:  # a model type no family reads, an unknown tiny kind
        raise PlanError(f"model {model!r}: {e}") from e
    name = model.rstrip("/").split("/")[-1]
    for model_id in KNOWN_MODELS:
        if model == model_id or name == model_id.split("/")[-1]:
            return spec_from_hf_config(known_hf_config(model_id)), f"built-in table: {model_id}"
    raise PlanError(f"model {model!r}: no config.json there and not a known model; give its HF directory, or a "
                    f"known id or a directory named like one: {', '.join(KNOWN_MODELS)}")
