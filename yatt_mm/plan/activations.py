"""Activation memory of a micro-batch's forward and backward on one TP rank of one pipeline
stage, tensor by tensor in the form of Korthikanti et al.'s per-layer formula for Megatron
("Reducing Activation Recomputation in Large Transformer Models", 2022: s*b*h*(34 + 5*a*s/h)
bytes a layer), with the terms of this model (GQA, SwiGLU, M-RoPE, fp32 softmax, no dropout) and
the recompute setting; for Qwen3-VL also the per-head q/k norms, the vision tower's learned
position table and the DeepStack mergers (spec fields as yatt_mm/plan/params.py reads them).

Mixture of experts (Qwen3-VL-MoE: Megatron's MoE layer, all-to-all dispatcher, SequentialMLP
experts): each token is copied to its top-k experts, so a layer keeps the permuted copies
(tokens x top-k x hidden, the experts' input), each expert's SwiGLU tensors for the copies it
receives (balanced routing assumed: top-k copies of every token arrive on some rank), the
router's input, logits and scores, and the dispatcher's indices.

Context parallelism (models/context.py): a rank's language layers see padded / cp positions of
each row; with all_gather core attention gathers K and V (kept whole for the backward pass), and
the micro-batch's additive masks of the local chunks are kept once; with a2a it keeps 1/cp of the
heads of the whole rows' Q, K and V, as many elements as its own positions of every head, and no
mask; the token ids stay whole; the vision tower runs this rank's share of the frames."""

from __future__ import annotations

from dataclasses import dataclass

from models.stages import stage_layers
from yatt_mm.plan.batch import MicroBatchShape, context_share
from yatt_mm.plan.constants import ACTIVATION_CALIBRATION



@dataclass(frozen=True)
class Kernels:
    """The kernels whose memory differs between CUDA and CPU (torch 2.13): torch.rms_norm keeps
    its input and rstd on CUDA (fused kernel) but fp32 copies of the input and the normalised
    input on CPU (composite). Qwen3.5's gated DeltaNet: fla's chunked delta rule and
    causal_conv1d's conv with its SiLU fused on CUDA, Megatron's pure-torch fallbacks on CPU.
    (Adam runs fused on both, models/optimizer.py: updates in place, no temporaries the size of
    the state.)"""

    name: str
    fused_rms_norm: bool
    fla: bool = False  # the gated delta rule and the conv from fla / causal_conv1d


CUDA = Kernels("cuda", fused_rms_norm=True, fla=True)
CPU = Kernels("cpu", fused_rms_norm=False)

# Megatron's pure-torch gated delta rule (no fla: the CPU) keeps its chunk-wise intermediates in
# fp32, whatever the model's dtype: measured 2456 elements per value head and token on
# bench_long_context.py's Qwen3.5 (head dims 64, chunks of 64; 2k and 4k tokens alike). A
# constant of that fallback at those dims, not a formula; fla's kernel is (`deltanet_mixer_bytes`).
TORCH_DELTA_RULE_ELEMS_PER_HEAD = 2456


@dataclass(frozen=True)
class Block:
    """One transformer layer on one TP rank: the widths and element counts its saved tensors have."""

    tokens: int  # rows of the layer's [s, b] input
    hidden: int  # whole on every rank (no sequence parallelism)
    q: int  # query width on this rank
    kv: int  # key/value width on this rank
    ffn: int  # MLP width on this rank (one half of a gated fc1)
    head_dim: int
    gated: bool
    rms: bool  # RMSNorm, else LayerNorm
    rope_rows: int  # rows of the rotary cos/sin tensors
    qk_norm: bool = False  # an RMSNorm over each query and key head before the rotary embedding (Qwen3)
    # MLP-width tensors kept: fc1's output (2 halves if gated) and what the activation keeps
    # (0: the default, 5 gated SiLU, 3 Qwen2-VL's quick_gelu x * sigmoid(1.702 x))
    mlp_kept: int = 0
    # context parallelism: the K/V rows core attention gathers and keeps (the whole rows; 0: no
    # CP, K and V are this rank's own) and the elements of the additive masks of a row's two
    # local chunks (models/context.py: chunk j against the keys up to its end), shared by all rows
    # and layers
    kv_tokens: int = 0
    mask_elems: int = 0
    heads_exchanged: int = 0  # context parallelism by all-to-all (a2a): its CP size (whole rows, 1/cp of the heads)
    # mixture of experts: experts per layer (0: a dense MLP of width `ffn`) and top-k; `ffn` is
    # then one expert's width
    experts: int = 0
    topk: int = 0
    shared_ffn: int = 0  # a shared expert's width on this rank (Qwen3.5-MoE; 0: none)
    output_gate: bool = False  # attention's output gated by sigmoid of a second query projection (Qwen3.5)


