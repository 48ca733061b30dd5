"""Qwen3-VL (dense) on Megatron-Core: the vision tower's merged features replace the image/video
pad tokens' embeddings; Megatron's GPTModel runs the text with Qwen3 blocks (per-head q/k
RMSNorm, no QKV bias, SwiGLU) and interleaved M-RoPE; the DeepStack features are added to the
visual tokens' hidden states after each of the first len(deepstack_visual_indexes) layers.

Structure, pipeline stages and inputs as models/qwen2vl/model.py (models/inputs.py's VLMInputs,
whose position ids come from models/qwen3vl/rope_index.py through the family; the first stage
holds the vision tower and the embeddings, the last the head).
"""

from __future__ import annotations

import torch
from torch import nn

from models.qwen3vl.config import Qwen3VLSpec, language_config, vision_config
from models.qwen3vl.vision import Qwen3VisionModel

from models.inputs import VLMInputs
from models.megatron_config import params_to


class InterleavedMRoPE(nn.Module):
    """Qwen3-VL's M-RoPE angles for Megatron's rotary application (rotate-half): frequency j
    takes its position from the height axis when j % 3 == 1 and j < 3 * sections[1], from the
    width axis when j % 3 == 2 and j < 3 * sections[2], else from the temporal axis; the whole
    repeated twice. Megatron's own MultimodalRotaryEmbedding knows only three contiguous
    sections (Qwen2-VL). Takes the place of GPTModel's `rotary_pos_emb` (same call)."""

    def __init__(self, head_dim: int, theta: float, sections: tuple[int, int, int]):
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        axis = torch.zeros(head_dim // 2, dtype=torch.long)
        for a, offset in ((1, 1), (2, 2)):
            axis[offset:sections[a] * 3:3] = a
        self.register_buffer("axis", axis, persistent=False)

    def forward(self, position_ids: torch.Tensor, mrope_section=None, cp_group=None) -> torch.Tensor:
        """position_ids [3, b, s] -> angles [s, b, 1, head_dim]."""
        freqs = position_ids[..., None].float() * self.inv_freq.to(position_ids.device)  # [3, b, s, d/2]
        axis = self.axis.to(position_ids.device)
        picked = freqs.gather(0, axis.expand(1, *freqs.shape[1:3], -1))[0]  # [b, s, d/2]
        emb = torch.cat([picked, picked], dim=-1)
        return emb[:, :, None, :].transpose(0, 1).contiguous()


class _AddAndCollectGrad(torch.autograd.Function):
    """hidden + feature, the feature a constant whose gradient goes to `sink[k]`. Under full
    recompute a DeepStack layer's output is rebuilt inside its checkpoint's backward, where a
    backward into the vision tower's graph would run before (and free it for) the main one: the
    gradient waits in the sink instead, and `_HandOverGrad` delivers it."""

    @staticmethod
    def forward(ctx, hidden, feature, sink: list, k: int):
        ctx.sink, ctx.k = sink, k
        return hidden + feature

    @staticmethod
    def backward(ctx, grad):
        ctx.sink[ctx.k] = grad if ctx.sink[ctx.k] is None else ctx.sink[ctx.k] + grad
        return grad, None, None, None


class _HandOverGrad(torch.autograd.Function):
    """Identity on the embeddings, tied to the DeepStack features: its backward runs after every
    language layer's (the embeddings come before them) and gives each feature its collected
    gradient."""

    @staticmethod
    def forward(ctx, emb, sink: list, *features):
        ctx.sink = sink
        return emb.view_as(emb)

    @staticmethod
    def backward(ctx, grad):
        return (grad, None, *ctx.sink)


class Qwen3VLModel(nn.Module):
    """Forward returns logits [b, s, vocab / tp] (vocab-parallel under tensor parallelism), or
    on a pipeline stage other than the last its hidden states [s, b, h]."""

    def __init__(self, spec: Qwen3VLSpec, dtype: torch.dtype = torch.float32, tp: int = 1, recompute: str = "none",
                 pp: int = 1, layers=()):
        super().__init__()
        from megatron.core import parallel_state
        from megatron.core.enums import ModelType
        from megatron.core.models.gpt import GPTModel

        self.spec = spec
        self.model_type = ModelType.encoder_or_decoder  # read by Megatron's schedules
        stage = parallel_state.get_pipeline_model_parallel_rank() if pp > 1 else 0
        self.pre_process, self.post_process = stage == 0, stage == pp - 1
        self.config = self._language_config(spec, dtype, tp, recompute, pp, layers)  # checks the layout
        if self.pre_process:
            self.vision = Qwen3VisionModel(spec, vision_config(spec, dtype, tp, recompute))
        self.language = GPTModel(
            config=self.config,
            transformer_layer_spec=self._decoder_spec(),
            vocab_size=spec.vocab_size,
            max_sequence_length=32768,
            share_embeddings_and_output_weights=spec.tie_word_embeddings,
            position_embedding_type="mrope",
            rotary_base=int(spec.rope_theta),
            parallel_output=True,
            pre_process=self.pre_process,
            post_process=self.post_process,
        )
        self.language.rotary_pos_emb = InterleavedMRoPE(spec.head_dim, spec.rope_theta, spec.mrope_section)
        # this stage's first language layer in the whole model (Megatron numbers layers from 1)
        self.layer_offset = self.language.decoder.layers[0].layer_number - 1
        # DeepStack: after global layer k (< num_deepstack) add feature k at the visual tokens.
        # check_layout put all of them on the first stage, beside the vision tower.
        self._deepstack: tuple[torch.Tensor, list[torch.Tensor]] | None = None
        self._full_recompute = recompute == "full"  # DeepStack gradients through the sink (above)
        self._sink: list = []
        if self.pre_process:
            for k in range(spec.num_deepstack):
                self.language.decoder.layers[k].register_forward_hook(self._deepstack_hook(k))
        params_to(self, dtype)  # Megatron's torch norms are built in float32

    def _language_config(self, spec, dtype, tp, recompute, pp, layers):
        return language_config(spec, dtype, tp, recompute, pp, layers)

    def _decoder_spec(self):
        """What GPTModel builds its decoder from: one layer spec for every layer (a family with
        layers of several kinds returns a block spec, models/qwen35/model.py)."""
        from models.attention import CoreAttention

        layer = self._layer_spec()
        layer.submodules.self_attention.submodules.core_attention = CoreAttention  # torch's kernel; packed rows too
        return layer

    def _layer_spec(self):
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

        # qk_layernorm: the local spec's RMSNorm (torch.nn.RMSNorm over head_dim), as Qwen3's q_norm/k_norm
        return get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=True)

    def _deepstack_hook(self, k: int):
        def hook(module, args, output):
            if self._deepstack is None:  # no media in this forward
                return output
            hidden, context = output
            if self._full_recompute:
                return _AddAndCollectGrad.apply(hidden, self._deepstack[k].detach(), self._sink, k), context
            return hidden + self._deepstack[k], context  # zero outside the visual tokens: exact there
        return hook

    def embed(self, inputs: VLMInputs, cp=None) -> torch.Tensor:
        """Token embeddings with the vision features in place of the media pad tokens: [s, b, h].
        Sets this forward's DeepStack features (dense [s, b, h], zero at text tokens). With a
        context-parallel plan `cp` (models/context.py), both only at this rank's chunks [s / cp]:
        the DeepStack features split like the embeddings, so each lands on its visual token."""
        emb = self.language.embedding.word_embeddings(inputs.input_ids)  # [b, s, h]
        deepstack = None
        for pixels, grid, sources, token in (
            (inputs.pixel_values, inputs.image_grid_thw, inputs.image_sources, self.spec.image_token_id),
            (inputs.pixel_values_videos, inputs.video_grid_thw, inputs.video_sources, self.spec.video_token_id),
        ):
            where = inputs.input_ids == token
            if pixels is None:
                if bool(where.any()):
                    raise ValueError("input_ids hold media tokens but no pixel values were given")
                continue
            features, stack = self._media_features(pixels, grid, sources, cp)
            if features.shape[0] != int(where.sum()):
                raise ValueError(f"{int(where.sum())} media tokens but {features.shape[0]} vision features")
            emb = emb.masked_scatter(where[..., None], features.to(emb.dtype))
            if deepstack is None:
                deepstack = [torch.zeros_like(emb) for _ in stack]
            deepstack = [d.masked_scatter(where[..., None], f.to(emb.dtype)) for d, f in zip(deepstack, stack)]
        self._deepstack = None if not deepstack else [d.transpose(0, 1) for d in deepstack]
        emb = emb.transpose(0, 1).contiguous()
        if cp is not None:  # before the hand-over below, whose sink collects the local features' gradients
            emb = cp.local(emb, 0)
            self._deepstack = self._deepstack and [cp.local(d, 0) for d in self._deepstack]
        if self._full_recompute and self._deepstack and torch.is_grad_enabled():
            self._sink = [None] * len(self._deepstack)
            emb = _HandOverGrad.apply(emb, self._sink, *self._deepstack)
        return emb

    def _media_features(self, pixels: torch.Tensor, grid: torch.Tensor, sources: torch.Tensor | None, cp=None):
        """Merged and DeepStack features of every media occurrence, in order: [tokens, hidden] each."""
        if sources is None:
            return self._vision(pixels, grid, cp)
        sources = sources.tolist()
        first = {}
        for i, u in enumerate(sources):
            first.setdefault(u, i)
        distinct = grid[[first[u] for u in range(len(first))]]
        sizes = (distinct.prod(-1) // self.spec.spatial_merge_size ** 2).tolist()
        merged, stack = self._vision(pixels, distinct, cp)
        pick = lambda x: torch.cat([x.split(sizes)[u] for u in sources])  # noqa: E731
        return pick(merged), [pick(s) for s in stack]

    def _vision(self, pixels: torch.Tensor, grid: torch.Tensor, cp=None):
        """The vision tower on media of `grid` -> (merged, DeepStack features); under context
        parallelism its frames split over the CP ranks (models/context.py)."""
        if cp is None:
            return self.vision(pixels, grid)
        width = []

        def tower(p, g):  # merged and DeepStack features side by side: one all-gather
            merged, stack = self.vision(p, g)
            width.append(merged.shape[-1])
            return torch.cat([merged, *stack], -1)

        merged, *stack = cp.vision(tower, pixels, grid, self.spec.spatial_merge_size).split(width[0], -1)
        return merged, stack

    # Megatron finds the module with `pre_process` and treats it as its language model (tied
    # embeddings under pipeline parallelism): as in Qwen2VLModel.
    @property
    def share_embeddings_and_output_weights(self) -> bool:
        return self.language.share_embeddings_and_output_weights

    def shared_embedding_or_output_weight(self):
        return self.language.shared_embedding_or_output_weight()

    def set_input_tensor(self, tensor) -> None:
        """Megatron's schedules call this (pipeline parallelism hands activations over here)."""
        self.language.set_input_tensor(tensor)

    def forward(self, inputs: VLMInputs, packed_seq_params=None) -> torch.Tensor:
        """Causal attention over each row (right padding), or over each sample of a packed row
        with `packed_seq_params` (models/packing.py); with a context-parallel plan
        (models/context.py), over this rank's chunks of each sequence, returning their logits
        [b, s / cp, vocab / tp]."""
        from models.context import ContextParallel
        from models.rotary import angles_computed_once

        cp = packed_seq_params if isinstance(packed_seq_params, ContextParallel) else None
        with angles_computed_once():  # every layer's rotary cos/sin from one computation
            # embed() sets this forward's DeepStack features; they stay until the next forward,
            # so a full recompute in this micro-batch's backward adds them again
            decoder_input = self.embed(inputs, cp) if self.pre_process else None  # else: set_input_tensor's
            position_ids = inputs.position_ids if cp is None else cp.positions(inputs.position_ids)
            return self.language(input_ids=None, position_ids=position_ids, attention_mask=None,
                                 decoder_input=decoder_input, packed_seq_params=packed_seq_params)
