"""The Qwen3-VL-MoE family (models/family.py): Qwen3-VL with mixture-of-experts language MLPs and
expert parallelism (`check_layout` and `build_model` take `ep`). The hooks import their modules
when called, so registering costs nothing. Position ids, media sizing and video timing are
Qwen3-VL's."""

from __future__ import annotations

from models.family import ModelFamily, lazy, patch_merge_factor, register
from models.qwen3vl_moe.tiny import KINDS

QWEN3VL_MOE = register(ModelFamily(
    name="Qwen3-VL-MoE",
    model_types=("qwen3_vl_moe",),
    read_spec=lazy("models.qwen3vl_moe.config", "Qwen3VLMoeSpec.from_hf_config"),
    check_layout=lazy("models.qwen3vl_moe.config", "check_layout"),
    build_model=lazy("models.qwen3vl_moe.model", "Qwen3VLMoeModel"),
    load_hf_into=lazy("models.qwen3vl_moe.convert", "load_hf_into"),
    export_hf_buckets=lazy("models.qwen3vl_moe.convert", "export_hf_buckets"),
    position_ids=lazy("models.qwen3vl.rope_index", "position_ids"),
    media_factor=patch_merge_factor,  # 16 x 2 = 32
    tiny_kinds=KINDS,
    make_tiny=lazy("models.qwen3vl_moe.tiny", "make_tiny"),
    parity_module="models.qwen3vl_moe.parity",
    timed_video_types=("qwen3_vl_moe",),
    # the attention's projections, as Qwen3-VL lays them out, and the routed experts
    lora_to_hf=lazy("models.qwen3vl_moe.convert", "lora_to_hf"),
    lora_targets=("q_proj", "k_proj", "v_proj", "o_proj", "experts"),
))
