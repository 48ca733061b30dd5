"""The Qwen3-VL (dense) family (models/family.py). The hooks import their modules when called,
so registering costs nothing."""

from __future__ import annotations

from models.family import ModelFamily, lazy, patch_merge_factor, register
from models.qwen3vl.tiny import KINDS

QWEN3VL = register(ModelFamily(
    name="Qwen3-VL",
    model_types=("qwen3_vl",),
    read_spec=lazy("models.qwen3vl.config", "Qwen3VLSpec.from_hf_config"),
    check_layout=lazy("models.qwen3vl.config", "check_layout"),
    build_model=lazy("models.qwen3vl.model", "Qwen3VLModel"),
    load_hf_into=lazy("models.qwen3vl.convert", "load_hf_into"),
    export_hf_buckets=lazy("models.qwen3vl.convert", "export_hf_buckets"),
    position_ids=lazy("models.qwen3vl.rope_index", "position_ids"),
    media_factor=patch_merge_factor,  # 16 x 2 = 32
    tiny_kinds=KINDS,
    make_tiny=lazy("models.qwen3vl.tiny", "make_tiny"),
    lora_to_hf=lazy("models.qwen2vl.convert", "lora_to_hf"),
    parity_module="models.qwen3vl.parity",
    # the processor writes each temporal patch's timestamp (from the video's fps) into the prompt
    timed_video_types=("qwen3_vl",),
))
