"""`yatt-mm plan`: how much GPU and host memory an RL config needs, per phase and per GPU,
before any GPU is spent on finding out.

The numbers come from the architecture (the policy's config.json, or a built-in table of the
published Qwen2-VL / Qwen2.5-VL configs) and the config's settings:

- trainer weights, the DDP gradient buffer (fp32: `grad_reduce_in_fp32=True`, models/trainer.py)
  and Adam's state (m and v in fp32, plus fp32 master weights for bf16; divided by DP with the
  distributed optimizer, which shards it over the DP group), all per tensor-parallel rank,
  counted parameter by parameter as models/qwen2vl/model.py + vision.py lay them out;
- activations, counted tensor by tensor in the form of Korthikanti et al.'s per-layer formula
  for Megatron ("Reducing Activation Recomputation in Large Transformer Models", 2022:
  s*b*h*(34 + 5*a*s/h) bytes a layer), with the terms of this model (GQA, SwiGLU, M-RoPE, fp32
  softmax, no dropout) and the recompute setting; one constant, `ACTIVATION_CALIBRATION`, is
  measured on real train steps by benchmarks/bench_memory_plan.py;
- vLLM engines: their share of the GPU (`gpu_memory_utilization`), split into weights, KV cache
  and a reserve; judge servers, which stay resident on their GPU in every phase;
- which role holds what in each phase, from the placement plan (yatt_mm/rl/placement.py): with
  offload, the trainer waits in host memory during rollout and vLLM sleeps during training.

Calibrated on CPU only: two kernels keep different tensors on CUDA (`Kernels`), and the vLLM and
CUDA overheads below are estimates, not measurements.
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

GIB = 2**30

# Scales the activation count. benchmarks/bench_memory_plan.py fits it (median measured/planned
# peak over its activation-bound configs, on CPU): 0.99, with every config within 4%. The count
# is tensor by tensor, so the fit leaves nothing to correct beyond that spread: kept at 1.0.
ACTIVATION_CALIBRATION = 1.0
# Estimates (no GPU was available to measure them):
CUDA_CONTEXT_GIB = 0.5  # each process that uses a GPU: CUDA context, cuBLAS workspace, NCCL buffers
ALLOCATOR_SLACK = 0.05  # the caching allocator's fragmentation, as a share of the trainer's peak
VLLM_RESERVE_GIB = 2.5  # inside an engine's share, besides weights and KV cache: profiled forward peak, CUDA graphs
VLLM_ASLEEP_GIB = 0.5  # what a sleeping vLLM engine keeps on its GPU (graph pool, allocator blocks)
PROMPT_TEXT_TOKENS = 128  # text of a prompt besides its media (question, chat template)
VLLM_DTYPE_BYTES = 2  # vLLM runs bf16 on GPUs (engines/engine.py)
JUDGE_SERVER_MAX_MODEL_LEN = 2048  # engines/server.py starts judge servers with this


class PlanError(ValueError):
    pass


# --- architectures ---------------------------------------------------------------------------

# The published config.json numbers of the Qwen2-VL and Qwen2.5-VL Instruct checkpoints:
# (model_type, hidden_size, intermediate_size, num_hidden_layers, num_attention_heads,
#  num_key_value_heads, vocab_size, tie_word_embeddings, vision intermediate_size (Qwen2.5-VL)).
# The vision towers: Qwen2-VL depth 32, embed_dim 1280, mlp_ratio 4, num_heads 16; Qwen2.5-VL
# depth 32, hidden_size 1280, num_heads 16, window_size 112, full attention in blocks 7/15/23/31;
# both patch 14, spatial merge 2, temporal patch 2, out width = the LLM's hidden_size.
KNOWN_MODELS = {
    "Qwen/Qwen2-VL-2B-Instruct": ("qwen2_vl", 1536, 8960, 28, 12, 2, 151936, True, 0),
    "Qwen/Qwen2-VL-7B-Instruct": ("qwen2_vl", 3584, 18944, 28, 28, 4, 152064, False, 0),
    "Qwen/Qwen2-VL-72B-Instruct": ("qwen2_vl", 8192, 29568, 80, 64, 8, 152064, False, 0),
    "Qwen/Qwen2.5-VL-3B-Instruct": ("qwen2_5_vl", 2048, 11008, 36, 16, 2, 151936, True, 3420),
    "Qwen/Qwen2.5-VL-7B-Instruct": ("qwen2_5_vl", 3584, 18944, 28, 28, 4, 152064, False, 3420),
    "Qwen/Qwen2.5-VL-72B-Instruct": ("qwen2_5_vl", 8192, 29568, 80, 64, 8, 152064, False, 3456),
}


def known_hf_config(model_id: str) -> dict:
    """The table row of `model_id` as a config.json (transformers 4.x layout, as published)."""
    kind, hidden, inter, layers, heads, kv, vocab, tie, vision_inter = KNOWN_MODELS[model_id]
    vision = dict(depth=32, num_heads=16, patch_size=14, spatial_merge_size=2, temporal_patch_size=2, in_chans=3)
    if kind == "qwen2_vl":
        vision.update(embed_dim=1280, mlp_ratio=4, hidden_size=hidden)
    else:
        vision.update(hidden_size=1280, intermediate_size=vision_inter, out_hidden_size=hidden, window_size=112,
                      fullatt_block_indexes=[7, 15, 23, 31], tokens_per_second=2, hidden_act="silu")
    return dict(model_type=kind, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                num_attention_heads=heads, num_key_value_heads=kv, vocab_size=vocab, tie_word_embeddings=tie,
                rms_norm_eps=1e-6, rope_theta=1000000.0, rope_scaling={"type": "mrope", "mrope_section": [16, 24, 24]},
                image_token_id=151655, video_token_id=151656, vision_start_token_id=151652, vision_config=vision)


def spec_from_hf_config(config: dict):
    """A config.json mapping read by the trainer's own parser (Qwen2VLSpec.from_hf_dir), so the
    table is read exactly as a checkpoint on disk would be."""
    from models.qwen2vl.config import Qwen2VLSpec

    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(config))
        return Qwen2VLSpec.from_hf_dir(tmp)


def load_spec(model: str):
    """The architecture (models.qwen2vl.config.Qwen2VLSpec) of a model setting: see resolve_model."""
    return resolve_model(model)[0]


def resolve_model(model: str):
    """(architecture, where it came from) of a model setting: a directory with config.json,
    tiny:KIND or warmstart:KIND (the tiny model's architecture; built offline, cached), or a
    known HF id or a path whose last part is a known model's name (/models/Qwen2-VL-7B-Instruct)."""
    from models.qwen2vl.config import Qwen2VLSpec

    if model.startswith(("tiny:", "warmstart:")):
        from models.tiny import tiny_model_dir

        return Qwen2VLSpec.from_hf_dir(tiny_model_dir(model.split(":", 1)[1])), "the tiny model's config.json"
    if (Path(model) / "config.json").is_file():
        return Qwen2VLSpec.from_hf_dir(model), "its config.json"
    name = model.rstrip("/").split("/")[-1]
    for model_id in KNOWN_MODELS:
        if model == model_id or name == model_id.split("/")[-1]:
            return spec_from_hf_config(known_hf_config(model_id)), f"built-in table: {model_id}"
    raise PlanError(f"model {model!r}: no config.json there and not a known model; give its HF directory, or a "
                    f"known id or a directory named like one: {', '.join(KNOWN_MODELS)}")


# --- parameters --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Params:
    """Parameter counts on one tensor-parallel rank (tp=1: the whole model)."""

    vision: int
    language: int
    largest: int  # the largest single parameter tensor (Adam's per-tensor temporaries on CPU)

    @property
    def total(self) -> int:
        return self.vision + self.language


def _column(n_in: int, n_out: int, tp: int, bias: bool) -> list[int]:
    """ColumnParallelLinear: output rows (and bias) split over TP."""
    return [n_out // tp * n_in] + ([n_out // tp] if bias else [])


def _row(n_in: int, n_out: int, tp: int, bias: bool) -> list[int]:
    """RowParallelLinear: input columns split over TP; the bias is whole on every rank."""
    return [n_out * (n_in // tp)] + ([n_out] if bias else [])


def _language_layer(spec, tp: int) -> list[int]:
    h, q, kv = spec.hidden_size, spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    return ([h, h]  # input and pre-MLP RMSNorm weights, whole on every rank
            + _column(h, q + 2 * kv, tp, bias=True) + _row(q, h, tp, bias=False)
            + _column(h, 2 * spec.intermediate_size, tp, bias=False) + _row(spec.intermediate_size, h, tp, bias=False))


def _vision_layer(spec, tp: int) -> list[int]:
    hv = spec.vision_embed_dim
    norms = [hv, hv] if spec.is_qwen25 else [hv, hv, hv, hv]  # RMSNorm: weight; LayerNorm: weight and bias
    fc1 = 2 * spec.vision_intermediate_size if spec.is_qwen25 else int(hv * spec.vision_mlp_ratio)
    ffn = spec.vision_intermediate_size if spec.is_qwen25 else fc1
    return (norms + _column(hv, 3 * hv, tp, bias=True) + _row(hv, hv, tp, bias=True)
            + _column(hv, fc1, tp, bias=True) + _row(ffn, hv, tp, bias=True))


def _vision_ends(spec) -> list[int]:
    """Patch embedding and patch merger: plain nn.Linear, whole on every TP rank."""
    hv, merged = spec.vision_embed_dim, spec.vision_embed_dim * spec.spatial_merge_size**2
    patch = spec.in_channels * spec.temporal_patch_size * spec.patch_size**2
    ln_q = [hv] if spec.is_qwen25 else [hv, hv]
    return [hv * patch] + ln_q + [merged * merged, merged, spec.hidden_size * merged, spec.hidden_size]


def param_counts(spec, tp: int = 1, pp: int = 1, stage: int = 0) -> Params:
    """Parameters of this rank's shard of the Megatron Qwen2-VL (models/qwen2vl/model.py): its TP
    shard of pipeline `stage` (pp=1: the whole model). The first stage holds the vision tower and
    the embedding, the last the final norm and the output layer (with tied embeddings and more
    than one stage, the last keeps its own copy of the embedding as the output layer)."""
    vocab, h = spec.vocab_size, spec.hidden_size
    first, last = stage == 0, stage == pp - 1
    lm_ends = (([vocab // tp * h] if first else []) + ([h] if last else [])
               + ([vocab // tp * h] if last and not (spec.tie_word_embeddings and first) else []))
    lm_layer, v_layer, v_ends = _language_layer(spec, tp), _vision_layer(spec, tp), _vision_ends(spec)
    vision = spec.vision_depth * sum(v_layer) + sum(v_ends) if first else 0
    return Params(vision=vision, language=spec.num_layers // pp * sum(lm_layer) + sum(lm_ends),
                  largest=max(lm_layer + lm_ends + (v_layer + v_ends if first else [])))


# --- the largest training micro-batch ----------------------------------------------------------


@dataclass(frozen=True)
class MicroBatchShape:
    """The largest micro-batch the trainer sees: `rows` right-padded rows of `seq` tokens."""

    rows: int
    seq: int
    scored: int  # positions whose logprob the loss needs, all rows (RL: the responses)
    media_tokens: int  # LLM positions filled by vision features, all rows (distinct media: no sharing assumed)
    frame_tokens: int  # merged tokens per image or video frame (the vision tower attends within one)

    @property
    def tokens(self) -> int:
        return self.rows * self.seq


def media_per_sample(media) -> tuple[int, int]:
    """(media tokens, tokens per frame) of the larger of one image and one video at the
    data.media limits (dataio/decode.py MediaConfig): a merged token covers factor^2 pixels."""
    per_token = media.factor * media.factor
    image = media.image_max_pixels // per_token
    frames = media.video_max_frames if media.video_fps is not None else min(media.video_frames, media.video_max_frames)
    frame = media.video_max_pixels // per_token
    video = -(-frames // 2) * frame  # two frames make one temporal patch
    return (video, frame) if video >= image else (image, image)


def rl_micro_batch(cfg, seq_len: int = 0, media_tokens: int = -1, frame_tokens: int = 0) -> MicroBatchShape:
    """The largest micro-batch of an RL step: rows as long as vLLM allows (max_model_len), as
    many as run.micro_batch_tokens holds (at least one: a longer sample gets its own)."""
    seq = seq_len or cfg.rollout.engine.max_model_len
    answer = min(cfg.rollout.sampling.max_tokens, seq - 1)
    default_media, default_frame = media_per_sample(cfg.data.media)
    media = default_media if media_tokens < 0 else media_tokens
    media = max(0, min(media, seq - answer - PROMPT_TEXT_TOKENS))
    rows = max(1, cfg.run.micro_batch_tokens // seq)
    return MicroBatchShape(rows=rows, seq=seq, scored=rows * answer, media_tokens=rows * media,
                           frame_tokens=max(1, min(frame_tokens or default_frame, media or 1)))


# --- activations -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Kernels:
    """The kernels whose memory differs between CUDA and CPU (torch 2.13): torch.rms_norm keeps
    its input and rstd on CUDA (fused kernel) but fp32 copies of the input and the normalised
    input on CPU (composite). (Adam runs fused on both, models/optimizer.py: updates in place,
    no temporaries the size of the state.)"""

    name: str
    fused_rms_norm: bool


CUDA = Kernels("cuda", fused_rms_norm=True)
CPU = Kernels("cpu", fused_rms_norm=False)


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


def _norm_bytes(n: int, h: int, e: int, rms: bool, kernels: Kernels) -> int:
    """A norm's input and output (the next linear keeps the output), plus its statistics."""
    if rms and not kernels.fused_rms_norm:
        return n * h * (8 + e) + 4 * n  # composite: fp32 input and normalised input, the output in e
    return 2 * n * h * e + (4 if rms else 8) * n


def _core_attention_bytes(b: Block, e: int) -> int:
    """torch's attention kernel (models/attention.py) keeps its inputs (Q and K after the rotary
    embedding, V as a view that keeps the whole fused QKV output; grouped K and V are not
    expanded), its output (the output projection's input, a view of it, counted there) and one
    fp32 log-sum-exp per head and query: no s x s scores."""
    return _recomputed_core_bytes(b, e) + 4 * b.tokens * (b.q // b.head_dim)


def _recomputed_core_bytes(b: Block, e: int) -> int:
    """Selective recompute keeps only core attention's inputs: Q, K and the QKV output V views."""
    return b.tokens * (b.q + b.kv + b.q + 2 * b.kv) * e


def layer_bytes(b: Block, e: int, kernels: Kernels, recompute: str) -> int:
    """Bytes one layer keeps for its backward pass: the per-layer term of the formula."""
    if recompute == "full":
        return b.tokens * b.hidden * e  # only the layer's input; the rest is recomputed
    core = _recomputed_core_bytes(b, e) if recompute == "selective" else _core_attention_bytes(b, e)
    mlp = (5 if b.gated else 3) * b.tokens * b.ffn * e  # fc1 output (2 halves if gated), activation, product
    # (the rotary cos and sin are one pair for all layers: `_rotary_bytes`)
    return 2 * _norm_bytes(b.tokens, b.hidden, e, b.rms, kernels) + core + b.tokens * b.q * e + mlp


def _rotary_bytes(b: Block, e: int, recompute: str) -> int:
    """The rotary cos and sin, computed once per forward and kept by every layer's Q and K
    products (models/rotary.py); none kept inside layers that full recompute runs again."""
    return 0 if recompute == "full" else 2 * b.rope_rows * b.head_dim * e


def language_block(spec, shape: MicroBatchShape, tp: int) -> Block:
    hd = spec.head_dim
    return Block(tokens=shape.tokens, hidden=spec.hidden_size, q=spec.num_heads // tp * hd,
                 kv=max(1, spec.num_kv_heads // tp) * hd, ffn=spec.intermediate_size // tp, head_dim=hd, gated=True,
                 rms=True, rope_rows=shape.tokens)


def vision_block(spec, shape: MicroBatchShape, tp: int) -> Block:
    """Qwen2-VL attends within each frame (frames of one size run as a batch); Qwen2.5-VL runs
    all of a micro-batch's patches as one sequence under a mask (models/qwen2vl/vision.py)."""
    merge = spec.spatial_merge_size**2
    patches, frame = shape.media_tokens * merge, shape.frame_tokens * merge
    hv, heads = spec.vision_embed_dim, spec.vision_heads // tp
    hd = hv // spec.vision_heads
    rope_rows, ffn = (patches, spec.vision_intermediate_size) if spec.is_qwen25 else (frame, int(hv * spec.vision_mlp_ratio))
    return Block(tokens=patches, hidden=hv, q=heads * hd, kv=heads * hd, ffn=ffn // tp, head_dim=hd,
                 gated=spec.is_qwen25, rms=spec.is_qwen25, rope_rows=rope_rows)


@dataclass(frozen=True)
class Activations:
    saved: int  # kept for the backward pass at the end of the forward
    peak: int  # the most alive at once in the forward and backward (saved tensors and temporaries)
    forward_only: int  # peak of a no-grad forward (the logprobs phase)


def _saved_bytes(spec, shape: MicroBatchShape, tp: int, e: int, recompute: str, kernels: Kernels,
                 pp: int = 1, stage: int = 0) -> int:
    """What one micro-batch's forward on pipeline `stage` keeps for the backward, but the loss's
    own part (the sum over the stage's layers of the per-layer formula, plus on the first stage
    the embeddings, pixels and patch merger, on the last the final norm)."""
    lm, vis = language_block(spec, shape, tp), vision_block(spec, shape, tp)
    n, first, last = shape.tokens, stage == 0, stage == pp - 1
    saved = spec.num_layers // pp * layer_bytes(lm, e, kernels, recompute) + _rotary_bytes(lm, e, recompute)
    saved += 9 * n  # token ids, media mask
    if last:
        saved += _norm_bytes(n, spec.hidden_size, e, True, kernels)  # the final norm
    if recompute == "full":
        saved += n * spec.head_dim * 4  # the rotary angles, kept once as an input of every checkpoint
    if shape.media_tokens and first:
        patches = vis.tokens
        vision_recompute = _vision_recompute(spec, recompute)
        saved += spec.vision_depth * layer_bytes(vis, e, kernels, vision_recompute) + _rotary_bytes(vis, e,
                                                                                                  vision_recompute)
        saved += patches * spec.in_channels * spec.temporal_patch_size * spec.patch_size**2 * e  # pixel values
        saved += _norm_bytes(patches, vis.hidden, e, spec.is_qwen25, kernels) + 2 * patches * vis.hidden * e  # merger
        saved += 8 * patches**2 if spec.is_qwen25 else 8 * patches  # fp32 window and full masks / frame order
    return saved


def _vision_recompute(spec, recompute: str) -> str:
    """Qwen2.5-VL's vision layers run one by one outside Megatron's block: "full" recomputes none."""
    return "none" if recompute == "full" and spec.is_qwen25 else recompute


def _recomputed_layer_bytes(spec, shape: MicroBatchShape, tp: int, e: int, recompute: str, kernels: Kernels,
                            vision: bool = True) -> int:
    """What comes back during one layer's backward under recompute: the whole layer (full), its
    core attention (selective); the largest of the language and (with `vision`) vision layers."""
    blocks = [language_block(spec, shape, tp)] + ([vision_block(spec, shape, tp)] if shape.media_tokens and vision
                                                  else [])
    if recompute == "full":
        return max(layer_bytes(b, e, kernels, "none") for b in blocks)
    if recompute == "selective":  # the attention output and its log-sum-exp come back
        return max(_core_attention_bytes(b, e) - _recomputed_core_bytes(b, e) + b.tokens * b.q * e for b in blocks)
    return 0


def activation_bytes(spec, shape: MicroBatchShape, tp: int, e: int, recompute: str,
                     kernels: Kernels = CUDA, pp: int = 1, stage: int = 0) -> Activations:
    """Activation memory of the forward and backward of micro-batches on one TP rank of pipeline
    `stage`. On the last stage (the whole model without PP) the peak is the largest of three
    moments: the end of the forward (logits and the loss alive), the output layer's backward (the
    loss's softmax freed; the logits' gradient, its contiguous copy when rows > 1, the output
    weight's and the input's gradients alive), and a layer's recompute. Under 1F1B, stage s runs
    pp - s micro-batches' forwards before their first backward, so it keeps that many."""
    n, vocab, h = shape.tokens, spec.vocab_size // tp, spec.hidden_size
    body = _saved_bytes(spec, shape, tp, e, recompute, kernels, pp, stage)
    if stage < pp - 1:
        held = (pp - stage) * body
        hidden = 2 * n * h * e  # the hidden states received and sent (or their gradients)
        c = ACTIVATION_CALIBRATION
        recomputing = _recomputed_layer_bytes(spec, shape, tp, e, recompute, kernels, vision=stage == 0)
        return Activations(saved=int(c * held), peak=int(c * (held + hidden + recomputing)),
                           forward_only=int(c * hidden))
    loss = shape.scored * vocab * 4  # the fp32 softmax of the scored positions (vocab-parallel cross entropy)
    logits = n * vocab * e
    end_of_forward = body + loss + logits + shape.scored * vocab * e  # the logits and the scored rows picked
    output_backward = body + logits * (2 if shape.rows > 1 else 1) + vocab * h * e + n * h * e
    recomputing = body + _recomputed_layer_bytes(spec, shape, tp, e, recompute, kernels)
    forward_only = logits + shape.scored * vocab * (e + 8)  # logits; the scored rows and their fp32 copies
    c = ACTIVATION_CALIBRATION
    return Activations(saved=int(c * (body + loss)), peak=int(c * max(end_of_forward, output_backward, recomputing)),
                       forward_only=int(c * forward_only))


# --- the trainer ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class TrainerMemory:
    """One rank's trainer, in bytes."""

    params: Params  # on this TP rank of its pipeline stage
    stage: int  # the pipeline stage (the one with the largest peak; 0 without PP)
    model_params: int  # of the whole model
    weights: int
    grads: int
    optimizer: int
    activations: Activations

    @property
    def persistent(self) -> int:
        return self.weights + self.grads + self.optimizer

    @property
    def step_extra(self) -> int:
        """What the train phase adds to the persistent state at its peak: the forward and
        backward's activations (fused Adam, models/optimizer.py, updates in place)."""
        return self.activations.peak

    @property
    def peak(self) -> int:
        return self.persistent + self.step_extra

    @property
    def host_offload(self) -> int:
        """What release() moves to host memory: weights and optimizer state (gradients are dropped)."""
        return self.weights + self.optimizer


def trainer_memory(spec, trainer, dp: int, shape: MicroBatchShape, kernels: Kernels = CUDA) -> TrainerMemory:
    """`trainer`: models.trainer.TrainerConfig; `dp`: the data-parallel size. Under pipeline
    parallelism, the stage whose rank needs the most."""
    stages = [stage_memory(spec, trainer, dp, shape, kernels, s) for s in range(trainer.pipeline_parallel)]
    return max(stages, key=lambda t: t.peak)


def stage_memory(spec, trainer, dp: int, shape: MicroBatchShape, kernels: Kernels, stage: int) -> TrainerMemory:
    tp, pp = trainer.tensor_parallel, trainer.pipeline_parallel
    params = param_counts(spec, tp, pp, stage)
    e = 2 if trainer.dtype == "bf16" else 4
    # Adam's m and v in fp32; bf16 adds fp32 master weights (fp32 steps the weights themselves)
    state_per_param = 8 + (4 if e == 2 else 0)
    shards = dp if trainer.distributed_optimizer else 1  # ZeRO-1: sharded over the DP group
    optimizer = params.total * state_per_param // shards
    return TrainerMemory(params=params, stage=stage, model_params=param_counts(spec).total, weights=params.total * e,
                         grads=params.total * 4, optimizer=optimizer,
                         activations=activation_bytes(spec, shape, tp, e, trainer.recompute, kernels, pp, stage))


# --- vLLM engines --------------------------------------------------------------------------------


def kv_bytes_per_token(spec, tp: int) -> int:
    """K and V of every layer in bf16; KV heads split over TP (replicated when fewer than TP)."""
    return 2 * spec.num_layers * max(1, spec.num_kv_heads // tp) * spec.head_dim * VLLM_DTYPE_BYTES


@dataclass(frozen=True)
class EngineMemory:
    name: str
    share: float  # gpu_memory_utilization
    total: int  # share x GPU memory: what vLLM takes when it starts
    weights: int
    kv_cache: int
    kv_tokens: int
    max_model_len: int

    @property
    def starts(self) -> bool:
        """vLLM refuses to start when its KV cache cannot hold one sequence of max_model_len."""
        return self.kv_tokens >= self.max_model_len


def engine_memory(name: str, spec, share: float, gpu_bytes: int, tp: int, max_model_len: int) -> EngineMemory:
    total = int(share * gpu_bytes)
    weights = param_counts(spec).total * VLLM_DTYPE_BYTES // tp
    kv = max(0, total - weights - int(VLLM_RESERVE_GIB * GIB))
    return EngineMemory(name, share, total, weights, kv, kv // kv_bytes_per_token(spec, tp), max_model_len)


# --- phases ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Cluster:
    gpus_per_node: int = 8
    gpu_memory_gib: float = 80.0
    nodes: int = 1
    host_memory_gib: float = 0.0  # 0: not checked

    @property
    def world(self) -> int:
        return self.gpus_per_node * self.nodes

    @property
    def gpu_bytes(self) -> int:
        return int(self.gpu_memory_gib * GIB)


@dataclass(frozen=True)
class Line:
    """One memory line of a phase on one GPU."""

    what: str
    nbytes: int


@dataclass(frozen=True)
class GpuPhase:
    phase: str
    gpus: str  # which GPUs of a node this is
    lines: tuple[Line, ...]
    limit: int

    @property
    def total(self) -> int:
        return sum(line.nbytes for line in self.lines)

    @property
    def fits(self) -> bool:
        return self.total <= self.limit


@dataclass
class Plan:
    cfg: object
    cluster: Cluster
    spec: object
    shape: MicroBatchShape
    trainer: TrainerMemory
    rollout: EngineMemory
    judges: dict[str, EngineMemory]
    phases: list[GpuPhase]
    host: list[Line]  # per node
    notes: list[str] = field(default_factory=list)

    @property
    def dp(self) -> int:
        return self.cluster.world // self.cfg.policy.trainer.model_parallel

    @property
    def host_total(self) -> int:
        return sum(line.nbytes for line in self.host)

    @property
    def problems(self) -> list[str]:
        out = [f"phase {p.phase} on {p.gpus}: {p.total / GIB:.1f} GiB > {p.limit / GIB:.1f} GiB"
               for p in self.phases if not p.fits]
        for e in [self.rollout, *self.judges.values()]:
            if not e.starts:
                out.append(f"{e.name}: KV cache of {e.kv_tokens} tokens cannot hold one sequence of "
                           f"{e.max_model_len} (vLLM will not start)")
        if self.cluster.host_memory_gib and self.host_total > self.cluster.host_memory_gib * GIB:
            out.append(f"host memory per node: {self.host_total / GIB:.1f} GiB > {self.cluster.host_memory_gib:.1f} GiB")
        return out

    @property
    def fits(self) -> bool:
        return not self.problems


def _server_gpus(cfg, cluster: Cluster, tp: int) -> dict[int, list[tuple[str, int]]]:
    """Local GPU -> (judge name, servers) of the judge servers resident on it. A server runs on
    the first of judge.devices, or without devices on the GPU a process without
    CUDA_VISIBLE_DEVICES uses (the node's first); one per node, or one per DP group."""
    out: dict[int, list[tuple[str, int]]] = {}
    for wj in cfg.reward.judges:
        j = wj.judge
        if j.backend != "server":
            continue
        first = j.devices.split(",")[0].strip()
        gpu = int(first) if first.isdigit() else 0  # a GPU named by UUID: counted as the first
        count = max(1, cluster.gpus_per_node // tp) if j.server_per == "dp_group" else 1
        out.setdefault(gpu, []).append((j.name, count))
    return out


def _trainer_lines(phase: str, level: str, t: TrainerMemory, cfg, offloads: bool) -> list[Line]:
    if level == "none" and offloads:
        return []
    if level == "weights" and offloads:
        return [Line("trainer weights", t.weights)]
    lines = [Line("trainer weights", t.weights), Line("gradients (fp32 DDP buffer)", t.grads),
             Line("optimizer state", t.optimizer)]
    if phase == "train":
        lines.append(Line("activations (peak)", t.step_extra))
    elif phase == "logprobs":
        lines.append(Line("forward-only logits", t.activations.forward_only))
        if cfg.algorithm.kl_coef > 0:
            lines.append(Line("reference policy weights", t.weights))
    elif phase == "sync":
        lines.append(Line("weight export (one bucket / gathered copy)", _export_bytes(cfg, t)))
    lines.append(Line("allocator slack", int(ALLOCATOR_SLACK * sum(line.nbytes for line in lines))))
    return lines


def _export_bytes(cfg, t: TrainerMemory) -> int:
    """The HF-named copy the weight sync builds: one sync.bucket_mb bucket at a time where the
    config has buckets (at least the largest tensor, gathered over TP), else the whole model
    (every pipeline stage's part reaches the first stage)."""
    e = t.weights // max(t.params.total, 1)
    tp = cfg.policy.trainer.tensor_parallel
    bucket_mb = getattr(getattr(cfg, "sync", None), "bucket_mb", None)
    whole = t.model_params * e
    if bucket_mb is None:
        return whole
    return min(whole, max(int(bucket_mb * 2**20), t.params.largest * tp * e))


def _engine_lines(label: str, level: str, release: str, engine: EngineMemory) -> list[Line]:
    if release == "keep" or level == "all" or (release == "shutdown" and level == "weights"):
        return [Line(f"{label} weights", engine.weights), Line(f"{label} KV cache", engine.kv_cache),
                Line(f"{label} reserve", engine.total - engine.weights - engine.kv_cache)]
    if level == "weights":
        return [Line(f"{label} weights (KV cache asleep)", engine.weights)]
    return [] if release == "shutdown" else [Line(f"{label} asleep", int(VLLM_ASLEEP_GIB * GIB))]


def _release_mode(release: str) -> str:
    return "sleep" if release == "auto" else release  # on GPUs (engines/engine.py release_mode)


def gpu_phases(cfg, cluster: Cluster, t: TrainerMemory, rollout: EngineMemory,
               judges: dict[str, EngineMemory]) -> list[GpuPhase]:
    """Per phase of the placement plan (rl/placement.py), the memory of each kind of GPU: those
    with judge servers on them, and the others."""
    from yatt_mm.rl.placement import PLANS

    tp = cfg.policy.trainer.tensor_parallel
    servers = _server_gpus(cfg, cluster, tp)
    kinds = sorted(g for g in servers if g < cluster.gpus_per_node)
    others = [g for g in range(cluster.gpus_per_node) if g not in servers]
    groups = [(f"GPU {g} (+ judge server {', '.join(n for n, _ in servers[g])})", servers[g]) for g in kinds]
    if others:
        groups.append((_gpu_range(others), []))
    offloads = cfg.policy.trainer.offload != "never"
    release = _release_mode(cfg.rollout.engine.release)
    inprocess = [wj.judge for wj in cfg.reward.judges if wj.judge.backend == "inprocess"]
    out = []
    for phase in PLANS[cfg.run.placement]().phases:
        levels = phase.levels()
        if not levels:
            continue  # prepare, balance: no devices
        for label, resident in groups:
            lines = _trainer_lines(phase.name, levels.get("train", "none"), t, cfg, offloads)
            lines += _engine_lines("vLLM rollout", levels.get("rollout", "none"), release, rollout)
            for j in inprocess:
                lines += _engine_lines(f"judge {j.name}", levels.get("judge", "none"), "sleep", judges[j.name])
            for name, count in resident:
                lines.append(Line(f"judge server {name} (x{count}, resident)",
                                  count * (judges[name].total + int(CUDA_CONTEXT_GIB * GIB))))
            lines.append(Line("CUDA context", int(CUDA_CONTEXT_GIB * GIB)))
            out.append(GpuPhase(phase.name, label, tuple(ln for ln in lines if ln.nbytes), cluster.gpu_bytes))
    return out


def _gpu_range(gpus: list[int]) -> str:
    if len(gpus) == 1:
        return f"GPU {gpus[0]}"
    if gpus == list(range(gpus[0], gpus[-1] + 1)):
        return f"GPUs {gpus[0]}-{gpus[-1]}"
    return "GPUs " + ",".join(map(str, gpus))


def host_lines(cfg, cluster: Cluster, t: TrainerMemory, rollout: EngineMemory,
               judges: dict[str, EngineMemory]) -> list[Line]:
    """Host memory per node held for offload (pinned): what each rank moves off its GPU."""
    g = cluster.gpus_per_node
    lines = []
    if cfg.policy.trainer.offload != "never":
        lines.append(Line(f"trainer weights + optimizer state, {g} ranks", g * t.host_offload))
    if _release_mode(cfg.rollout.engine.release) == "sleep":
        lines.append(Line(f"vLLM rollout weights asleep, {g} engines", g * rollout.weights))
    for wj in cfg.reward.judges:
        if wj.judge.backend == "inprocess":
            lines.append(Line(f"judge {wj.judge.name} weights asleep, {g} engines", g * judges[wj.judge.name].weights))
    if cfg.algorithm.kl_coef > 0:
        lines.append(Line(f"reference policy (kl_coef > 0), {g} ranks", g * t.weights))
    return lines


# --- the plan --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Assumptions:
    """What the config does not say about the data: 0 / -1 take the defaults of rl_micro_batch."""

    seq_len: int = 0
    media_tokens: int = -1
    frame_tokens: int = 0


def make_plan(cfg, cluster: Cluster, assume: Assumptions = Assumptions(), kernels: Kernels = CUDA) -> Plan:
    """The memory plan of an RLConfig on `cluster`."""
    cfg.check_world(cluster.world)
    spec = load_spec(cfg.policy.model)
    tp, pp = cfg.policy.trainer.tensor_parallel, cfg.policy.trainer.pipeline_parallel
    from models.qwen2vl.config import check_layout

    try:
        check_layout(spec, tp, pp, "policy.trainer.")
    except ValueError as e:
        raise PlanError(str(e)) from e
    shape = rl_micro_batch(cfg, assume.seq_len, assume.media_tokens, assume.frame_tokens)
    trainer = trainer_memory(spec, cfg.policy.trainer, cluster.world // (tp * pp), shape, kernels)
    engine = cfg.rollout.engine
    rollout = engine_memory("rollout engine", spec, engine.gpu_memory_utilization, cluster.gpu_bytes,
                            engine.tensor_parallel_size, engine.max_model_len)
    judges = {}
    for wj in cfg.reward.judges:
        j = wj.judge
        max_len = JUDGE_SERVER_MAX_MODEL_LEN if j.backend == "server" else 2048  # EngineConfig's default
        judges[j.name] = engine_memory(f"judge {j.name}", load_spec(j.model or cfg.policy.model),
                                       j.gpu_memory_utilization, cluster.gpu_bytes, 1, max_len)
    plan = Plan(cfg, cluster, spec, shape, trainer, rollout, judges,
                gpu_phases(cfg, cluster, trainer, rollout, judges), host_lines(cfg, cluster, trainer, rollout, judges))
    plan.notes = _notes(plan)
    return plan


def _notes(plan: Plan) -> list[str]:
    cfg, out = plan.cfg, []
    wanted = cfg.rollout.prompts_per_step * cfg.rollout.sampling.n
    in_flight = plan.rollout.kv_tokens // max(cfg.rollout.engine.max_model_len, 1)
    if plan.rollout.starts and in_flight < wanted:
        out.append(f"the rollout KV cache holds {in_flight} sequences of max_model_len at once, a step samples "
                   f"{wanted} per DP group: it runs in waves (slower, not out of memory)")
    for j in (wj.judge for wj in cfg.reward.judges):
        if j.backend == "server" and j.server_per == "dp_group" and not j.devices:
            out.append(f"judge {j.name}: server_per=dp_group without devices puts every DP group's server on GPU 0")
    return out


# --- what to change ---------------------------------------------------------------------------------


def candidate_changes(cfg, cluster: Cluster) -> list[list[str]]:
    """Settings that lower memory, each as the key=value overrides that make it one change."""
    t, e = cfg.policy.trainer, cfg.rollout.engine
    out = []
    if not t.distributed_optimizer and cluster.world // t.model_parallel > 1:
        out.append(["policy.trainer.distributed_optimizer=true"])
    modes = ("none", "selective", "full")
    out += [[f"policy.trainer.recompute={r}"] for r in modes if modes.index(r) > modes.index(t.recompute)]
    if cluster.world % (2 * t.model_parallel) == 0:
        out.append([f"policy.trainer.pipeline_parallel={2 * t.pipeline_parallel}"])
    if cluster.world % (2 * t.model_parallel) == 0:  # an engine spans 1 rank or the trainer's TP group
        out.append([f"policy.trainer.tensor_parallel={2 * t.tensor_parallel}"]
                   + ([f"rollout.engine.tensor_parallel_size={2 * t.tensor_parallel}"] if e.tensor_parallel_size > 1
                      else []))
    if t.dtype == "fp32":
        out.append(["policy.trainer.dtype=bf16"])
    if t.offload == "never":
        out.append(["policy.trainer.offload=auto"])
    if cfg.run.micro_batch_tokens > e.max_model_len:
        out.append([f"run.micro_batch_tokens={max(e.max_model_len, cfg.run.micro_batch_tokens // 2)}"])
    if e.release == "keep":
        out.append(["rollout.engine.release=auto"])
    if e.gpu_memory_utilization > 0.3:
        out.append([f"rollout.engine.gpu_memory_utilization={round(e.gpu_memory_utilization - 0.1, 2)}"])
    if e.tensor_parallel_size == 1 and t.tensor_parallel > 1:
        out.append([f"rollout.engine.tensor_parallel_size={t.tensor_parallel}"])
    return out


def _over(plan: Plan) -> int:
    """How far the worst GPU phase is over its limit (negative: under)."""
    return max(p.total - p.limit for p in plan.phases)


def _changed(cfg, overrides: list[str], cluster: Cluster, assume: Assumptions) -> Plan | None:
    """The plan of `cfg` with `overrides`; None when they break the config or the model's layout."""
    from yatt_mm.config import ConfigError, apply_override, build, validate
    from yatt_mm.rl.config import RLConfig

    data = json.loads(json.dumps(_as_dict(cfg), default=str))
    try:
        for override in overrides:
            apply_override(data, override)
        changed = build(RLConfig, data)
        validate(changed)
        return make_plan(changed, cluster, assume)
    except (ConfigError, ValueError):
        return None


def advise(cfg, cluster: Cluster, assume: Assumptions) -> tuple[list[tuple[str, Plan]], list[str], Plan | None]:
    """(single changes that each make the plan fit, or else those that lower the worst phase,
    best first; a greedy combination of changes, best first each time; the plan with it)."""
    before = make_plan(cfg, cluster, assume)
    tried = [(" ".join(c), p) for c in candidate_changes(cfg, cluster) if (p := _changed(cfg, c, cluster, assume))]
    fixes = [(c, p) for c, p in tried if p.fits]
    singles = fixes or sorted([(c, p) for c, p in tried if _over(p) < _over(before)], key=lambda cp: _over(cp[1]))
    combined, plan, current = [], None, cfg
    while not fixes and len(combined) < 6:
        options = [(c, p) for c in candidate_changes(current, cluster)
                   if (p := _changed(cfg, combined + c, cluster, assume))]
        options = [(c, p) for c, p in options if _over(p) < _over(plan or before)]
        if not options:
            break
        change, plan = min(options, key=lambda cp: _over(cp[1]))
        combined += change
        current = plan.cfg
        if plan.fits:
            break
    return singles, combined, plan


def _as_dict(cfg) -> dict:
    from yatt_mm.config import to_dict

    return to_dict(cfg)


# --- output ----------------------------------------------------------------------------------------


def _gib(n: int) -> str:
    return f"{n / GIB:.1f}"


def format_plan(plan: Plan) -> str:
    cfg, c, t, s, spec = plan.cfg, plan.cluster, plan.trainer, plan.shape, plan.spec
    tcfg, full = cfg.policy.trainer, param_counts(plan.spec)
    out = [f"model {cfg.policy.model} ({resolve_model(cfg.policy.model)[1]}): {full.total / 1e9:.2f} B parameters "
           f"(vision {full.vision / 1e9:.2f} B, language {full.language / 1e9:.2f} B)",
           f"cluster: {c.nodes} node(s) x {c.gpus_per_node} GPUs of {c.gpu_memory_gib:g} GiB; placement "
           f"{cfg.run.placement}; trainer TP {tcfg.tensor_parallel} x PP {tcfg.pipeline_parallel} x DP {plan.dp}, "
           f"{tcfg.dtype}, distributed optimizer {'on' if tcfg.distributed_optimizer else 'off'}, recompute "
           f"{tcfg.recompute}, {t.params.total / 1e9:.2f} B parameters per GPU"
           + (f" (pipeline stage {t.stage} of {tcfg.pipeline_parallel}, the fullest: it sets the trainer's lines)"
              if tcfg.pipeline_parallel > 1 else ""),
           f"largest micro-batch (assumed): {s.rows} row(s) x {s.seq} tokens, {s.scored} scored, {s.media_tokens} "
           f"media tokens = {s.media_tokens * spec.spatial_merge_size**2} vision patches in frames of "
           f"{s.frame_tokens} tokens (--seq-len, --media-tokens, --frame-tokens)",
           f"trainer per GPU (GiB): weights {_gib(t.weights)}, gradients {_gib(t.grads)}, optimizer "
           f"{_gib(t.optimizer)}, activations {_gib(t.activations.peak)} at the peak ({_gib(t.activations.saved)} saved)"]
    for e in [plan.rollout, *plan.judges.values()]:
        out.append(f"{e.name} (vLLM): share {e.share:g} = {_gib(e.total)} GiB: weights {_gib(e.weights)}, KV cache "
                   f"{_gib(e.kv_cache)} GiB = {e.kv_tokens} tokens = {e.kv_tokens // max(e.max_model_len, 1)} "
                   f"sequences of {e.max_model_len}")
    for gpus in dict.fromkeys(p.gpus for p in plan.phases):
        out += ["", f"GPU memory per phase (GiB): {gpus}"]
        out += _gpu_table([p for p in plan.phases if p.gpus == gpus])
    out += ["", f"host memory per node, pinned for offload (GiB): {_gib(plan.host_total)}"
            + (f" of {c.host_memory_gib:g}" if c.host_memory_gib else "")]
    out += [f"  {line.what:<{LABEL}}{_gib(line.nbytes):>{COLUMN}}" for line in plan.host]
    out += [f"note: {n}" for n in plan.notes]
    return "\n".join(out)


LABEL, COLUMN = 44, 9
# the rows of a GPU table: the trainer's lines first, then the engines'
_ROW_ORDER = ("trainer weights", "gradients", "optimizer", "activations", "forward-only", "reference",
              "weight export", "allocator", "vLLM rollout", "judge ", "CUDA")


def _row_rank(name: str) -> int:
    return next((i for i, prefix in enumerate(_ROW_ORDER) if name.startswith(prefix)), len(_ROW_ORDER))


def _gpu_table(phases: list[GpuPhase]) -> list[str]:
    """Memory lines down, phases across."""
    names = sorted(dict.fromkeys(line.what for p in phases for line in p.lines), key=_row_rank)
    widths = [max(COLUMN, len(p.phase) + 1) for p in phases]

    def row(label: str, cells: list[str]) -> str:
        return f"  {label:<{LABEL}}" + "".join(c.rjust(w) for c, w in zip(cells, widths))

    rows = [row("", [p.phase for p in phases])]
    for name in names:
        values = [next((ln.nbytes for ln in p.lines if ln.what == name), None) for p in phases]
        rows.append(row(name, ["-" if v is None else _gib(v) for v in values]))
    rows.append(row("total", [_gib(p.total) for p in phases]))
    rows.append(row(f"of {phases[0].limit / GIB:g}", ["fits" if p.fits else "OVER" for p in phases]))
    return rows


def run_plan(config: str | None, overrides: list[str], cluster: Cluster, assume: Assumptions = Assumptions()) -> int:
    """`yatt-mm plan`: print the plan; 0 if every phase fits, 1 if not, 2 on a config error."""
    import sys

    from yatt_mm.config import ConfigError, load
    from yatt_mm.rl.config import RLConfig

    try:
        cfg = load(RLConfig, config, overrides)
        plan = make_plan(cfg, cluster, assume)
    except (ConfigError, PlanError, ValueError) as e:
        print(f"yatt-mm plan: {e}", file=sys.stderr)
        return 2
    print(format_plan(plan))
    print()
    if plan.fits:
        print("verdict: fits")
        return 0
    print("verdict: DOES NOT FIT")
    for problem in plan.problems:
        print(f"  {problem}")
    singles, combined, together = advise(cfg, cluster, assume)
    if singles and singles[0][1].fits:
        print("change one of these settings (each fits alone):")
    elif singles:
        print("no single setting fits alone; each of these helps:")
    for change, p in singles[:6]:
        worst = max(p.phases, key=lambda q: q.total - q.limit)
        print(f"  {change:<56} worst: {worst.phase} on {worst.gpus}, {_gib(worst.total)} GiB")
    if combined:
        verdict = "fits" if together.fits else f"still {_gib(_over(together))} GiB over"
        print(f"together: {' '.join(combined)} ({verdict})")
    if not singles:
        print("no setting helps: more GPUs (--gpus-per-node, --nodes), GPUs with more memory, or a smaller model")
    return 1
