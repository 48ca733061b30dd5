"""Qwen3-VL-MoE on Megatron-Core: models/qwen3vl/model.py's Qwen3VLModel (vision tower, DeepStack,
interleaved M-RoPE, embedding and forward), with Megatron's MoE layer as every language layer's
MLP: TopKRouter (`mlp.router`) and SequentialMLP experts (`mlp.experts.local_experts.{i}`, this
expert-parallel rank's share of the experts, numbered from 0 on every rank), tokens moved to
their experts by the all-to-all dispatcher (over the expert-parallel group under EP; on one rank
by the all-gather one, which then only permutes: config.token_dispatcher). Under tensor
parallelism the experts are split over TP and each TP rank hands them 1/TP of the tokens
(models/qwen3vl_moe/token_split.py: Megatron's MoE layer otherwise wants sequence parallelism).
"""

from __future__ import annotations

import torch

from models.qwen3vl.model import Qwen3VLModel
from models.qwen3vl_moe.config import Qwen3VLMoeSpec, language_config


class Qwen3VLMoeModel(Qwen3VLModel):
    """As Qwen3VLModel; `ep` is the expert-parallel size (Megatron's groups must already be
    made with it: models.comm.init_parallel(expert_parallel=ep))."""

    def __init__(self, spec: Qwen3VLMoeSpec, dtype: torch.dtype = torch.float32, tp: int = 1, recompute: str = "none",
                 pp: int = 1, layers=(), ep: int = 1):
        self.ep = ep  # read by _language_config, which Qwen3VLModel.__init__ calls
        super().__init__(spec, dtype, tp, recompute, pp, layers)
        from megatron.core import parallel_state

        from models.qwen3vl_moe.token_split import split_tokens_over_tp

        # this rank's experts are the global experts [expert_offset, expert_offset + local_experts)
        self.local_experts = spec.num_experts // ep
        self.expert_offset = (parallel_state.get_expert_model_parallel_rank() if ep > 1 else 0) * self.local_experts
        # this forward's padding [s, b] (True = a pad position) for every router: padding stays
        # out of the load-balancing loss (and models/moe_metrics.py's counts). It stays until the
        # next forward, so a full recompute in this micro-batch's backward sees it again
        self._padding: torch.Tensor | None = None
        for module in self.language.modules():
            if type(module).__name__ == "TopKRouter":
                module.register_forward_pre_hook(self._padding_hook)
            if type(module).__name__ == "MoELayer":
                split_tokens_over_tp(module)  # TP without sequence parallelism (models/qwen3vl_moe/token_split.py)

    # the family's language config with experts (a family built on this class names its own)
    moe_language_config = staticmethod(language_config)

    def _language_config(self, spec, dtype, tp, recompute, pp, layers):
        from megatron.core import parallel_state

        config = self.moe_language_config(spec, dtype, tp, recompute, pp, layers, self.ep)  # checks the layout
        if self.ep > 1 and parallel_state.get_expert_model_parallel_world_size() != self.ep:
            raise RuntimeError(f"expert_parallel={self.ep} but Megatron's expert-parallel groups have "
                               f"{parallel_state.get_expert_model_parallel_world_size()} ranks")
        return config

    def _layer_spec(self):
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

        return get_gpt_layer_local_spec(num_experts=self.spec.num_experts, moe_grouped_gemm=False,
                                        normalization="RMSNorm", qk_layernorm=True)

    def _padding_hook(self, router, args):
        """Give the router this forward's padding mask (Megatron's MoE layer passes none unless
        GPTModel gets one): its aux loss then counts the real tokens only. Routing itself, and so
        the logits, do not change."""
        if self._padding is None or (len(args) > 1 and args[1] is not None):
            return None
        return (args[0], self._padding.to(args[0].device))

    def forward(self, inputs, packed_seq_params=None) -> torch.Tensor:
        """Qwen3VLModel's forward; right-padded rows tell the routers where the padding is (a
        packed row has none). Under context parallelism the routers see this rank's chunks, the
        CP padding at the rows' ends included, and always get a mask: Megatron then counts the
        load-balancing loss's tokens over the CP group (with a mask on one rank and none on
        another the ranks would count differently)."""
        from models.context import ContextParallel

        mask = inputs.attention_mask
        if isinstance(packed_seq_params, ContextParallel):
            real = torch.ones_like(inputs.input_ids, dtype=torch.bool) if mask is None else mask.bool()
            self._padding = ~packed_seq_params.local(real, 1, pad_value=False).transpose(0, 1).contiguous()
        else:
            self._padding = None if mask is None or packed_seq_params is not None or bool(mask.all()) \
                else ~mask.bool().transpose(0, 1).contiguous()
        return super().forward(inputs, packed_seq_params)
