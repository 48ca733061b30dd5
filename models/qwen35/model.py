"""Qwen3.5 (dense) on Megatron-Core: models/qwen3vl/model.py's Qwen3VLModel (vision tower, M-RoPE,
embedding, pipeline stages and forward; no DeepStack), with a hybrid decoder built from
Megatron's own layers, one kind per layer as `layer_types` says (models/qwen35/config.py):
- linear attention: Megatron's `GatedDeltaNet` (megatron/core/ssm/gated_delta_net.py: fused
  in_proj [q, k, v, z, beta, alpha], depthwise causal conv1d, the chunked gated delta rule,
  gated RMSNorm, out_proj). Without `fla` (no CPU kernels) the rule is Megatron's pure-torch
  one (models/runtime.py); with `fla` its Triton kernels;
- full attention: Megatron's SelfAttention with `attention_output_gate` (linear_qkv holds per
  query group [q heads, gate heads, k, v]), q/k RMSNorm, partial rotary (the angles cover the
  first rotary_dim of each head; Megatron rotates those and passes the rest through).
Every RMSNorm but the DeltaNet's output norm scales by (1 + weight) (`ZeroCenteredRMSNorm`).

Packed rows (models/packing.py): a DeltaNet layer runs each sample of the row on its own, so
each starts from a zero recurrent state and conv history, as it would unpacked (Megatron's
GatedDeltaNet refuses packed sequences itself).

Context parallelism (models/context.py): the attention layers split positions as Qwen3-VL's do;
a DeltaNet layer's recurrence needs every position in order, so it splits heads instead (which
megatron-core 0.16.1 leaves as a TODO): the per-token input projection runs on the rank's
positions, one all-to-all gives each rank the whole sequence of its share of the heads (key and
value heads divide by TP x CP: `check_context_parallel`), Megatron's own forward runs them
(`_HeadShare`), and one all-to-all brings the rank's positions back for the output projection.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from models.context import ContextParallel
from models.qwen35.config import Qwen35Spec, check_context_parallel, language_config
from models.qwen3vl.model import InterleavedMRoPE, Qwen3VLModel


class ZeroCenteredRMSNorm(nn.Module):
    """Qwen3.5's RMSNorm: x / rms(x) * (1 + weight), computed in float32 and cast back, as
    transformers computes it. The weight is stored as the checkpoint holds it (around 0), so
    conversion copies it unchanged. Built by Megatron's `build_module(config=, hidden_size=, eps=)`."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(hidden_size, dtype=config.params_dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).type_as(x)


