"""The Qwen3.5-MoE family (models/family.py): Qwen3.5 (models/qwen35/) with mixture-of-experts
language MLPs, a gated shared expert in each, and expert parallelism (`check_layout` and
`build_model` take `ep`). Position ids, media sizing, video timing and the tiny builder are
Qwen3.5's.
The hooks import their modules when called, so registering costs nothing."""

from __future__ import annotations

from models.family import ModelFamily, lazy, patch_merge_factor, register
from models.qwen35.family import LazyKinds

QWEN35_MOE = register(ModelFamily(
    name="Qwen3.5-MoE",
    model_types=("qwen3_5_moe",),
    read_spec=lazy("models.qwen35_moe.config", "Qwen35MoeSpec.from_hf_config"),
    check_layout=lazy("models.qwen35_moe.config", "check_layout"),
    build_model=lazy("models.qwen35_moe.model", "Qwen35MoeModel"),
    load_hf_into=lazy("models.qwen35_moe.convert", "load_hf_into"),
    export_hf_buckets=lazy("models.qwen35_moe.convert", "export_hf_buckets"),
    position_ids=lazy("models.qwen3vl.rope_index", "position_ids"),
    media_factor=patch_merge_factor,  # 16 x 2 = 32
    tiny_kinds=LazyKinds("models.qwen35.tiny", "MOE_KINDS"),
    make_tiny=lazy("models.qwen35.tiny", "make_tiny"),
    parity_module="models.qwen35_moe.parity",
    timed_video_types=("qwen3_5_moe",),
    check_context_parallel=lazy("models.qwen35.config", "check_context_parallel"),
    # the full-attention and gated DeltaNet layers' projections, the shared expert's (gate/up/down_proj)
    # and the routed experts
    lora_to_hf=lazy("models.qwen35_moe.convert", "lora_to_hf"),
    lora_targets=("q_proj", "k_proj", "v_proj", "o_proj", "in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a",
                  "out_proj", "gate_proj", "up_proj", "down_proj", "experts"),
))