def _norm_bytes(n: int, h: int, e: int, rms: bool, kernels: Kernels) -> int:
    """A norm's input and output (the next linear keeps the output), plus its statistics."""
    if rms and not kernels.fused_rms_norm:
        return n * h * (8 + e) + 4 * n  # composite: fp32 input and normalised input, the output in e
    return 2 * n * h * e + (4 if rms else 8) * n


def _core_attention_bytes(b: Block, e: int) -> int:
    """torch's attention kernel (models/attention.py) keeps its inputs (Q and K after the rotary
    embedding, V as a view that keeps the whole fused QKV output; grouped K and V are not
    expanded), its output (the output projection's input, a view of it, counted there) and one
    fp32 log-sum-exp per head and query: no s x s scores. Under context parallelism:
    - all_gather: Q, the gathered K and V of the whole rows (each chunk's keys a view of them)
      and each chunk's output (apart from their concatenation, the projection's input); this
      rank's own K and V are not kept, and the masks are made once per micro-batch (`_saved_bytes`);
    - a2a: Q, K and V of the whole rows for 1/cp of the heads (as many elements as this rank's
      positions of every head; with fewer key/value groups than ranks, one group's K and V of the
      whole rows) and the output, which the exchange back copies;
    and with Qwen3's q/k norms, whose inputs are views of the fused QKV output, that output
    whole. (Measured at CP 2 on bench_long_context.py's model: the plan 5% under the saved
    bytes both ways.)"""
    lse = 4 * b.tokens * (b.q // b.head_dim)
    if b.kv_tokens:
        kept = 2 * b.tokens * b.q + b.kv_tokens * 2 * b.kv
    elif b.heads_exchanged:
        kv = max(b.kv, b.heads_exchanged * b.head_dim)  # fewer groups than ranks: a group's copy each
        kept = b.tokens * (b.q + 2 * kv) + b.tokens * b.q
    else:
        return _recomputed_core_bytes(b, e) + lse
    return (kept + (b.tokens * (b.q + 2 * b.kv) if b.qk_norm else 0)) * e + lse


def _recomputed_core_bytes(b: Block, e: int) -> int:
    """Selective recompute keeps only core attention's inputs: Q, K and the QKV output V views."""
    return b.tokens * (b.q + b.kv + b.q + 2 * b.kv) * e


def _qk_norm_bytes(b: Block, e: int, kernels: Kernels) -> int:
    """Qwen3's q/k norms: their input is a view of the QKV output (kept for V anyway) and their
    output only feeds the rotary product (which keeps its cos and sin, not its input). So the
    fused kernel (CUDA) adds its rstd per head and row; the composite (CPU) also keeps the
    normalised fp32 tensor (the weight's gradient needs it) and, for bf16, the fp32 copy of the
    input (measured on the tiny model: 5 head-sized tensors a layer at fp32 with q = kv)."""
    if not b.qk_norm:
        return 0
    rows = b.tokens * (b.q + b.kv) // b.head_dim
    if kernels.fused_rms_norm:
        return 4 * rows
    return b.tokens * (b.q + b.kv) * (4 if e == 4 else 8) + 4 * rows


def layer_bytes(b: Block, e: int, kernels: Kernels, recompute: str) -> int:
    """Bytes one layer keeps for its backward pass: the per-layer term of the formula."""
    if recompute == "full":
        return b.tokens * b.hidden * e  # only the layer's input; the rest is recomputed
    core = _recomputed_core_bytes(b, e) if recompute == "selective" else _core_attention_bytes(b, e)
    mlp = _mlp_bytes(b, e)
    # (the rotary cos and sin are one pair for all layers: `_rotary_bytes`); the q/k norms run
    # before core attention, so selective recompute keeps theirs
    # gated attention: the fused QKV output holds the gate too, and the gating keeps the gate's
    # sigmoid and the attention output
    gate = 3 * b.tokens * b.q * e if b.output_gate and recompute != "full" else 0
    return (2 * _norm_bytes(b.tokens, b.hidden, e, b.rms, kernels) + core + b.tokens * b.q * e + mlp
            + _qk_norm_bytes(b, e, kernels) + gate)


def _mlp_bytes(b: Block, e: int) -> int:
    """A dense MLP keeps fc1's output, the activation's tensors and the product (fc2's input).
    A MoE layer (Megatron 0.16, alltoall dispatcher, SequentialMLP; measured on the tiny model):
    the router's per-token expert scores, the permuted copies (`dispatched_bytes`),
    each expert's fc1 output (2 halves), two SiLU tensors, the product, the product scaled by the
    routing probability (fc2's input), and the dispatcher's index tensors."""
    if not b.experts:
        return (b.mlp_kept or (5 if b.gated else 3)) * b.tokens * b.ffn * e  # fc1 output, activation, product
    routed = b.tokens * b.topk
    router = b.tokens * b.experts * 9  # fp32 logits and scores, the bool routing map (its input: the norm's output)
    indexes = routed * 32  # int64 top-k and permutation indexes, fp32 top-k and permuted probabilities
    # a shared expert: a dense SwiGLU MLP's tensors, its output and its sigmoid gate kept by their product
    shared = (5 * b.shared_ffn + b.hidden + 2) * b.tokens * e if b.shared_ffn else 0
    return router + dispatched_bytes(b, e) + 6 * routed * b.ffn * e + indexes + shared


def dispatched_bytes(b: Block, e: int) -> int:
    """The token copies one MoE layer sends to its experts and keeps (the experts' fc1 input):
    tokens x top-k x hidden. Under expert parallelism as many arrive as leave when the routing
    is balanced; a skewed routing brings more to the rank of the popular experts."""
    return b.tokens * b.topk * b.hidden * e


@dataclass(frozen=True)
class DeltaNetBlock:
    """One gated DeltaNet mixer (Qwen3.5's linear-attention layers) on one TP rank."""

    tokens: int  # this rank's positions (under CP the rank runs 1/CP of the heads over every
    # position: as many elements)
    chunked_tokens: int  # the same, each row padded to whole chunks of 64 (the pure-torch rule pads)
    key_heads: int
    value_heads: int
    key_dim: int
    value_dim: int


def deltanet_block(spec, shape: MicroBatchShape, tp: int) -> DeltaNetBlock:
    return DeltaNetBlock(tokens=shape.tokens, chunked_tokens=shape.rows * -(-shape.seq // 64) * 64,
                         key_heads=spec.linear_num_key_heads // tp,
                         value_heads=spec.linear_num_value_heads // tp, key_dim=spec.linear_key_head_dim,
                         value_dim=spec.linear_value_head_dim)


def deltanet_mixer_bytes(d: DeltaNetBlock, e: int, kernels: Kernels) -> int:
    """What Megatron's GatedDeltaNet.forward keeps between its input projection's input and its
    output projection (run eagerly), per token:
    - the conv's input, a contiguous copy of in_proj's q, k and v (and on CPU the conv's output,
      which the separate SiLU keeps; causal_conv1d fuses it);
    - the q/k L2 norm's q and k (Megatron's: its inputs; fla's: its outputs) and the decay and
      beta's small fp32 terms;
    - the delta rule: fla keeps q and k (copied out to the value heads where they are more), v,
      g's fp32 cumulative sum and the chunk-local A (64 a head and token); the CPU fallback
      `TORCH_DELTA_RULE_ELEMS_PER_HEAD` in fp32;
    - its output, the gated norm's rstd, z and SiLU(z) in fp32, the normalised output, and the
      output projection's input.
    Measured on CPU (bench_long_context.py's Qwen3.5, fp32, T 2k-4k): every part but the CPU
    delta rule within 1% of these terms. fla's part is read from its save_for_backward, not
    measured (no GPU has run it)."""
    hk, h = d.key_heads, d.value_heads
    qk, v = hk * d.key_dim, h * d.value_dim
    conv = (2 * qk + v) * e * (1 if kernels.fla else 2)
    norms = 2 * qk * e + h * (8 + e)
    out = v * (3 * e + 8) + 4 * h
    if kernels.fla:
        rule = ((2 * h * d.key_dim if h > hk else 0) + v + 64 * h) * e + 4 * h
        return d.tokens * (conv + norms + rule + out)
    return d.tokens * (conv + norms + out) + d.chunked_tokens * 4 * h * TORCH_DELTA_RULE_ELEMS_PER_HEAD


def deltanet_layer_bytes(lm: Block, d: DeltaNetBlock, e: int, kernels: Kernels, recompute: str) -> int:
    """A Qwen3.5 DeltaNet layer: its two norms and MLP as an attention layer's (`lm`), the mixer
    in place of attention. Selective recompute reruns core attention only: none of the mixer."""
    if recompute == "full":
        return lm.tokens * lm.hidden * e
    return 2 * _norm_bytes(lm.tokens, lm.hidden, e, lm.rms, kernels) + deltanet_mixer_bytes(d, e, kernels) + _mlp_bytes(lm, e)


def _stage_layer_kinds(spec, pp: int, stage: int, layers: tuple[int, ...]) -> tuple[int, int]:
    """(attention layers, DeltaNet layers) of pipeline `stage` (Qwen3.5 mixes them as its
    `layer_types` say; the other families have only attention)."""
    counts = stage_layers(spec.num_layers, pp, layers)
    linear = tuple(getattr(spec, "linear_layers", ()))
    if not linear:
        return counts[stage], 0
    first = sum(counts[:stage])
    n_linear = sum(linear[first:first + counts[stage]])
    return counts[stage] - n_linear, n_linear


def _rotary_bytes(b: Block, e: int, recompute: str) -> int:
    """The rotary cos and sin, computed once per forward and kept by every layer's Q and K
    products (models/rotary.py); none kept inside layers that full recompute runs again."""
    return 0 if recompute == "full" else 2 * b.rope_rows * b.head_dim * e


def _chunk_mask_elems(padded: int, cp: int) -> int:
    """Rank r's chunks r and 2cp-1-r attend (r + 1) c and (2cp - r) c keys (c = padded / 2cp):
    (2cp + 1) c^2 mask elements on every rank; none without CP (a causal kernel, no mask)."""
    c = padded // (2 * cp)
    return (2 * cp + 1) * c * c if cp > 1 else 0


def language_block(spec, shape: MicroBatchShape, tp: int, cp: int = 1, cp_comm: str = "all_gather") -> Block:
    """A language layer on one TP rank; `shape` this CP rank's share (batch.context_share)."""
    hd, experts = spec.head_dim, getattr(spec, "num_experts", 0)
    ffn = spec.moe_intermediate_size if experts else spec.intermediate_size
    gathers = cp > 1 and cp_comm == "all_gather"
    return Block(tokens=shape.tokens, hidden=spec.hidden_size, q=spec.num_heads // tp * hd,
                 kv=max(1, spec.num_kv_heads // tp) * hd, ffn=ffn // tp, head_dim=hd, gated=True,
                 rms=True, rope_rows=shape.tokens, qk_norm=getattr(spec, "qk_norm", False),
                 kv_tokens=shape.tokens * cp if gathers else 0,
                 mask_elems=_chunk_mask_elems(shape.seq * cp, cp) if gathers else 0,
                 heads_exchanged=cp if cp > 1 and cp_comm == "a2a" else 0,
                 experts=experts, topk=getattr(spec, "num_experts_per_tok", 0),
                 shared_ffn=getattr(spec, "shared_expert_intermediate_size", 0) // tp,
                 output_gate=getattr(spec, "attention_output_gate", False))


def vision_block(spec, shape: MicroBatchShape, tp: int) -> Block:
    """Qwen2-VL and Qwen3-VL attend within each frame (frames of one size run as a batch, one
    frame's rotary angles); Qwen2.5-VL within windows or frames, units of one size as a batch,
    with every patch's angles (`spec.vision_windowed`, models/qwen2vl/vision.py)."""
    merge = spec.spatial_merge_size**2
    patches, frame = shape.media_tokens * merge, shape.frame_tokens * merge
    hv, heads = spec.vision_embed_dim, spec.vision_heads // tp
    hd = hv // spec.vision_heads
    return Block(tokens=patches, hidden=hv, q=heads * hd, kv=heads * hd, ffn=spec.vision_ffn // tp, head_dim=hd,
                 gated=spec.vision_gated, rms=spec.vision_rms_norm, rope_rows=patches if spec.vision_windowed else frame,
                 # a one-op GELU (Qwen3-VL) keeps its input, fc1's output: 2 with fc2's input
                 mlp_kept=2 if getattr(spec, "vision_act", "") == "gelu_pytorch_tanh" else 0)


@dataclass(frozen=True)
class Activations:
    saved: int  # kept for the backward pass at the end of the forward
    peak: int  # the most alive at once in the forward and backward (saved tensors and temporaries)
    forward_only: int  # peak of a no-grad forward (the logprobs phase)
    # mixture of experts: of `saved`, the token copies the dispatcher sent to the experts (all
    # the stage's layers and in-flight micro-batches), and the all-to-all's receive buffer of
    # one layer, alive beside them while a layer dispatches
    dispatched: int = 0
    dispatch_in_flight: int = 0


def _saved_bytes(spec, shape: MicroBatchShape, tp: int, e: int, recompute: str, kernels: Kernels,
                 pp: int = 1, stage: int = 0, layers: tuple[int, ...] = (), cp: int = 1,
                 cp_comm: str = "all_gather", vision_trained: bool = True) -> int:
    """What one micro-batch's forward on pipeline `stage` keeps for the backward, but the loss's
    own part (the sum over the stage's layers of the per-layer formula, plus on the first stage
    the embeddings, pixels and patch merger, on the last the final norm). `shape`: this CP
    rank's share (batch.context_share). A frozen vision tower (`vision_trained` False: LoRA on
    the language model, policy.freeze_vision) keeps nothing: no gradient reaches it."""
    lm, vis = language_block(spec, shape, tp, cp, cp_comm), vision_block(spec, shape, tp)
    n, first, last = shape.tokens, stage == 0, stage == pp - 1
    n_attention, n_linear = _stage_layer_kinds(spec, pp, stage, layers)
    saved = n_attention * layer_bytes(lm, e, kernels, recompute) + _rotary_bytes(lm, e, recompute)
    if n_linear:
        saved += n_linear * deltanet_layer_bytes(lm, deltanet_block(spec, shape, tp), e, kernels, recompute)
    saved += 9 * n * cp  # token ids, media mask: the whole rows on every CP rank
    saved += lm.mask_elems * e  # CP: the chunks' additive masks, made once per micro-batch (models/context.py)
    if last:
        saved += _norm_bytes(n, spec.hidden_size, e, True, kernels)  # the final norm
    if recompute == "full":
        # the rotary angles, kept once as an input of every checkpoint (Qwen3.5: over its rotary part)
        saved += n * getattr(spec, "rotary_dim", spec.head_dim) * 4
    if shape.media_tokens and first and vision_trained:
        patches = vis.tokens
        # Qwen2.5-VL: the angles in window order and in frame order, each kept once
        rotary = _rotary_bytes(vis, e, recompute) * (2 if spec.vision_windowed else 1)
        saved += spec.vision_depth * layer_bytes(vis, e, kernels, recompute) + rotary
        saved += patches * spec.in_channels * spec.temporal_patch_size * spec.patch_size**2 * e  # pixel values
        saved += _norm_bytes(patches, vis.hidden, e, spec.vision_rms_norm, kernels) + 2 * patches * vis.hidden * e  # merger
        saved += 8 * patches * (2 if spec.vision_windowed else 1)  # int64 patch order by frame (and by window)
        saved += _vision_extras_bytes(spec, patches, vis.hidden, e, kernels)
    return saved


def _vision_extras_bytes(spec, patches: int, hv: int, e: int, kernels: Kernels) -> int:
    """Qwen3-VL's vision extras (none for Qwen2-VL): the learned position table's resampling
    keeps its int64 indexes and fp32 weights (4 taps a patch; an upper bound for video, whose
    frames share them), and each DeepStack merger keeps its LayerNorm's input and output over
    the merged 4 x width vectors with their statistics, and its fc1 and GELU outputs."""
    out = 48 * patches if getattr(spec, "num_position_embeddings", 0) else 0
    merged = patches // spec.spatial_merge_size**2
    merger = _norm_bytes(merged, hv * spec.spatial_merge_size**2, e, False, kernels) + 2 * patches * hv * e
    return out + getattr(spec, "num_deepstack", 0) * merger


def _recomputed_layer_bytes(spec, shape: MicroBatchShape, tp: int, e: int, recompute: str, kernels: Kernels,
                            vision: bool = True, cp: int = 1, cp_comm: str = "all_gather") -> int:
    """What comes back during one layer's backward under recompute: the whole layer (full), its
    core attention (selective); the largest of the language (Qwen3.5: DeltaNet layers too) and
    (with `vision`) vision layers."""
    blocks = [language_block(spec, shape, tp, cp, cp_comm)] + ([vision_block(spec, shape, tp)] if shape.media_tokens and vision
                                                      else [])
    if recompute == "full":
        whole = [layer_bytes(b, e, kernels, "none") for b in blocks]
        if any(getattr(spec, "linear_layers", ())):
            whole.append(deltanet_layer_bytes(blocks[0], deltanet_block(spec, shape, tp), e, kernels, "none"))
        return max(whole)
    if recompute == "selective":  # the attention output and its log-sum-exp come back
        return max(_core_attention_bytes(b, e) - _recomputed_core_bytes(b, e) + b.tokens * b.q * e for b in blocks)
    return 0


def activation_bytes(spec, shape: MicroBatchShape, tp: int, e: int, recompute: str,
                     kernels: Kernels = CUDA, pp: int = 1, stage: int = 0,
                     layers: tuple[int, ...] = (), cp: int = 1, cp_comm: str = "all_gather",
                     vision_trained: bool = True) -> Activations:
    """Activation memory of the forward and backward of micro-batches on one TP rank of pipeline
    `stage`. On the last stage (the whole model without PP) the peak is the largest of three
    moments: the end of the forward (logits and the loss alive), the output layer's backward (the
    loss's softmax freed; the logits' gradient, its contiguous copy when rows > 1, the output
    weight's and the input's gradients alive), and a layer's recompute. Under 1F1B, stage s runs
    pp - s micro-batches' forwards before their first backward, so it keeps that many. With
    context parallelism (`cp`), all of it for the fullest CP rank's share of the rows."""
    shape = context_share(shape, cp)
    n, vocab, h = shape.tokens, spec.vocab_size // tp, spec.hidden_size
    body = _saved_bytes(spec, shape, tp, e, recompute, kernels, pp, stage, layers, cp, cp_comm, vision_trained)
    lm = language_block(spec, shape, tp, cp, cp_comm)
    in_flight = dispatched_bytes(lm, e) if lm.experts else 0
    kept = 0 if recompute == "full" or not lm.experts else stage_layers(spec.num_layers, pp, layers)[stage] * in_flight
    c = ACTIVATION_CALIBRATION
    if stage < pp - 1:
        held = (pp - stage) * body
        hidden = 2 * n * h * e  # the hidden states received and sent (or their gradients)
        recomputing = _recomputed_layer_bytes(spec, shape, tp, e, recompute, kernels, stage == 0 and vision_trained, cp,
                                              cp_comm)
        return Activations(saved=int(c * held), peak=int(c * (held + hidden + max(recomputing, in_flight))),
                           forward_only=int(c * hidden), dispatched=(pp - stage) * kept, dispatch_in_flight=in_flight)
    loss = shape.scored * vocab * 4  # the fp32 softmax of the scored positions (vocab-parallel cross entropy)
    logits = n * vocab * e
    end_of_forward = body + loss + logits + shape.scored * vocab * e  # the logits and the scored rows picked
    output_backward = body + logits * (2 if shape.rows > 1 else 1) + vocab * h * e + n * h * e
    recomputing = body + max(_recomputed_layer_bytes(spec, shape, tp, e, recompute, kernels, vision_trained, cp,
                                                     cp_comm), in_flight)
    forward_only = logits + shape.scored * vocab * (e + 8)  # logits; the scored rows and their fp32 copies
    return Activations(saved=int(c * (body + loss)), peak=int(c * max(end_of_forward, output_backward, recomputing)),
                       forward_only=int(c * forward_only), dispatched=kept, dispatch_in_flight=in_flight)
