"""Sequence packing: the samples of a right-padded micro-batch concatenated into one row, so
the model computes on real tokens only (a padded micro-batch of one long and several short
samples spends much of its compute on pads).

Each sample keeps its own M-RoPE positions (the padded batch's, which `rope_index` made per
row), and attention stays within each sample: Megatron's `PackedSeqParams` carry the samples'
boundaries (cu_seqlens) to the core attention (models/attention.py), which runs causal attention
per sample, so a packed row costs the sum of its samples' attention, not the square of its
length. The media need nothing: their tokens keep their order, so the vision features land where
they did. The trainer scores the packed row and scatters the per-token results back to the
padded layout, so losses and everything after them see the same [b, s] tensors either way.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from megatron.core.packed_seq_params import PackedSeqParams

from models.inputs import VLMInputs


@dataclass
class PackedRow:
    inputs: VLMInputs  # input_ids [1, S], position_ids [3, 1, S], the batch's media
    params: PackedSeqParams  # the samples' boundaries in the row
    rows: torch.Tensor  # [S] each packed token's row in the padded batch
    cols: torch.Tensor  # [S] and its column

    def unpack(self, packed: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        """Per-token values [1, S] -> the padded layout `shape` [b, s], zeros at pads."""
        out = torch.zeros(shape, dtype=packed.dtype, device=packed.device)
        return out.index_put((self.rows.to(packed.device), self.cols.to(packed.device)), packed[0])


def pack(inputs: VLMInputs) -> PackedRow:
    ids = inputs.input_ids
    real = torch.ones_like(ids, dtype=torch.bool) if inputs.attention_mask is None else inputs.attention_mask.bool()
    rows, cols = real.nonzero(as_tuple=True)  # row-major: sample after sample, in order
    lengths = real.sum(1)
    cu = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)]).int()
    # "sbhd": Megatron keeps its [s, b, ...] layout and rotary path (thd would need TE's kernels)
    params = PackedSeqParams(qkv_format="sbhd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                             max_seqlen_q=int(lengths.max()), max_seqlen_kv=int(lengths.max()))
    packed = replace(inputs, input_ids=ids[rows, cols][None], position_ids=inputs.position_ids[:, rows, cols][:, None],
                     attention_mask=None)
    return PackedRow(packed, params, rows, cols)
