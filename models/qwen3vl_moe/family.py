"""The Qwen3-VL-MoE family (models/family.py): Qwen3-VL with mixture-of-experts language MLPs and
expert parallelism. The hooks import their modules when called, so registering costs nothing.
Position ids, media sizing and video timing are Qwen3-VL's."""

from __future__ import annotations

from pathlib import Path

from models.family import ModelFamily, register
from models.qwen3vl_moe.tiny import KINDS


def read_spec(config: dict, where: str = "config.json"):
    from models.qwen3vl_moe.config import Qwen3VLMoeSpec

    return Qwen3VLMoeSpec.from_hf_config(config, where)


def check_layout(spec, tp: int, pp: int, prefix: str = "", layers=(), ep: int = 1) -> None:
    from models.qwen3vl_moe.config import check_layout

    check_layout(spec, tp, pp, prefix, layers, ep)


def build_model(spec, dtype, tp: int = 1, recompute: str = "none", pp: int = 1, layers=(), ep: int = 1):
    from models.qwen3vl_moe.model import Qwen3VLMoeModel

    return Qwen3VLMoeModel(spec, dtype, tp, recompute, pp, layers, ep)


def load_hf_into(module, hf_dir: str | Path, tp_rank: int = 0, tp_size: int = 1) -> None:
    from models.qwen3vl_moe.convert import load_hf_into

    load_hf_into(module, hf_dir, tp_rank, tp_size)


def export_hf_buckets(module, tp_group=None, dtype=None, bucket_bytes: int | None = None):
    from models.qwen3vl_moe.convert import export_hf_buckets

    return export_hf_buckets(module, tp_group, dtype, bucket_bytes)


def position_ids(spec, batch: dict):
    from models.qwen3vl.rope_index import position_ids

    return position_ids(spec, batch)


def make_tiny(out: Path, kind: str, spec) -> dict:
    from models.qwen3vl_moe.tiny import make_tiny

    return make_tiny(out, kind, spec)


QWEN3VL_MOE = register(ModelFamily(
    name="Qwen3-VL-MoE",
    model_types=("qwen3_vl_moe",),
    read_spec=read_spec,
    check_layout=check_layout,
    build_model=build_model,
    load_hf_into=load_hf_into,
    export_hf_buckets=export_hf_buckets,
    position_ids=position_ids,
    media_factor=lambda spec: spec.patch_size * spec.spatial_merge_size,  # 16 x 2 = 32
    tiny_kinds=KINDS,
    make_tiny=make_tiny,
    parity_module="models.qwen3vl_moe.parity",
    timed_video_types=("qwen3_vl_moe",),
))
