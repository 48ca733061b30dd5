"""How a language model's layers split over pipeline stages: evenly (`pipeline_parallel` alone), or
as `pipeline_layers` says (layers per stage, e.g. [1, 2]: fewer on the first stage, which also
runs the vision tower). Pure Python: the trainer, the model families and the memory plan read it.

Megatron-Core takes an uneven split as its `pipeline_model_parallel_layout` (one list of layer
kinds per stage: the embedding first, the loss last); it numbers each stage's layers from the
sum of the earlier stages' counts, which the families' HF conversion follows (`layer_offset`).
"""

from __future__ import annotations

import re
from collections.abc import Sequence

_LANGUAGE_LAYER = re.compile(r"^language\.decoder\.layers\.(\d+)\.")
# a routed expert's parameter: `local_experts.j` on an expert-parallel rank is global expert offset + j
EXPERT = re.compile(r"^(language\.decoder\.layers\.\d+\.mlp\.experts\.local_experts\.)(\d+)(\..*)$")


def check_stage_layers(num_layers: int, pp: int, layers: Sequence[int] = (), prefix: str = "") -> None:
    """ValueError naming `prefix`+setting when the model's `num_layers` do not split into `pp`
    stages: evenly (no `layers`), or as `layers` (one count per stage, each >= 1, summing to
    the model's layers)."""
    layers = list(layers)
    if pp > num_layers:  # no split at all: each stage needs a layer of its own
        raise ValueError(f"{prefix}pipeline_parallel={pp}: the model has {num_layers} language layer"
                         f"{'' if num_layers == 1 else 's'} and every pipeline stage needs at least 1: set "
                         f"{prefix}pipeline_parallel to at most {num_layers} ({num_layers}: one layer a stage)")
    if not layers:
        if num_layers % pp:
            raise ValueError(f"{prefix}pipeline_parallel={pp}: the model's {num_layers} layers must divide evenly "
                             f"into the pipeline stages; set {prefix}pipeline_layers (language layers per stage, "
                             f"e.g. {uneven_example(num_layers, pp)}) for an uneven split")
        return
    if len(layers) != pp:
        raise ValueError(f"{prefix}pipeline_layers={layers}: one count per pipeline stage, so {pp} entries "
                         f"({prefix}pipeline_parallel={pp}), not {len(layers)}")
    if any(not isinstance(n, int) or isinstance(n, bool) or n < 1 for n in layers):
        raise ValueError(f"{prefix}pipeline_layers={layers}: every stage needs at least 1 language layer")
    if sum(layers) != num_layers:
        raise ValueError(f"{prefix}pipeline_layers={layers}: they add up to {sum(layers)} but the model has "
                         f"{num_layers} layers")


def uneven_example(num_layers: int, pp: int) -> list[int]:
    """A split of `num_layers` over `pp` stages (pp <= num_layers, so each gets one or more) with
    the fewest on the first (the vision tower's)."""
    base, extra = divmod(num_layers, pp)
    return [base + (1 if s >= pp - extra else 0) for s in range(pp)]


def stage_layers(num_layers: int, pp: int = 1, layers: Sequence[int] = ()) -> tuple[int, ...]:
    """Language layers on each of the `pp` stages (checked; see `check_stage_layers`)."""
    check_stage_layers(num_layers, pp, layers)
    return tuple(layers) if layers else (num_layers // pp,) * pp


def megatron_layout(layers: Sequence[int]) -> list[list[str]]:
    """Megatron-Core's `pipeline_model_parallel_layout` for these per-stage counts."""
    out = [["decoder"] * n for n in layers]
    out[0].insert(0, "embedding")
    out[-1].append("loss")
    return out


def whole_model_name(name: str, model) -> str:
    """The name a parameter of this pipeline stage has in the whole model: a stage numbers its
    language layers from 0, the whole model from the stage's `layer_offset`."""
    offset = getattr(model, "layer_offset", 0)
    return _LANGUAGE_LAYER.sub(lambda m: f"language.decoder.layers.{int(m.group(1)) + offset}.", name) \
        if offset else name


def global_name(name: str, model) -> str:
    """A parameter's name in the whole model of a mixture of experts too: the stage's layer
    offset (`whole_model_name`) and this expert-parallel rank's `expert_offset`."""
    name = whole_model_name(name, model)
    offset = getattr(model, "expert_offset", 0)
    return EXPERT.sub(lambda m: f"{m.group(1)}{int(m.group(2)) + offset}{m.group(3)}", name) if offset else name
