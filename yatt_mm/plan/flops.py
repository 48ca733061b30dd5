"""The training FLOPs of a micro-batch, for time estimates: 6 x the parameters each token
multiplies by (forward 2, backward 4) plus causal attention's. A mixture-of-experts token
multiplies by its top-k experts only (`params.active_params`), so a 30B-A3B model costs about
what a 3B dense model does a token, while its memory is the 30B model's."""

from __future__ import annotations

from collections.abc import Sequence

from yatt_mm.plan.batch import MicroBatchShape
from yatt_mm.plan.params import active_params, linear_layers, param_counts


def train_flops(spec, shape: MicroBatchShape, tp: int = 1, cp: int = 1) -> int:
    """Forward and backward FLOPs of `shape` on one GPU of TP x CP ranks: the language model's
    matmuls over every token (the output layer's included, the embedding lookup not) and causal
    attention's two s x s products per layer and row (a hybrid model's DeltaNet layers: their
    state products, linear in s), split over TP and CP; the vision tower's
    matmuls over the patches with its attention within each frame (Qwen2.5-VL's windows attend
    less: an upper bound there), split over TP, and over CP when there are at least CP frames
    (models/context.py splits them). An estimate from the architecture, not a measurement."""
    merge = spec.spatial_merge_size ** 2
    patches, frame = shape.media_tokens * merge, shape.frame_tokens * merge
    language = language_forward_flops(spec, [shape.seq] * shape.rows)
    vision = vision_forward_flops(spec, patches, [frame] * (patches // max(frame, 1)))
    vision_cp = cp if patches // max(frame, 1) >= cp else 1
    return 3 * (language // (tp * cp) + vision // (tp * vision_cp))


def language_forward_flops(spec, rows: Sequence[int]) -> int:
    """Forward FLOPs of the language model on rows of these token counts (train_flops' terms;
    scripts/gpu_check.py counts a real batch's rows with it)."""
    full = param_counts(spec)
    # the input embedding's lookup is no matmul (tied: its one table is also the output layer)
    lookup = 0 if spec.tie_word_embeddings else spec.vocab_size * spec.hidden_size
    language = active_params(spec) - full.vision - lookup
    q = spec.num_heads * spec.head_dim
    linear = linear_layers(spec).count(True)
    tokens = sum(rows)
    # QK^T and AV: 2 x 2 x s^2 x q a softmax-attention layer and row, half of it under the causal mask
    attention = (spec.num_layers - linear) * sum(2 * n ** 2 * q for n in rows)
    if linear:  # a gated DeltaNet's state products a token and value head (dk x dv each): the
        # readout q S, the delta's k S and the update k^T v, 2 FLOPs a multiply-add
        attention += linear * tokens * 3 * 2 * spec.linear_num_value_heads * (
            spec.linear_key_head_dim * spec.linear_value_head_dim)
    return 2 * language * tokens + attention


def vision_forward_flops(spec, patches: int, frames: Sequence[int]) -> int:
    """Forward FLOPs of the vision tower on `patches` patches, attending within frames of these
    patch counts (train_flops' terms; scripts/gpu_check.py: each distinct image one frame)."""
    return 2 * param_counts(spec).vision * patches + sum(4 * spec.vision_depth * n ** 2 * spec.vision_embed_dim
                                                         for n in frames)
