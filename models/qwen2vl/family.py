"""The Qwen2-VL / Qwen2.5-VL family (models/family.py): one language model, two vision towers.
The hooks import their modules when called, so registering costs nothing."""

from __future__ import annotations

from pathlib import Path

from models.family import ModelFamily, register
from models.qwen2vl.tiny import KINDS


def read_spec(config: dict, where: str = "config.json"):
    from models.qwen2vl.config import Qwen2VLSpec

    return Qwen2VLSpec.from_hf_config(config, where)


def check_layout(spec, tp: int, pp: int, prefix: str = "", layers=()) -> None:
    from models.qwen2vl.config import check_layout

    check_layout(spec, tp, pp, prefix, layers)


def build_model(spec, dtype, tp: int = 1, recompute: str = "none", pp: int = 1, layers=()):
    from models.qwen2vl.model import Qwen2VLModel

    return Qwen2VLModel(spec, dtype, tp, recompute, pp, layers)


def load_hf_into(module, hf_dir: str | Path, tp_rank: int = 0, tp_size: int = 1) -> None:
    from models.qwen2vl.convert import load_hf_into

    load_hf_into(module, hf_dir, tp_rank, tp_size)


def export_hf_buckets(module, tp_group=None, dtype=None, bucket_bytes: int | None = None):
    from models.qwen2vl.convert import export_hf_buckets

    return export_hf_buckets(module, tp_group, dtype, bucket_bytes)


def position_ids(spec, batch: dict):
    from models.qwen2vl.rope_index import position_ids

    return position_ids(spec, batch)


def make_tiny(out: Path, kind: str, spec) -> dict:
    from models.qwen2vl.tiny import make_tiny

    return make_tiny(out, kind, spec)


QWEN2VL = register(ModelFamily(
    name="Qwen2-VL / Qwen2.5-VL",
    model_types=("qwen2_vl", "qwen2_5_vl"),
    read_spec=read_spec,
    check_layout=check_layout,
    build_model=build_model,
    load_hf_into=load_hf_into,
    export_hf_buckets=export_hf_buckets,
    position_ids=position_ids,
    media_factor=lambda spec: spec.patch_size * spec.spatial_merge_size,  # 14 x 2 = 28
    tiny_kinds=KINDS,
    make_tiny=make_tiny,
    parity_module="models.qwen2vl.parity",
    # Qwen2.5-VL's temporal positions are seconds x tokens_per_second
    timed_video_types=("qwen2_5_vl",),
))
