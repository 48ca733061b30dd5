"""Qwen3-VL-MoE on Megatron-Core: models/qwen3vl/model.py's Qwen3VLModel (vision tower, DeepStack,
interleaved M-RoPE, embedding and forward), with Megatron's MoE layer as every language layer's
MLP: TopKRouter (`mlp.router`) and SequentialMLP experts (`mlp.experts.local_experts.{i}`, this
expert-parallel rank's share of the experts, numbered from 0 on every rank), tokens moved to
their experts by the all-to-all dispatcher (over the expert-parallel group under EP).
"""

from __future__ import annotations

import torch
from torch import nn

from models.qwen3vl.config import vision_config
from models.qwen3vl.model import InterleavedMRoPE, Qwen3VLModel
from models.qwen3vl.vision import Qwen3VisionModel
from models.qwen3vl_moe.config import Qwen3VLMoeSpec, language_config


class Qwen3VLMoeModel(Qwen3VLModel):
    """As Qwen3VLModel; `ep` is the expert-parallel size (Megatron's groups must already be
    made with it: models.comm.init_parallel(expert_parallel=ep))."""

    def __init__(self, spec: Qwen3VLMoeSpec, dtype: torch.dtype = torch.float32, tp: int = 1, recompute: str = "none",
                 pp: int = 1, layers=(), ep: int = 1):
        nn.Module.__init__(self)
        from megatron.core import parallel_state
        from megatron.core.enums import ModelType
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

        from models.attention import CoreAttention

        self.spec = spec
        self.model_type = ModelType.encoder_or_decoder  # read by Megatron's schedules
        stage = parallel_state.get_pipeline_model_parallel_rank() if pp > 1 else 0
        self.pre_process, self.post_process = stage == 0, stage == pp - 1
        self.config = language_config(spec, dtype, tp, recompute, pp, layers, ep)  # checks the layout
        if ep > 1 and parallel_state.get_expert_model_parallel_world_size() != ep:
            raise RuntimeError(f"expert_parallel={ep} but Megatron's expert-parallel groups have "
                               f"{parallel_state.get_expert_model_parallel_world_size()} ranks")
        self.ep = ep
        if self.pre_process:
            self.vision = Qwen3VisionModel(spec, vision_config(spec, dtype, tp, recompute))
        layer = get_gpt_layer_local_spec(num_experts=spec.num_experts, moe_grouped_gemm=False,
                                         normalization="RMSNorm", qk_layernorm=True)
        layer.submodules.self_attention.submodules.core_attention = CoreAttention  # as Qwen3VLModel
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
        self.language.rotary_pos_emb = InterleavedMRoPE(spec.head_dim, spec.rope_theta, spec.mrope_section)
        self.layer_offset = self.language.decoder.layers[0].layer_number - 1
        # this rank's experts are the global experts [expert_offset, expert_offset + local_experts)
        self.local_experts = spec.num_experts // ep
        self.expert_offset = (parallel_state.get_expert_model_parallel_rank() if ep > 1 else 0) * self.local_experts
        self._deepstack = None
        self._full_recompute = recompute == "full"  # as Qwen3VLModel: DeepStack gradients under full recompute
        self._sink: list = []
        # this forward's padding [s, b] (True = a pad position) for every router: padding stays
        # out of the load-balancing loss (and models/moe_metrics.py's counts). It stays until the
        # next forward, so a full recompute in this micro-batch's backward sees it again
        self._padding: torch.Tensor | None = None
        for module in self.language.modules():
            if type(module).__name__ == "TopKRouter":
                module.register_forward_pre_hook(self._padding_hook)
        if self.pre_process:
            for k in range(spec.num_deepstack):
                self.language.decoder.layers[k].register_forward_hook(self._deepstack_hook(k))

    def _padding_hook(self, router, args):
        """Give the router this forward's padding mask (Megatron's MoE layer passes none unless
        GPTModel gets one): its aux loss then counts the real tokens only. Routing itself, and so
        the logits, do not change."""
        if self._padding is None or (len(args) > 1 and args[1] is not None):
            return None
        return (args[0], self._padding.to(args[0].device))

    def forward(self, inputs, packed_seq_params=None) -> torch.Tensor:
        """Qwen3VLModel's forward; right-padded rows tell the routers where the padding is (a
        packed row has none)."""
        mask = inputs.attention_mask
        self._padding = None if mask is None or packed_seq_params is not None or bool(mask.all()) \
            else ~mask.bool().transpose(0, 1).contiguous()
        return super().forward(inputs, packed_seq_params)
