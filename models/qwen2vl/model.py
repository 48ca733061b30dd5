"""Qwen2-VL and Qwen2.5-VL on Megatron-Core: the vision tower's outputs replace the image/video pad tokens'
embeddings, then Megatron's GPTModel (M-RoPE, QKV bias, RMSNorm, SwiGLU) runs the text."""

from __future__ import annotations

import torch
from torch import nn

from models.inputs import VLMInputs
from models.megatron_config import params_to
from models.qwen2vl.config import Qwen2VLSpec, check_layout, language_config, vision_config
from models.qwen2vl.vision import Qwen2VisionModel


class Qwen2VLModel(nn.Module):
    """Forward returns logits [b, s, vocab / tp] (vocab-parallel under tensor parallelism).

    Under pipeline parallelism (`pp` > 1) this is one stage: the first holds the vision tower
    and the embeddings, the last the final norm and the output layer, each an equal share of
    the language model's layers (or `layers[stage]` of them); a stage other than the last returns its hidden states
    [s, b, h], which Megatron's schedule hands to the next one (`set_input_tensor`)."""

    def __init__(self, spec: Qwen2VLSpec, dtype: torch.dtype = torch.float32, tp: int = 1, recompute: str = "none",
                 pp: int = 1, layers=()):
        super().__init__()
        from megatron.core import parallel_state

        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

        check_layout(spec, tp, pp, layers=layers)
        from megatron.core.enums import ModelType

        self.spec = spec
        self.model_type = ModelType.encoder_or_decoder  # read by Megatron's schedules
        stage = parallel_state.get_pipeline_model_parallel_rank() if pp > 1 else 0
        self.pre_process, self.post_process = stage == 0, stage == pp - 1
        self.config = language_config(spec, dtype, tp, recompute, pp, layers)
        if self.pre_process:
            self.vision = Qwen2VisionModel(spec, vision_config(spec, dtype, tp, recompute))
        from models.attention import CoreAttention

        layer = get_gpt_layer_local_spec(normalization="RMSNorm")
        layer.submodules.self_attention.submodules.core_attention = CoreAttention  # torch's kernel; packed rows too
        self.language = GPTModel(
            config=self.config,
            transformer_layer_spec=layer,
            vocab_size=spec.vocab_size,
            max_sequence_length=32768,
            share_embeddings_and_output_weights=spec.tie_word_embeddings,
            position_embedding_type="mrope",
            rotary_base=int(spec.rope_theta),
            parallel_output=True,
            pre_process=self.pre_process,
            post_process=self.post_process,
        )
        # context parallelism slices the position ids itself (models/context.py): Megatron's
        # rotary embedding must not slice them again (its CP group is its default)
        self.language.rotary_pos_emb.cp_group = None
        # this stage's first language layer in the whole model (Megatron numbers layers from 1)
        self.layer_offset = self.language.decoder.layers[0].layer_number - 1
        params_to(self, dtype)  # Megatron's torch norms are built in float32

    def embed(self, inputs: VLMInputs, cp=None) -> torch.Tensor:
        """Token embeddings with the vision features in place of the media pad tokens: [s, b, h].
        With a context-parallel plan `cp` the vision tower's frames are split over the CP ranks
        (models/context.py); the embeddings are still the whole sequence's."""
        emb = self.language.embedding.word_embeddings(inputs.input_ids)  # [b, s, h]
        for pixels, grid, sources, token in (
            (inputs.pixel_values, inputs.image_grid_thw, inputs.image_sources, self.spec.image_token_id),
            (inputs.pixel_values_videos, inputs.video_grid_thw, inputs.video_sources, self.spec.video_token_id),
        ):
            where = inputs.input_ids == token
            if pixels is None:
                if bool(where.any()):
                    raise ValueError("input_ids hold media tokens but no pixel values were given")
                continue
            features = self._media_features(pixels, grid, sources, cp).to(emb.dtype)
            if features.shape[0] != int(where.sum()):
                raise ValueError(f"{int(where.sum())} media tokens but {features.shape[0]} vision features")
            emb = emb.masked_scatter(where[..., None], features)
        return emb.transpose(0, 1).contiguous()

    def _media_features(self, pixels: torch.Tensor, grid: torch.Tensor, sources: torch.Tensor | None,
                        cp=None) -> torch.Tensor:
        """Vision features of every media occurrence, in order: [tokens, hidden]."""
        if sources is None:
            return self._vision(pixels, grid, cp)
        sources = sources.tolist()
        first = {}
        for i, u in enumerate(sources):
            first.setdefault(u, i)
        distinct = grid[[first[u] for u in range(len(first))]]
        merge = self.spec.spatial_merge_size ** 2
        per_item = self._vision(pixels, distinct, cp).split((distinct.prod(-1) // merge).tolist())
        return torch.cat([per_item[u] for u in sources])

    def _vision(self, pixels: torch.Tensor, grid: torch.Tensor, cp=None) -> torch.Tensor:
        """The vision tower; under context parallelism its frames split over the CP ranks (each
        frame is attended on its own, windows included, with per-frame rotary angles)."""
        if cp is None:
            return self.vision(pixels, grid)
        return cp.vision(self.vision, pixels, grid, self.spec.spatial_merge_size)

    # Megatron finds the module with `pre_process` and treats it as its language model: with tied
    # embeddings under pipeline parallelism it all-reduces this weight's gradient between the
    # first stage (the embedding) and the last (its copy as the output layer).
    @property
    def share_embeddings_and_output_weights(self) -> bool:
        return self.language.share_embeddings_and_output_weights

    def shared_embedding_or_output_weight(self):
        return self.language.shared_embedding_or_output_weight()

    def set_input_tensor(self, tensor) -> None:
        """Megatron's schedules call this (pipeline parallelism hands activations over here)."""
        self.language.set_input_tensor(tensor)

    def forward(self, inputs: VLMInputs, packed_seq_params=None) -> torch.Tensor:
        """Causal attention over each row (with right padding real tokens never see pads, so no
        padding mask is needed); with `packed_seq_params`, over each sample of a packed row
        (models/packing.py); with a context-parallel plan (models/context.py), over this rank's
        chunks of each sequence, returning their logits [b, s / cp, vocab / tp]."""
        from models.context import ContextParallel
        from models.rotary import angles_computed_once

        with angles_computed_once():  # every layer's rotary cos/sin from one computation
            cp = packed_seq_params if isinstance(packed_seq_params, ContextParallel) else None
            decoder_input = self.embed(inputs, cp) if self.pre_process else None  # else: set_input_tensor's
            position_ids = inputs.position_ids
            if cp is not None:  # this CP rank's chunks of the sequence
                decoder_input, position_ids = packed_seq_params.localise(decoder_input, position_ids)
            logits = self.language(input_ids=None, position_ids=position_ids, attention_mask=None,
                                   decoder_input=decoder_input, packed_seq_params=packed_seq_params)
        return logits  # GPTModel returns [b, s, v] when no labels are given (hidden states before the last stage)