class HeadNormAcrossTP(nn.RMSNorm):
    """The DeltaNet's output norm: one RMSNorm weight over each value head, shared by every head,
    while each TP rank holds only its heads. So the weight's gradient is the sum of every TP
    rank's; Megatron sums such gradients only for q/k norms and under sequence parallelism, and
    without the sum the TP replicas of this weight drift apart (1.3e-3 relative after one step).
    The weight enters the norm through Megatron's copy-to-TP-region: identity forward, gradient
    all-reduced over TP backward (nothing at TP 1). Built by Megatron's `build_module(config=,
    hidden_size=, eps=)`, as torch's RMSNorm (WrappedTorchNorm) was."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-6):
        super().__init__(hidden_size, eps=eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from megatron.core.tensor_parallel import copy_to_tensor_model_parallel_region

        return nn.functional.rms_norm(x, self.normalized_shape, copy_to_tensor_model_parallel_region(self.weight),
                                      self.eps)


@functools.cache  # one class per process: torch.compile's guards on the jit-fused methods key on it
def _packable_gated_delta_net():
    """Megatron's GatedDeltaNet whose forward also takes a packed row: the row's samples (the
    packed params' cu_seqlens along the sequence dim of an sbhd row) run one by one, each from a
    zero state. The in/out projections are per token, so only the conv and the recurrence need
    the boundaries; running each sample alone gives them exactly. Under context parallelism it
    runs this rank's heads over the whole sequence (module docstring)."""
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet

    class PackableGatedDeltaNet(GatedDeltaNet):
        def forward(self, hidden_states, attention_mask, *args, packed_seq_params=None, **kwargs):
            if isinstance(packed_seq_params, ContextParallel):
                return self._over_context_parallel(hidden_states, attention_mask, packed_seq_params)
            if packed_seq_params is None:
                return super().forward(hidden_states, attention_mask, *args, **kwargs)
            bounds = packed_seq_params.cu_seqlens_q.tolist()
            return self._per_sample(self, hidden_states, attention_mask, bounds, *args, **kwargs)

        @staticmethod
        def _per_sample(net, hidden_states, attention_mask, bounds, *args, **kwargs):
            outs = [GatedDeltaNet.forward(net, hidden_states[a:b], attention_mask, *args, **kwargs)
                    for a, b in zip(bounds, bounds[1:])]
            return torch.cat([out for out, _ in outs]), outs[0][1]

        def _over_context_parallel(self, hidden_states, attention_mask, cp: ContextParallel):
            """[s_local, b, h] (this rank's chunks) -> the layer's output there: in_proj per
            token, all-to-all to this rank's heads over the padded sequence (pads at its end,
            unseen by real tokens: the recurrence is causal), Megatron's forward on them (each
            sample of a packed row alone, the pads one more), all-to-all back, out_proj."""
            share = _HeadShare(self, *self._head_share_indices(cp.size, cp.rank))
            mixed, _ = self.in_proj(hidden_states)
            whole = cp.heads_to_sequence(mixed.index_select(-1, share.in_proj_columns))
            if cp.samples is None:
                out, _ = GatedDeltaNet.forward(share, whole, attention_mask)
            else:
                out, _ = self._per_sample(share, whole, attention_mask, cp.sample_bounds())
            return self.out_proj(cp.sequence_to_heads(out))

        def _head_share_indices(self, cp: int, rank: int):
            """_HeadShare's arguments for CP rank `rank`: (cp, in_proj columns, conv channels, value
            heads), made once per layer and CP layout. in_proj's columns [q, k, v, z, beta, alpha]
            are reordered to every rank's part of each section, ranks in order (heads_to_sequence
            gives rank r the r-th block); the conv's channels are [q, k, v]."""
            key = (cp, rank)
            if getattr(self, "_head_share", (None,))[0] != key:
                qk, v, heads = self.qk_dim // self.tp_size, self.v_dim // self.tp_size, self.num_v_heads_local_tp
                device = self.conv1d.weight.device
                columns = torch.cat([_section_share(qk, qk, v, v, heads, heads, cp=cp, rank=r) for r in range(cp)])
                channels = _section_share(qk, qk, v, cp=cp, rank=rank)
                self._head_share = (key, (cp, columns.to(device), channels.to(device),
                                          slice(rank * heads // cp, (rank + 1) * heads // cp)))
            return self._head_share[1]

    return PackableGatedDeltaNet


class _HeadShare:
    """One CP rank's share of a GatedDeltaNet's heads, as Megatron's `GatedDeltaNet.forward`
    reads a layer: it sizes every split by `tp_size`, so with tp_size = TP x CP, this rank's
    slices of the conv weight, `A_log` and `dt_bias`, and in/out projections that pass through
    (the caller runs them per token, around the all-to-alls), that forward runs the rank's heads
    unchanged (fla's and causal_conv1d's kernels where installed). The slices are taken in the
    forward, so their gradients reach the layer's parameters; each CP rank adds its heads' part,
    and Megatron's gradient reduction over DP x CP sums them. Anything else is the layer's own."""

    def __init__(self, net, cp: int, in_proj_columns: torch.Tensor, channels: torch.Tensor, heads: slice):
        self._net = net
        self.tp_size, self.sp_size = net.tp_size * cp, 1
        self.in_proj_columns = in_proj_columns
        self.conv1d = _DepthwiseCausalConv(net.conv1d.weight.index_select(0, channels),
                                           None if net.conv1d.bias is None else net.conv1d.bias.index_select(0, channels))
        self.A_log, self.dt_bias = net.A_log[heads], net.dt_bias[heads]

    @staticmethod
    def in_proj(x):
        return x, None

    out_proj = in_proj

    def __getattr__(self, name):
        return getattr(self._net, name)


def _section_share(*sizes: int, cp: int, rank: int) -> torch.Tensor:
    """Indices of rank `rank`'s 1/cp of each of the consecutive sections of `sizes`."""
    out, start = [], 0
    for n in sizes:
        out.append(torch.arange(start + rank * n // cp, start + (rank + 1) * n // cp))
        start += n
    return torch.cat(out)


class _DepthwiseCausalConv:
    """The DeltaNet's depthwise conv (nn.Conv1d, padding kernel - 1; the caller keeps the first
    seq_len outputs) on given weights: a rank's channels of the layer's conv."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        self.weight, self.bias = weight, bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.conv1d(x, self.weight, self.bias, padding=self.weight.shape[-1] - 1, groups=self.weight.shape[0])


def _stage_layer_ids(config) -> list[int]:
    """The language layers this pipeline stage builds (whole-model numbers from 0): Megatron's
    own rule (its layout, or the even split), as its hybrid block spec computes them."""
    from megatron.core.transformer.enums import LayerType
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    if config.pipeline_model_parallel_layout is not None:
        return list(config.pipeline_model_parallel_layout.get_layer_id_list(layer_type=LayerType.decoder))
    offset = get_transformer_layer_offset(config)
    return list(range(offset, offset + get_num_layers_to_build(config)))


class Qwen35Model(Qwen3VLModel):
    """As Qwen3VLModel, with the hybrid decoder above and partial rotary."""

    spec: Qwen35Spec

    def __init__(self, spec: Qwen35Spec, dtype: torch.dtype = torch.float32, tp: int = 1, recompute: str = "none",
                 pp: int = 1, layers=()):
        from megatron.core import parallel_state

        cp = parallel_state.get_context_parallel_world_size() if parallel_state.model_parallel_is_initialized() else 1
        if cp > 1:  # the DeltaNet's heads split over TP x CP (TP alone: check_layout)
            check_context_parallel(spec, tp, cp, "")
        super().__init__(spec, dtype, tp, recompute, pp, layers)
        # the angles of the rotary part of each head only (the rest passes through)
        self.language.rotary_pos_emb = InterleavedMRoPE(spec.rotary_dim, spec.rope_theta, spec.mrope_section)

    def _language_config(self, spec, dtype, tp, recompute, pp, layers):
        return language_config(spec, dtype, tp, recompute, pp, layers)

    def _decoder_spec(self):
        """A block spec with one layer spec per layer of this stage: DeltaNet or gated attention
        by `layer_types`, each with a SwiGLU MLP; zero-centred RMSNorms."""
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.ssm.gated_delta_net import GatedDeltaNetSubmodules
        from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
        from megatron.core.transformer.spec_utils import ModuleSpec
        from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

        from models.attention import CoreAttention

        def layer(linear: bool) -> ModuleSpec:
            spec = get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=True)
            sub = spec.submodules
            sub.input_layernorm = sub.pre_mlp_layernorm = ZeroCenteredRMSNorm
            if linear:
                # the DeltaNet's own output norm is a plain RMSNorm over each value head
                sub.self_attention = ModuleSpec(module=_packable_gated_delta_net(), submodules=GatedDeltaNetSubmodules(
                    in_proj=ColumnParallelLinear, out_norm=HeadNormAcrossTP, out_proj=RowParallelLinear))
            else:
                attention = sub.self_attention.submodules
                attention.q_layernorm = attention.k_layernorm = ZeroCenteredRMSNorm
                attention.core_attention = CoreAttention  # torch's kernel; packed rows too
            return spec

        kinds = self.spec.linear_layers
        return TransformerBlockSubmodules(layer_specs=[layer(kinds[i]) for i in _stage_layer_ids(self.config)],
                                          layer_norm=ZeroCenteredRMSNorm)
