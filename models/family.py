"""Model families: what the rest of yatt-mm asks of a model, and which family answers for a
checkpoint (found from its config.json's `model_type`).

One folder per family under `models/` (torchtitan's `models/<name>/` with a train spec): its
`family.py` builds a `ModelFamily` and `register()`s it. The trainer, parity, weight sync, HF
export, the memory plan, media sizing and `make-tiny-model` look the family up here and never
import a family's modules themselves (tests/cli/test_architecture.py checks it).

A family's *spec* (what `read_spec` returns) is a frozen dataclass of the checkpoint's numbers.
Shared code reads these fields of it: `model_type`; the language model's `vocab_size`,
`hidden_size`, `intermediate_size`, `num_layers`, `num_heads`, `num_kv_heads`, `head_dim`,
`tie_word_embeddings`; the media tokens `image_token_id`, `video_token_id`; and for the memory
plan the vision tower's `vision_depth`, `vision_embed_dim`, `vision_heads`, `vision_ffn`,
`vision_gated`, `vision_rms_norm`, `vision_windowed` (window attention: units of one size as
a batch, each patch with its own rotary angles; else frames as a batch), `patch_size`,
`temporal_patch_size`, `spatial_merge_size`, `in_channels`.

Importing this module is cheap: family modules are imported on the first lookup, and they
import their heavy parts (torch, Megatron, transformers) inside the hooks.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class ModelFamily:
    name: str  # for messages, e.g. "Qwen2-VL / Qwen2.5-VL"
    model_types: tuple[str, ...]  # the config.json `model_type`s it reads
    # config.json (as a dict) -> spec; `where` names the source in errors
    read_spec: Callable[[dict, str], Any]
    # (spec, tp, pp, prefix, layers=()) -> None, or ValueError naming `prefix`+setting: whether
    # the model splits into tp tensor-parallel shards and pp pipeline stages (evenly, or `layers`
    # language layers per stage: models/stages.py)
    check_layout: Callable[..., None]
    # (spec, dtype, tp, recompute, pp, layers=()) -> this rank's Megatron module (its TP shard of
    # its pipeline stage), randomly initialised; forward(VLMInputs, packed_seq_params=None) -> logits
    build_model: Callable[..., Any]
    # (module, hf_dir, tp_rank, tp_size) -> None: an HF checkpoint into the module
    load_hf_into: Callable[..., None]
    # (module, tp_group, dtype, bucket_bytes) -> iterator of {HF name: full tensor}: the whole
    # model in HF form, bucket by bucket (bucket_bytes None: one per pipeline stage); a
    # collective over TP and PP
    export_hf_buckets: Callable[..., Iterator[dict]]
    # (spec, processor batch dict) -> position ids [3, b, s] (M-RoPE); ValueError if the batch
    # lacks what the family needs
    position_ids: Callable[[Any, dict], Any]
    # spec -> the side multiple (pixels) media are resized to: patch size x spatial merge size
    media_factor: Callable[[Any], int]
    # the tiny models it builds: kind -> cache version (a change rebuilds cached tiny models)
    tiny_kinds: Mapping[str, str]
    # (out_dir, kind, tiny_spec: models.tiny.TinySpec) -> stamp fields: writes the HF model
    # and processor (not the stamp; models/tiny.py writes yatt_tiny.json)
    make_tiny: Callable[..., dict]
    # `python -m <parity_module> HF_DIR [--tp T --pp P]`: logits vs transformers, a JSON line
    parity_module: str
    # model_types whose video positions follow time: vLLM gets every video's metadata (fps)
    timed_video_types: tuple[str, ...] = ()
    # (spec, tp, cp, prefix) -> None, or ValueError naming `prefix`+setting: what the family's
    # context-parallel path needs of the model beyond cp dividing the world (None: nothing)
    check_context_parallel: Callable[..., None] | None = None
    # (spec, {whole-model name of an adapted language linear: (whole A, whole B)}) -> {HF module
    # path as transformers 5 lays the model out, e.g. model.language_model.layers.0.self_attn.q_proj:
    # (A, B)}: models/lora.py's adapters as PEFT and vLLM name them (None: no LoRA for the family yet)
    lora_to_hf: Callable[..., dict] | None = None
    # the HF projections its adapters can target (models/lora.py TARGETS' names; empty: DEFAULT_TARGETS')
    lora_targets: tuple[str, ...] = ()


def lazy(module: str, name: str) -> Callable:
    """A hook that imports `module` when first called and forwards to its `name` (dotted for an
    attribute of an attribute, e.g. "Qwen2VLSpec.from_hf_config"), so registering a family
    imports none of its heavy parts."""
    def hook(*args, **kwargs):
        target = importlib.import_module(module)
        for part in name.split("."):
            target = getattr(target, part)
        return target(*args, **kwargs)

    hook.__name__ = name.rpartition(".")[2]
    hook.__doc__ = f"{module}.{name}, imported when called."
    return hook


def patch_merge_factor(spec) -> int:
    """`media_factor` of a family whose media tokens are spatial_merge_size^2 patches: patch size
    x spatial merge size."""
    return spec.patch_size * spec.spatial_merge_size


# The family modules, imported on the first lookup (an import error surfaces there).
_FAMILY_MODULES = ["models.qwen2vl.family", "models.qwen3vl.family", "models.qwen3vl_moe.family",
                  "models.qwen35.family", "models.qwen35_moe.family"]
_REGISTRY: dict[str, ModelFamily] = {}  # model_type -> family
_loaded = False


def register(family: ModelFamily) -> ModelFamily:
    for model_type in family.model_types:
        other = _REGISTRY.get(model_type)
        if other is not None and other is not family:
            raise ValueError(f"model_type {model_type!r} is claimed by both {other.name} and {family.name}")
        _REGISTRY[model_type] = family
    return family


def _load() -> None:
    global _loaded
    if not _loaded:
        for module in _FAMILY_MODULES:
            importlib.import_module(module)
        _loaded = True


def families() -> list[ModelFamily]:
    """Every registered family, once each, in registration order."""
    _load()
    return list({id(f): f for f in _REGISTRY.values()}.values())


def supported_model_types() -> list[str]:
    _load()
    return list(_REGISTRY)


def family_for_model_type(model_type: str | None, where: str = "") -> ModelFamily:
    _load()
    family = _REGISTRY.get(model_type or "")
    if family is None:
        raise ValueError(f"{where + ': ' if where else ''}model_type {model_type!r} is not supported; supported "
                         "families: " + "; ".join(f"{f.name} ({', '.join(f.model_types)})" for f in families()))
    return family


def hf_config(hf_dir: str | Path) -> dict:
    path = Path(hf_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{hf_dir} is not an HF model directory (no config.json)")
    return json.loads(path.read_text())


def family_for_dir(hf_dir: str | Path) -> ModelFamily:
    """The family of the checkpoint in `hf_dir` (its config.json's model_type)."""
    return family_for_model_type(hf_config(hf_dir).get("model_type"), str(hf_dir))


def read_spec(hf_dir: str | Path):
    """The spec of the checkpoint in `hf_dir`, read by its family."""
    config = hf_config(hf_dir)
    return family_for_model_type(config.get("model_type"), str(hf_dir)).read_spec(config, str(hf_dir))


def family_of(spec) -> ModelFamily:
    """The family that read `spec`."""
    return family_for_model_type(spec.model_type)


def family_for_tiny_kind(kind: str) -> ModelFamily:
    for family in families():
        if kind in family.tiny_kinds:
            return family
    raise ValueError(f"unknown tiny model kind {kind!r}; choose one of {', '.join(tiny_kinds())}")


def tiny_kinds() -> list[str]:
    return [kind for family in families() for kind in family.tiny_kinds]
