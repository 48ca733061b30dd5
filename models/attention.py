"""Core attention of the language model and the vision tower: torch's scaled_dot_product_attention
in place of Megatron's local DotProductAttention.

Without Transformer Engine, Megatron's local core attention materialises every head's s x s
scores and probabilities (baddbmm, mask fill, softmax, bmm) and keeps them for the backward
pass. torch's kernel (flash attention on CPU and CUDA, memory-efficient attention on CUDA) does
the same attention in one call and keeps only its inputs, its output and one log-sum-exp per
query: on a long video micro-batch the scores are most of the activation memory, and on this
CPU the kernel is about twice as fast as the local path (tests compare it with transformers).

Four cases, by what the caller passes:
- packed rows (`packed_seq_params`, models/packing.py): causal attention within each sample;
- context parallelism (`packed_seq_params` a models/context.py plan): this rank's chunks of the
  sequence against all ranks' keys and values, masked by global position (and sample);
- no mask: causal for the language model (right padding: real tokens never see pads), full
  attention for the vision towers (each batch row one frame, or one of Qwen2.5-VL's windows);
- a mask, boolean (True = masked, Megatron's convention) or additive (0 / -inf): no model passes
  one now (benchmarks/bench_vision_tower.py's masked baseline does).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType

from models.context import ContextParallel


class CoreAttention(DotProductAttention):
    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        """query [s, b, heads, d], key and value [s, b, groups, d] -> [s, b, heads * d]."""
        if attention_bias is not None:  # ALiBi and the like: not used by Qwen2-VL
            return super().forward(query, key, value, attention_mask, attn_mask_type, attention_bias,
                                   packed_seq_params)
        causal = (attn_mask_type or self.attn_mask_type) == AttnMaskType.causal
        dropout = self.config.attention_dropout if self.training else 0.0
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s, d]
        gqa = q.shape[1] != k.shape[1]
        if isinstance(packed_seq_params, ContextParallel):  # this rank's chunks; K/V gathered (models/context.py)
            out = packed_seq_params.attention(q, k, v, dropout, self.softmax_scale, gqa)
        elif packed_seq_params is not None:
            cu = packed_seq_params.cu_seqlens_q.tolist()
            out = torch.cat([F.scaled_dot_product_attention(q[..., a:b, :], k[..., a:b, :], v[..., a:b, :],
                                                            is_causal=True, dropout_p=dropout, scale=self.softmax_scale,
                                                            enable_gqa=gqa)
                             for a, b in zip(cu, cu[1:])], 2)
        else:
            mask = ~attention_mask if attention_mask is not None and attention_mask.dtype == torch.bool \
                else attention_mask  # torch's boolean masks: True = attend
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout,
                                                 is_causal=causal and mask is None, scale=self.softmax_scale,
                                                 enable_gqa=gqa)
        return out.permute(2, 0, 1, 3).reshape(query.shape[0], query.shape[1], -1)
