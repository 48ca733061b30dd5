"""LoRA on the Megatron language model, beside the model families: a low-rank pair (A, B) added to
Megatron's column- and row-parallel linears of the language layers, chosen by their HF names,
with the base weights frozen.

    y = W x + (alpha / r) * B A dropout(x)

Under tensor parallelism each pair is laid out like its weight (checked against transformers +
peft at TP 2, docs/lora.md):
- column-parallel layers (linear_qkv, linear_fc1; W split on its output rows): A [r, in] whole
  on every TP rank, B [out / tp, r] split like W. The r-wide A x enters the TP region through
  Megatron's copy (backward: an all-reduce), so A's gradient and the input's are whole and alike
  on every rank, for r numbers a token instead of the hidden width.
- row-parallel layers (linear_proj, linear_fc2; W split on its input columns): A [r, in / tp]
  split like W, the r-wide partial products all-reduced, B [out, r] whole on every rank.
Megatron fuses HF's q/k/v projections into linear_qkv and gate/up into linear_fc1, each with one
adapter: those HF names are targeted together (one A shared by the fused projections; the PEFT
adapter written for vLLM and peft repeats it for each).

A mixture of experts' routed experts (target `experts`) get a pair per expert on its fc1 and fc2,
which peft holds stacked per layer (target_parameters). The token dispatcher gathers an expert's
input over TP and sums its output over TP itself, so an expert's adapter terms stay partial as
its weight's do; only the replicated half's gradient is summed over the expert-TP group. Under EP
the adapters live and are reduced where their experts are, named by global expert number.

The merge W + (alpha / r) B A is local to each rank (`merged`), and the adapter is
gathered whole over TP and PP for vLLM or a PEFT directory (models/convert.py's
`adapter_buckets`, beside the weights' export); a family turns
Megatron's linears into HF module paths (ModelFamily.lora_to_hf). The reference policy of the
KL penalty is the same model with its adapters off (`adapters_off`): no second weight copy.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch

from models.hf_io import dir_in_place
from models.stages import global_name

# HF projection -> the Megatron linear of a language layer that holds it: the attention's and the
# MLP's of every family (the default targets), then a gated DeltaNet's (Qwen3.5's linear-attention
# layers: in_proj_qkv/z/b/a fused into one in_proj)
DEFAULT_TARGETS = {"q_proj": "self_attention.linear_qkv", "k_proj": "self_attention.linear_qkv",
                   "v_proj": "self_attention.linear_qkv", "o_proj": "self_attention.linear_proj",
                   "gate_proj": "mlp.linear_fc1", "up_proj": "mlp.linear_fc1", "down_proj": "mlp.linear_fc2"}
DELTANET_TARGETS = {"in_proj_qkv": "self_attention.in_proj", "in_proj_z": "self_attention.in_proj",
                    "in_proj_b": "self_attention.in_proj", "in_proj_a": "self_attention.in_proj",
                    "out_proj": "self_attention.out_proj"}
# a mixture of experts' routed experts, named apart (PEFT adapts them as parameters, peft's
# target_parameters; each expert its own pair): every expert's fc1 [gate; up] and fc2
EXPERT_TARGETS = {"experts": "mlp.experts"}
# peft's target_parameters for them, in this order: peft names the first experts.base_layer
PEFT_EXPERT_PARAMETERS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
TARGETS = DEFAULT_TARGETS | DELTANET_TARGETS | EXPERT_TARGETS
_LAYER = re.compile(r"^language\.decoder\.layers\.\d+\.(.+)$")
_ROUTED = re.compile(r"^mlp\.experts\.local_experts\.\d+\.(linear_fc1|linear_fc2)$")
_VISION_BLOCK = re.compile(r"^vision\.decoder\.layers\.\d+\.(.+)$")
# the tower's patch mergers (DeepStack's too): plain linears, whole on every TP rank
_VISION_MERGER = re.compile(r"^vision\.(merger|deepstack_merger_list\.\d+)\.(fc1|fc2|linear_fc1|linear_fc2)$")
# a vision block's Megatron linears, every one adapted with vision_tower
VISION_LINEARS = ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2")
PEFT_PREFIX = "base_model.model."  # what peft puts before a module path in adapter_model.safetensors
ADAPTER_WEIGHTS, ADAPTER_CONFIG = "adapter_model.safetensors", "adapter_config.json"


@dataclass
class LoRAConfig:
    rank: int = 0  # LoRA rank r; 0: no LoRA, every weight trained
    alpha: float = 16.0  # LoRA alpha: the adapter's update is scaled by alpha / rank
    dropout: float = 0.0  # dropout on the adapter's input while training (peft's lora_dropout)
    # the language model's projections that get an adapter, by their HF names; q/k/v_proj go
    # together (Megatron fuses them into one layer, with one adapter), and so do gate/up_proj
    # (and a gated DeltaNet's in_proj_qkv/z/b/a the same way; out_proj). A mixture of experts:
    # gate/up/down_proj are its shared expert's (Qwen3.5-MoE), `experts` every routed expert
    target_modules: list[str] = field(default_factory=lambda: list(DEFAULT_TARGETS))
    # adapters on the vision tower too: each block's attention QKV and output projection and its
    # MLP, and the patch mergers' linears. vLLM serves them with its tower LoRA switched on
    vision_tower: bool = False

    RANGES = {"rank": ">= 0", "alpha": "> 0", "dropout": "[0, 1)"}

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    def validate(self) -> None:
        unknown = sorted(set(self.target_modules) - set(TARGETS))
        if unknown:
            raise ValueError(f"target_modules: {unknown} are not projections of the language model; choose from "
                             f"{', '.join(TARGETS)}")
        if self.enabled and self.dropout and "experts" in self.target_modules:
            raise ValueError(f"dropout={self.dropout} with target_modules naming experts: an expert's adapter has no "
                             "dropout (peft adapts the experts' weights, not their inputs): set dropout=0")
        if self.enabled and not self.target_modules:
            raise ValueError(f"rank={self.rank} but target_modules is empty: name the projections to adapt")
        for linear in set(TARGETS.values()):
            fused = [name for name, where in TARGETS.items() if where == linear]
            chosen = [name for name in fused if name in self.target_modules]
            if chosen and len(chosen) < len(fused):
                raise ValueError(f"target_modules has {chosen} without {sorted(set(fused) - set(chosen))}: Megatron "
                                 f"fuses {', '.join(fused)} into one layer ({linear}) with one adapter, so name them "
                                 "all or none")

    @property
    def linears(self) -> set[str]:
        """The Megatron linears (suffixes within a language layer) that get an adapter."""
        return {TARGETS[name] for name in self.target_modules} if self.enabled else set()


def check_layout(cfg: LoRAConfig, family, trainer_cfg, prefix: str = "policy.") -> None:
    """Whether LoRA runs for this model family and parallel layout (ValueError naming the setting)."""
    if not cfg.enabled:
        return
    if getattr(family, "lora_to_hf", None) is None:
        raise ValueError(f"{prefix}lora: {family.name} has no LoRA yet (supported: Qwen2-VL, Qwen2.5-VL, Qwen3-VL, "
                         f"Qwen3-VL-MoE, Qwen3.5, Qwen3.5-MoE); set {prefix}lora.rank=0 to train every weight")
    allowed = family.lora_targets or tuple(DEFAULT_TARGETS)
    if beyond := [name for name in cfg.target_modules if name not in allowed]:
        kept = [n for n in cfg.target_modules if n in allowed]
        mlp = "experts" in allowed and any(n in DEFAULT_TARGETS for n in beyond)  # an MoE without a dense MLP
        why = "its MLPs are the experts: name them experts" if mlp else "it has no such projections"
        fix = kept + ["experts"] if mlp and "experts" not in kept else kept or list(allowed)
        raise ValueError(f"{prefix}lora.target_modules: {family.name}'s adapters reach {', '.join(allowed)} only "
                         f"(not {', '.join(beyond)}: {why}): set {prefix}lora.target_modules=[{', '.join(fix)}]")


# -- the adapters on the model -----------------------------------------------------------------
def _kind(linear: torch.nn.Module) -> str | None:
    """column / row (Megatron's tensor-parallel linears), plain (a torch Linear, whole on every TP
    rank: the vision tower's patch mergers), or None: not a linear."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    if isinstance(linear, ColumnParallelLinear):
        return "column"
    if isinstance(linear, RowParallelLinear):
        return "row"
    return "plain" if isinstance(linear, torch.nn.Linear) else None


def lora_linears(module: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Module]]:
    """(name in this module, linear) of every linear that carries an adapter."""
    for name, sub in module.named_modules():
        if hasattr(sub, "lora_A"):
            yield name, sub


