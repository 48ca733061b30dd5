"""Parameter counts, tensor by tensor as the Megatron model lays them out (models/qwen2vl/model.py
+ vision.py, models/qwen3vl/model.py + vision.py; what a spec says of its vision tower:
models/family.py), on one tensor-parallel rank of one pipeline stage.

Besides the fields every spec has, a spec may say (read with these defaults, Qwen2-VL's):
`qkv_bias` (True), `qk_norm` (False: Qwen3's per-head RMSNorm over queries and keys, one
head_dim weight each, whole on every TP rank), `vision_patch_bias` (False), the learned vision
position table's `num_position_embeddings` (0: none) and `num_deepstack` (0: DeepStack mergers,
each with its LayerNorm over the merged 4 x width vector). A mixture-of-experts spec (Qwen3-VL-MoE,
models/qwen3vl_moe/config.py) says `num_experts` (0: dense), `moe_intermediate_size` and
`num_experts_per_tok`: every language MLP is then a router and the experts, which expert
parallelism splits over `ep` ranks (models/qwen3vl_moe/model.py), plus with
`shared_expert_intermediate_size` a shared expert and its sigmoid gate (Qwen3.5-MoE).

A hybrid spec (Qwen3.5, models/qwen35/config.py) lists `layer_types`: a "linear_attention" layer
is a gated DeltaNet (Megatron's GatedDeltaNet: the fused input projection of q, k, v, z, b, a, a
depthwise conv over q, k, v, per-value-head decay `A_log` and `dt_bias`, a per-head output norm,
the output projection; sizes `linear_num_key_heads` / `linear_num_value_heads` of
`linear_key_head_dim` / `linear_value_head_dim`, conv kernel `linear_conv_kernel_dim`), a
"full_attention" layer gated attention (`attention_output_gate`, default on for hybrid specs: a
second query-sized projection gates the output)."""

from __future__ import annotations

from dataclasses import dataclass



@dataclass(frozen=True)
class Params:
    """Parameter counts on one tensor-parallel rank (tp=1: the whole model)."""

    vision: int
    language: int
    largest: int  # the largest single parameter tensor (Adam's per-tensor temporaries on CPU)
    # of `language`, the experts' parameters on this expert-parallel rank: the distributed
    # optimizer shards them over the expert-data-parallel group, not over DP
    experts: int = 0

    @property
    def dense(self) -> int:
        """Parameters every rank of the DP group holds alike (all but the experts)."""
        return self.total - self.experts

    @property
    def total(self) -> int:
        return self.vision + self.language


