"""The Qwen2-VL / Qwen2.5-VL family (models/family.py): one language model, two vision towers.
The hooks import their modules when called, so registering costs nothing."""

from __future__ import annotations

from models.family import ModelFamily, lazy, patch_merge_factor, register
from models.qwen2vl.tiny import KINDS

QWEN2VL = register(ModelFamily(
    name="Qwen2-VL / Qwen2.5-VL",
    model_types=("qwen2_vl", "qwen2_5_vl"),
    read_spec=lazy("models.qwen2vl.config", "Qwen2VLSpec.from_hf_config"),
    check_layout=lazy("models.qwen2vl.config", "check_layout"),
    build_model=lazy("models.qwen2vl.model", "Qwen2VLModel"),
    load_hf_into=lazy("models.qwen2vl.convert", "load_hf_into"),
    export_hf_buckets=lazy("models.qwen2vl.convert", "export_hf_buckets"),
    position_ids=lazy("models.qwen2vl.rope_index", "position_ids"),
    media_factor=patch_merge_factor,  # 14 x 2 = 28
    tiny_kinds=KINDS,
    make_tiny=lazy("models.qwen2vl.tiny", "make_tiny"),
    lora_to_hf=lazy("models.qwen2vl.convert", "lora_to_hf"),
    parity_module="models.qwen2vl.parity",
    # Qwen2.5-VL's temporal positions are seconds x tokens_per_second
    timed_video_types=("qwen2_5_vl",),
))
