"""The Qwen3.5 (dense) family (models/family.py): Qwen3-VL's vision tower, position ids, media
sizing and timed videos in front of a hybrid language model of gated DeltaNet and gated
full-attention layers (models/qwen35/config.py). The hooks import their modules when called,
so registering costs nothing; the tiny kinds too (models/qwen35/tiny.py)."""

from __future__ import annotations

import importlib
from collections.abc import Mapping

from models.family import ModelFamily, lazy, patch_merge_factor, register


class LazyKinds(Mapping):
    """A tiny builder module's kind -> cache version mapping (`module`.`name`), imported on
    first use: registering the family does not import the builder."""

    def __init__(self, module: str, name: str):
        self._module, self._name = module, name

    def _kinds(self) -> Mapping[str, str]:
        return getattr(importlib.import_module(self._module), self._name)

    def __getitem__(self, kind: str) -> str:
        return self._kinds()[kind]

    def __iter__(self):
        return iter(self._kinds())

    def __len__(self) -> int:
        return len(self._kinds())


QWEN35 = register(ModelFamily(
    name="Qwen3.5",
    model_types=("qwen3_5",),
    read_spec=lazy("models.qwen35.config", "Qwen35Spec.from_hf_config"),
    check_layout=lazy("models.qwen35.config", "check_layout"),
    build_model=lazy("models.qwen35.model", "Qwen35Model"),
    load_hf_into=lazy("models.qwen35.convert", "load_hf_into"),
    export_hf_buckets=lazy("models.qwen35.convert", "export_hf_buckets"),
    position_ids=lazy("models.qwen3vl.rope_index", "position_ids"),
    media_factor=patch_merge_factor,  # 16 x 2 = 32
    tiny_kinds=LazyKinds("models.qwen35.tiny", "KINDS"),
    make_tiny=lazy("models.qwen35.tiny", "make_tiny"),
    parity_module="models.qwen35.parity",
    # the processor writes each temporal patch's timestamp (from the video's fps) into the prompt
    timed_video_types=("qwen3_5",),
    check_context_parallel=lazy("models.qwen35.config", "check_context_parallel"),
    # the full-attention layers' projections, the gated DeltaNet layers' and every layer's MLP
    lora_to_hf=lazy("models.qwen35.convert", "lora_to_hf"),
    lora_targets=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
                  "in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"),
))