def _column(n_in: int, n_out: int, tp: int, bias: bool) -> list[int]:
    """ColumnParallelLinear: output rows (and bias) split over TP."""
    return [n_out // tp * n_in] + ([n_out // tp] if bias else [])


def _row(n_in: int, n_out: int, tp: int, bias: bool) -> list[int]:
    """RowParallelLinear: input columns split over TP; the bias is whole on every rank."""
    return [n_out * (n_in // tp)] + ([n_out] if bias else [])


def linear_layers(spec) -> tuple[bool, ...]:
    """Per language layer: whether it is linear attention (a gated DeltaNet, holding a recurrent
    state instead of a KV cache); all False for a model without `layer_types`."""
    types = getattr(spec, "layer_types", ()) or ()
    return tuple(t == "linear_attention" for t in types) or (False,) * spec.num_layers


def _attention(spec, tp: int) -> list[int]:
    """Softmax attention: QKV (with the output gate's queries when gated), q/k norms, output."""
    h, q, kv = spec.hidden_size, spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    qk_norms = [spec.head_dim, spec.head_dim] if getattr(spec, "qk_norm", False) else []
    gate = q if getattr(spec, "attention_output_gate", bool(getattr(spec, "layer_types", ()))) else 0
    return (_column(h, q + gate + 2 * kv, tp, bias=getattr(spec, "qkv_bias", True)) + qk_norms
            + _row(q, h, tp, bias=False))


def _delta_net(spec, tp: int) -> list[int]:
    """A gated DeltaNet (Megatron's GatedDeltaNet, no biases): in_proj to q, k (key heads), v, z
    (value heads) and b, a (one each per value head), split over TP like the conv's channels and
    the value heads' A_log and dt_bias; the per-head output RMSNorm whole on every rank."""
    h, nv = spec.hidden_size, spec.linear_num_value_heads
    qk, v = spec.linear_num_key_heads * spec.linear_key_head_dim, nv * spec.linear_value_head_dim
    conv = (2 * qk + v) // tp * spec.linear_conv_kernel_dim  # depthwise: one kernel a channel
    return (_column(h, 2 * qk + 2 * v + 2 * nv, tp, bias=False) + [conv, nv // tp, nv // tp]
            + [spec.linear_value_head_dim] + _row(v, h, tp, bias=False))


def _mlp(spec, tp: int) -> list[int]:
    """The MLP but the routed experts: a dense SwiGLU, or a MoE layer's router (Megatron's
    TopKRouter: one [experts, hidden] weight, whole on every rank, no bias) with its shared
    expert (a SwiGLU split over TP like a dense one, and its [1, hidden] gate, whole)."""
    h, experts = spec.hidden_size, getattr(spec, "num_experts", 0)
    if not experts:
        return _column(h, 2 * spec.intermediate_size, tp, bias=False) + _row(spec.intermediate_size, h, tp, bias=False)
    shared = getattr(spec, "shared_expert_intermediate_size", 0)
    return [experts * h] + ((_column(h, 2 * shared, tp, bias=False) + _row(shared, h, tp, bias=False) + [h])
                            if shared else [])


def _language_layer(spec, tp: int, linear: bool = False) -> list[int]:
    """A language layer's tensors but the experts: a MoE layer's MLP is its router (and shared
    expert) here, the experts are `_layer_experts`. `linear`: a gated DeltaNet in place of
    attention."""
    h = spec.hidden_size
    return ([h, h]  # input and pre-MLP RMSNorm weights, whole on every rank
            + (_delta_net(spec, tp) if linear else _attention(spec, tp)) + _mlp(spec, tp))


def _layer_experts(spec, tp: int, ep: int) -> list[int]:
    """One MoE layer's experts on this expert-parallel rank: num_experts / ep SwiGLU MLPs of
    width moe_intermediate_size (SequentialMLP: fc1 [2I, h] and fc2 [h, I] each, split over the
    experts' TP like a dense MLP); none for a dense model."""
    experts, h, inter = getattr(spec, "num_experts", 0), spec.hidden_size, getattr(spec, "moe_intermediate_size", 0)
    one = _column(h, 2 * inter, tp, bias=False) + _row(inter, h, tp, bias=False)
    return experts // ep * one


def _vision_layer(spec, tp: int) -> list[int]:
    hv = spec.vision_embed_dim
    norms = [hv, hv] if spec.vision_rms_norm else [hv, hv, hv, hv]  # RMSNorm: weight; LayerNorm: weight and bias
    ffn = spec.vision_ffn
    fc1 = 2 * ffn if spec.vision_gated else ffn
    return (norms + _column(hv, 3 * hv, tp, bias=True) + _row(hv, hv, tp, bias=True)
            + _column(hv, fc1, tp, bias=True) + _row(ffn, hv, tp, bias=True))


def _vision_ends(spec) -> list[int]:
    """Patch embedding, position table and patch mergers: plain nn.Linear / nn.Embedding, whole
    on every TP rank."""
    hv, merged = spec.vision_embed_dim, spec.vision_embed_dim * spec.spatial_merge_size**2
    patch = spec.in_channels * spec.temporal_patch_size * spec.patch_size**2
    ln_q = [hv] if spec.vision_rms_norm else [hv, hv]
    mlp = [merged * merged, merged, spec.hidden_size * merged, spec.hidden_size]
    embed = [hv * patch] + ([hv] if getattr(spec, "vision_patch_bias", False) else [])
    positions = [getattr(spec, "num_position_embeddings", 0) * hv]
    deepstack = getattr(spec, "num_deepstack", 0) * ([merged, merged] + mlp)  # LayerNorm after the 2x2 merge
    return embed + [p for p in positions if p] + ln_q + mlp + deepstack


def param_counts(spec, tp: int = 1, pp: int = 1, stage: int = 0, layers: tuple[int, ...] = (), ep: int = 1) -> Params:
    """Parameters of this rank's shard of the Megatron model (e.g. models/qwen2vl/model.py): its TP
    shard of pipeline `stage` (pp=1: the whole model). The first stage holds the vision tower and
    the embedding, the last the final norm and the output layer (with tied embeddings and more
    than one stage, the last keeps its own copy of the embedding as the output layer). `layers`:
    language layers per stage (policy.trainer.pipeline_layers; empty: an even split). `ep`: the
    expert-parallel size (a MoE model's experts split over it; dense parameters whole)."""
    from models.stages import stage_layers

    vocab, h = spec.vocab_size, spec.hidden_size
    first, last = stage == 0, stage == pp - 1
    lm_ends = (([vocab // tp * h] if first else []) + ([h] if last else [])
               + ([vocab // tp * h] if last and not (spec.tie_word_embeddings and first) else []))
    v_layer, v_ends = _vision_layer(spec, tp), _vision_ends(spec)
    vision = spec.vision_depth * sum(v_layer) + sum(v_ends) if first else 0
    counts = stage_layers(spec.num_layers, pp, layers)
    start = sum(counts[:stage])
    kinds = linear_layers(spec)[start:start + counts[stage]]  # this stage's layers, linear or not
    lm_layers = [_language_layer(spec, tp, linear) for linear in sorted(set(kinds))]
    n_layers = len(kinds)
    experts = _layer_experts(spec, tp, ep)
    language = sum(sum(_language_layer(spec, tp, linear)) for linear in kinds)
    return Params(vision=vision, language=language + n_layers * sum(experts) + sum(lm_ends),
                  largest=max([t for layer in lm_layers for t in layer] + experts + lm_ends
                              + (v_layer + v_ends if first else [])),
                  experts=n_layers * sum(experts))


def active_params(spec) -> int:
    """Parameters one token's forward multiplies by: the whole model but, in a MoE layer, only
    the num_experts_per_tok experts the router picks (of num_experts). The training FLOPs of a
    token are ~6 x this (plus attention's), not 6 x the total."""
    full = param_counts(spec)
    experts = getattr(spec, "num_experts", 0)
    return full.total - (full.experts - full.experts // experts * spec.num_experts_per_tok if experts else 0)


def adaptable_linears(spec) -> dict[str, tuple[int, int, str]]:
    """Each language linear an adapter can sit on (models/lora.py TARGETS' Megatron names): its
    whole (in, out) widths and how Megatron splits it over TP (column: out; row: in). The
    attention's QKV is wider by the output gate's queries where gated (Qwen3.5). A mixture of
    experts: each routed expert's fc1 and fc2, and the shared expert's as the MLP's (Qwen3.5-MoE)."""
    h, inter = spec.hidden_size, spec.intermediate_size
    q, kv = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    gate = q if getattr(spec, "attention_output_gate", bool(getattr(spec, "layer_types", ()))) else 0
    out = {"self_attention.linear_qkv": (h, q + gate + 2 * kv, "column"), "self_attention.linear_proj": (q, h, "row")}
    if getattr(spec, "num_experts", 0):  # a MoE layer: one routed expert's linears; the shared expert's
        moe, shared = spec.moe_intermediate_size, getattr(spec, "shared_expert_intermediate_size", 0)
        out |= {"mlp.experts.linear_fc1": (h, 2 * moe, "column"), "mlp.experts.linear_fc2": (moe, h, "row")}
        inter = shared
    if inter:
        out |= {"mlp.linear_fc1": (h, 2 * inter, "column"), "mlp.linear_fc2": (inter, h, "row")}
    if any(linear_layers(spec)):  # a gated DeltaNet's in_proj [q, k, v, z, b, a] and out_proj
        nv = spec.linear_num_value_heads
        qk, v = spec.linear_key_head_dim * spec.linear_num_key_heads, spec.linear_value_head_dim * nv
        out |= {"self_attention.in_proj": (h, 2 * qk + 2 * v + 2 * nv, "column"), "self_attention.out_proj": (v, h, "row")}
    return out


def _adapter(n_in: int, n_out: int, kind: str, r: int, tp: int) -> int:
    """One adapter's parameters on a TP rank: A [r, in] split with a row layer's input, B [out, r]
    with a column layer's output; a plain linear's (a patch merger's) whole on every rank."""
    return r * (n_in // tp if kind == "row" else n_in) + r * (n_out // tp if kind == "column" else n_out)


def lora_params(spec, lora, tp: int = 1, pp: int = 1, stage: int = 0, layers: tuple[int, ...] = (),
                ep: int = 1) -> int:
    """The LoRA adapter's parameters on one TP rank of pipeline `stage` (models/lora.py): a pair
    (A, B) on each adapted linear of the stage's language layers (`adaptable_linears`, on the
    layers that hold each: `adapted_layers`; a routed expert's on each of the rank's experts,
    num_experts / `ep`); with `lora.vision_tower`, every vision block's four
    linears and the patch mergers' linears on the first stage. 0 without LoRA (`lora.rank` 0)."""
    if not lora.rank:
        return 0
    r, linears, held = lora.rank, adaptable_linears(spec), adapted_layers(spec, pp, stage, layers)
    copies = {linear: spec.num_experts // ep if linear in EXPERT_LINEARS else 1 for linear in targeted_linears(lora)}
    language = sum(held[linear] * copies[linear] * _adapter(*linears[linear], r, tp) for linear in copies)
    if not (lora.vision_tower and stage == 0):
        return language
    hv, ffn = spec.vision_embed_dim, spec.vision_ffn  # the tower's blocks, on the first stage
    block = [(hv, 3 * hv, "column"), (hv, hv, "row"), (hv, 2 * ffn if spec.vision_gated else ffn, "column"),
             (ffn, hv, "row")]
    merged = hv * spec.spatial_merge_size**2  # each patch merger's two plain linears, whole on every rank
    merger = [(merged, merged, "plain"), (merged, spec.hidden_size, "plain")]
    return (language + spec.vision_depth * sum(_adapter(*shape, r, tp) for shape in block)
            + (1 + getattr(spec, "num_deepstack", 0)) * sum(_adapter(*shape, r, tp) for shape in merger))


def adapted_layers(spec, pp: int = 1, stage: int = 0, layers: tuple[int, ...] = ()) -> dict[str, int]:
    """Per adaptable linear (models/lora.py TARGETS' Megatron names): how many of pipeline
    `stage`'s language layers hold it: the MLP's every layer, the attention's the softmax-attention
    layers, a gated DeltaNet's in_proj and out_proj the linear-attention layers."""
    from models.stages import stage_layers

    counts = stage_layers(spec.num_layers, pp, layers)
    start = sum(counts[:stage])
    kinds = linear_layers(spec)[start:start + counts[stage]]
    attention, deltanet = sum(not linear for linear in kinds), sum(kinds)
    return {"self_attention.linear_qkv": attention, "self_attention.linear_proj": attention,
            "self_attention.in_proj": deltanet, "self_attention.out_proj": deltanet,
            "mlp.linear_fc1": counts[stage], "mlp.linear_fc2": counts[stage],
            "mlp.experts.linear_fc1": counts[stage], "mlp.experts.linear_fc2": counts[stage]}


# the Megatron linears of one routed expert (models/lora.py's target `experts`, key mlp.experts)
EXPERT_LINEARS = ("mlp.experts.linear_fc1", "mlp.experts.linear_fc2")


def targeted_linears(lora) -> list[str]:
    """The adaptable linears (`adaptable_linears`' keys) `lora` gives an adapter: its Megatron
    linears, the routed experts' as one expert's fc1 and fc2."""
    return sorted(set(lora.linears) - {"mlp.experts"}) + (list(EXPERT_LINEARS) if "mlp.experts" in lora.linears else [])