def is_adapter(name: str) -> bool:
    """Whether a parameter name (in the Megatron module) is an adapter's."""
    return name.endswith((".lora_A", ".lora_B"))


DROPOUT_RNG = "lora-dropout-rng"  # the RNG tracker's state for the column layers' dropout


def add_adapters(module: torch.nn.Module, cfg: LoRAConfig, seed: int) -> list[str]:
    """Freeze every weight of `module` (one rank's TP shard of a pipeline stage), then give the
    targeted language linears (and with vision_tower the tower's) an adapter. A is drawn as peft
    draws it (Kaiming-uniform, a=sqrt(5)) from a generator seeded by `seed` and the layer's
    whole-model name, whole, then split: the same adapter at every TP and PP layout. B starts at zero, so the model starts as the base.
    Returns the adapted linears' whole-model names."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    module.requires_grad_(False)
    tp = ps.get_tensor_model_parallel_world_size()
    tp_rank = ps.get_tensor_model_parallel_rank()
    tracker = get_cuda_rng_tracker()
    if cfg.dropout and DROPOUT_RNG not in tracker.get_states():
        # the same stream on every TP rank (a column layer's input is whole on each): not the
        # model-parallel state, which differs per TP rank; kept by Megatron's recompute as its own
        tracker.add(DROPOUT_RNG, seed + 104729)
    adapted = []
    for name, linear in list(module.named_modules()):
        kind, which = _kind(linear), _adapted(name, cfg)
        if kind is None or which is None:
            continue
        whole = global_name(name, module)  # a routed expert by its global number: the same A at any EP
        # the weight's whole shape: a column layer's rows and a row layer's columns are split over
        # TP; a plain Linear (a patch merger) is whole on every rank, and so are its A and B
        out_features, in_features = (linear.weight.shape[0] * (tp if kind == "column" else 1),
                                     linear.weight.shape[1] * (tp if kind == "row" else 1))
        gen = torch.Generator().manual_seed(_name_seed(seed, whole))
        a = torch.empty(cfg.rank, in_features)
        torch.nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=gen)
        if kind == "row":
            a = a.chunk(tp, dim=1)[tp_rank]
        b = torch.zeros(out_features // tp if kind == "column" else out_features, cfg.rank)
        device, dtype = linear.weight.device, linear.weight.dtype
        linear.lora_A = torch.nn.Parameter(a.to(device, dtype).contiguous())
        linear.lora_B = torch.nn.Parameter(b.to(device, dtype))
        # Megatron's attributes: which parameters are split over TP (gradient-norm counting, gathers)
        set_tensor_model_parallel_attributes(linear.lora_A, kind == "row", 1, 1)
        set_tensor_model_parallel_attributes(linear.lora_B, kind == "column", 0, 1)
        for p in (linear.lora_A, linear.lora_B):  # an expert's under EP: reduced over the expert-DP group
            p.allreduce = getattr(linear.weight, "allreduce", True)
        linear.lora_kind, linear.lora_scaling, linear.lora_on = kind, cfg.scaling, True
        linear.lora_dropout = cfg.dropout
        linear.lora_sections = _b_sections(which, linear, out_features)  # fused outputs: cut section by section
        linear.register_forward_hook(_add_plain_lora if kind == "plain" else _add_lora, with_kwargs=True)
        adapted.append(whole)
    if not adapted:
        raise ValueError(f"LoRA: no language linear matches target_modules={cfg.target_modules}")
    # the adapted weights by identity: `merged` swaps them for their merge, a sync unit at a time
    module.lora_by_weight = {id(linear.weight): linear for _, linear in lora_linears(module)}
    return adapted


def _b_sections(which: str, linear: torch.nn.Module, out_features: int) -> list[int] | None:
    """The row sections of a column layer's fused output, whole, each split over TP on its own
    (so B's rows gather and cut section by section): linear_fc1's [gate; up] when gated, a gated
    DeltaNet's in_proj [q, k, v, z, b, a]; None: one section, split as a whole."""
    config = getattr(linear, "config", None)
    if which == "mlp.linear_fc1" and config.gated_linear_unit:
        return [out_features // 2] * 2
    if which == "self_attention.in_proj":
        qk = config.linear_key_head_dim * config.linear_num_key_heads
        v = config.linear_value_head_dim * config.linear_num_value_heads
        heads = config.linear_num_value_heads
        return [qk, qk, v, v, heads, heads]
    return None


def _adapted(name: str, cfg: LoRAConfig) -> str | None:
    """The linear's suffix within its layer when `cfg` gives it an adapter (a language layer's
    targeted projection, or with vision_tower any linear of a vision block or a patch merger),
    else None."""
    if match := _LAYER.match(name):
        suffix = match.group(1)
        if routed := _ROUTED.match(suffix):  # each routed expert's fc1 / fc2
            return f"mlp.{routed.group(1)}" if EXPERT_TARGETS["experts"] in cfg.linears else None
        suffix = suffix.replace("mlp.shared_experts.", "mlp.", 1)  # a shared expert: HF's gate/up/down_proj
        return suffix if suffix in cfg.linears else None
    if cfg.vision_tower and (match := _VISION_BLOCK.match(name)) and match.group(1) in VISION_LINEARS:
        return match.group(1)
    if cfg.vision_tower and (match := _VISION_MERGER.match(name)):
        return f"merger.{match.group(2)}"
    return None


def _name_seed(seed: int, name: str) -> int:
    return int.from_bytes(hashlib.blake2b(f"{seed}|{name}".encode(), digest_size=8).digest(), "little") >> 1


def _add_lora(linear, args, kwargs, output):
    """The forward hook of an adapted linear: Megatron's (output, bias) with the adapter's term added."""
    from megatron.core.tensor_parallel.mappings import (copy_to_tensor_model_parallel_region,
                                                        reduce_from_tensor_model_parallel_region)
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    if not linear.lora_on:
        return output
    x = args[0] if args else kwargs["input_"]
    out, bias = output
    if linear.lora_dropout and linear.training:
        # column: the whole input, the same mask on every TP rank; row: this rank's columns
        with get_cuda_rng_tracker().fork(DROPOUT_RNG if linear.lora_kind == "column" else "model-parallel-rng"):
            x = torch.nn.functional.dropout(x, linear.lora_dropout, training=True)
    a, b, group = linear.lora_A, linear.lora_B, linear.tp_group  # an expert's group: the expert-TP one
    if getattr(linear, "explicit_expert_comm", False):
        # an expert's linear under TP or EP: the token dispatcher gathers its input over TP and sums
        # its output over TP, so the adapter's terms stay partial like W's; only the pair's
        # replicated half (a column layer's A, a row layer's B) sees partial gradients, summed
        if linear.lora_kind == "column":
            a = copy_to_tensor_model_parallel_region(a, group)
        else:
            b = copy_to_tensor_model_parallel_region(b, group)
        return out + torch.nn.functional.linear(torch.nn.functional.linear(x, a), b) * linear.lora_scaling, bias
    h = torch.nn.functional.linear(x, a)  # [s, b, r]: whole (column) or partial (row)
    if linear.lora_kind == "column":
        h = copy_to_tensor_model_parallel_region(h, group)  # backward: the r-wide gradient summed over TP
    else:
        h = reduce_from_tensor_model_parallel_region(h, group)  # the partial products summed over TP
    return out + torch.nn.functional.linear(h, b) * linear.lora_scaling, bias


def _add_plain_lora(linear, args, kwargs, output):
    """The forward hook of an adapted torch Linear (a patch merger's, whole on every TP rank)."""
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    if not linear.lora_on:
        return output
    x = args[0] if args else kwargs["input"]
    if linear.lora_dropout and linear.training:
        with get_cuda_rng_tracker().fork(DROPOUT_RNG):  # the same mask on every TP rank
            x = torch.nn.functional.dropout(x, linear.lora_dropout, training=True)
    return output + torch.nn.functional.linear(torch.nn.functional.linear(x, linear.lora_A), linear.lora_B) \
        * linear.lora_scaling


@contextmanager
def adapters_off(module: torch.nn.Module):
    """The base model: every adapter's term left out (the reference policy of the KL penalty)."""
    linears = [linear for _, linear in lora_linears(module)]
    for linear in linears:
        linear.lora_on = False
    try:
        yield
    finally:
        for linear in linears:
            linear.lora_on = True


def adapter_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """This rank's adapter parameters by name (its TP shard of its stage): what a checkpoint keeps."""
    return {name: p for name, p in module.named_parameters() if is_adapter(name)}


def frozen_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """This rank's frozen parameters by name: the base the adapter belongs to."""
    return {name: p for name, p in module.named_parameters() if not p.requires_grad}


# -- export --------------------------------------------------------------------------------------
def merged(module: torch.nn.Module, params: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """`params` ((name, parameter) of `module`) as a merged model has them: an adapted linear's
    weight becomes W + (alpha / r) B A, this rank's shard, carrying W's tensor-parallel
    attributes, so the family's gather reassembles it as it does W. Called a sync unit at a time,
    so a merged copy of the model never exists at once. Without adapters: `params` as they are."""
    adapted = getattr(module, "lora_by_weight", None)  # add_adapters's map
    if not adapted:
        return params
    out = []
    for name, p in params:
        linear = adapted.get(id(p))
        if linear is None:
            out.append((name, p))
            continue
        with torch.no_grad():
            delta = (linear.lora_B.float() @ linear.lora_A.float()) * linear.lora_scaling
            weight = (p.float() + delta).to(p.dtype)
        for attr in ("tensor_model_parallel", "partition_dim", "partition_stride"):
            if hasattr(p, attr):
                setattr(weight, attr, getattr(p, attr))
        out.append((name, weight))
    return out


# -- PEFT adapter directories --------------------------------------------------------------------
def peft_config(cfg: LoRAConfig, base_model: str) -> dict:
    """adapter_config.json as peft (0.21) writes it for these settings."""
    return {"peft_type": "LORA", "task_type": None, "base_model_name_or_path": str(base_model), "r": cfg.rank,
            "lora_alpha": cfg.alpha, "lora_dropout": cfg.dropout,
            "target_modules": _peft_targets(cfg),
            # the routed experts' stacked weights, adapted as parameters
            "target_parameters": PEFT_EXPERT_PARAMETERS if "experts" in cfg.target_modules else None,
            "bias": "none", "fan_in_fan_out": False, "use_rslora": False, "use_dora": False,
            "modules_to_save": None, "init_lora_weights": True, "layers_to_transform": None,
            "layers_pattern": None, "rank_pattern": {}, "alpha_pattern": {}, "inference_mode": True,
            "revision": None}


# the vision blocks' linears as the families' HF towers name them (Qwen2-VL: fc1/fc2; Qwen2.5-VL:
# gate/up/down_proj; Qwen3-VL and Qwen3.5: linear_fc1/2): each tower has only its own
VISION_HF = (r"visual\.(blocks\.\d+\.(attn\.qkv|attn\.proj|mlp\.(fc1|fc2|gate_proj|up_proj|down_proj|linear_fc1|linear_fc2))"
             # the patch mergers: Qwen2-VL's mlp.0 / mlp.2 (mlp.1 is its GELU), Qwen3-VL's and DeepStack's
             r"|(merger|deepstack_merger_list\.\d+)\.(mlp\.0|mlp\.2|linear_fc1|linear_fc2))")


def _peft_targets(cfg: LoRAConfig) -> str | None:
    """peft's target_modules regex: the language model's targeted projections only (a plain list
    would also catch a vision tower's of the same name, Qwen2.5-VL's gate/up/down_proj, which the
    adapter would not hold), and with vision_tower the tower's blocks and patch mergers. The
    routed experts are parameters, not modules (target_parameters); None: nothing but them."""
    modules = sorted(set(cfg.target_modules) - set(EXPERT_TARGETS))
    parts = ([rf".*language_model.*\.({'|'.join(modules)})"] if modules else []) \
        + ([rf".*{VISION_HF}"] if cfg.vision_tower else [])
    if not parts:
        return None
    return rf"{parts[0]}$" if len(parts) == 1 else rf"({'|'.join(parts)})$"


def save_adapter_dir(tensors: dict[str, torch.Tensor], config: dict, out_dir: str | Path) -> Path:
    """A PEFT adapter directory (adapter_config.json, adapter_model.safetensors) that peft's
    PeftModel.from_pretrained and vLLM's LoRARequest load; written beside and renamed into
    place, so a reader never sees half of one."""
    from safetensors.torch import save_file

    with dir_in_place(out_dir) as tmp:
        # copies: a fused layer's projections share one A, and safetensors refuses shared memory
        save_file({k: v.detach().cpu().clone() for k, v in tensors.items()}, str(tmp / ADAPTER_WEIGHTS),
                  metadata={"format": "pt"})
        (tmp / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2))
    return Path(out_dir)


def adapter_bytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def read_adapter_dir(path: str | Path) -> dict | None:
    """The adapter_config.json of a PEFT adapter directory (e.g. a LoRA run's RUN_DIR/final);
    None when `path` is not one."""
    config = Path(path) / ADAPTER_CONFIG
    return json.loads(config.read_text()) if config.is_file() else None


def merge_adapter_dir(adapter_dir: str | Path, out_dir: str | Path, base_dir: str | Path | None = None) -> Path:
    """The merged HF model of a PEFT LoRA adapter directory (a LoRA run's RUN_DIR/final), what
    peft's merge_and_unload gives: each adapted projection's weight W + (lora_alpha / r) B A, in
    W's dtype; every other weight and file as in its base (`base_dir`, else the adapter config's
    base_model_name_or_path). Works on the checkpoint's tensors, without building the model."""
    from safetensors.torch import load_file

    from models.hf_io import check_hf_dir, save_hf_dir

    config = read_adapter_dir(adapter_dir)
    if config is None:
        raise FileNotFoundError(f"{adapter_dir} is not a PEFT adapter directory (no {ADAPTER_CONFIG}): give a LoRA "
                                "run's RUN_DIR/final")
    if config.get("peft_type") != "LORA" or config.get("use_rslora") or config.get("use_dora"):
        raise ValueError(f"{adapter_dir}: only plain LoRA adapters merge here (peft_type LORA, no rsLoRA or DoRA)")
    base = check_hf_dir(base_dir or config["base_model_name_or_path"])
    weights: dict[str, torch.Tensor] = {}
    for f in sorted(base.glob("*.safetensors")):
        weights.update(load_file(str(f)))
    adapter = load_file(str(Path(adapter_dir) / ADAPTER_WEIGHTS))
    scaling = config["lora_alpha"] / config["r"]
    suffix = ".lora_A.weight"
    for key, a in adapter.items():
        if not key.endswith(suffix):
            continue
        module = key[len(PEFT_PREFIX):-len(suffix)]
        # transformers 5 names the text model model.language_model.*; checkpoints saved by 4.x, model.*
        weight = _peft_weight(module)
        names = [weight, weight.replace("model.language_model.", "model.", 1)]
        name = next((n for n in names if n in weights), None)
        if name is None:
            raise KeyError(f"{adapter_dir}: the adapted projection {module} has no weight in {base} (tried "
                           f"{', '.join(names)}): is it the adapter's base?")
        b = adapter[key[:-len(suffix)] + ".lora_B.weight"]
        w = weights[name]
        weights[name] = (w.float() + scaling * _delta(a.float(), b.float(), w)).to(w.dtype)
    return save_hf_dir(weights, base, out_dir)


def _peft_weight(module: str) -> str:
    """The weight a peft module path adapts: its .weight; the stacked experts' gate_up_proj
    (peft's experts.base_layer, wrapped first) or down_proj (experts)."""
    if module.endswith(".experts.base_layer"):
        return module.removesuffix(".base_layer") + ".gate_up_proj"
    return f"{module}.down_proj" if module.endswith(".experts") else f"{module}.weight"


def _delta(a: torch.Tensor, b: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """B A in `weight`'s layout: a linear's [out, in]; stacked experts' (peft's A [E * r, in], B
    [out, r * E]) per expert, [E, out, in] or, as the released checkpoints keep them, [E, in, out]
    (told apart by shape; a square one read as released, as the loaders read it)."""
    if weight.dim() == 2:
        return b @ a
    experts = weight.shape[0]
    delta = torch.einsum("ore,eri->eoi", b.reshape(b.shape[0], -1, experts), a.reshape(experts, -1, a.shape[1]))
    return delta if weight.shape[1:] == delta.shape[1:] and delta.shape[1] != delta.shape[2] \
        else delta.transpose(1, 2)
