"""Qwen2-VL's and Qwen2.5-VL's vision towers on Megatron-Core blocks.

Patch embedding (the Conv3d with kernel == stride, written as the equal Linear over flattened
patches), a TransformerBlock with bidirectional attention inside each frame, 2-D rotary
embedding over (row, column) of every patch, and the patch merger (2x2 patches -> one LLM token).

Qwen2.5-VL differs in the blocks (RMSNorm, gated SiLU MLP with bias: `config.vision_config`),
the merger's norm (RMSNorm), and attention: blocks not in `fullatt_block_indexes` attend only
within windows of `window_size` pixels (a square of merged tokens) of a frame, the others within
the frame. transformers and vLLM permute the patches so each window is contiguous and run
variable-length attention; here each block gathers its units (windows or frames) of one size
into a batch, runs it unmasked and scatters the result back to the processor's order
(`AttentionGroups`): the same attention, as it is permutation-equivariant, with no
patches x patches mask.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import nn

from models.qwen2vl.config import Qwen2VLSpec
from models.vision_blocks import run_block


def vision_layer_spec():
    """Local (no TransformerEngine) layer with LayerNorm, biased linears and an explicit mask.
    The shipped `get_vit_layer_with_local_spec()` uses a causal mask; a vision encoder must not."""
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.mlp import MLP, MLPSubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

    from models.attention import CoreAttention

    return ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=WrappedTorchNorm,
            self_attention=ModuleSpec(
                module=SelfAttention,
                params={"attn_mask_type": AttnMaskType.arbitrary},
                submodules=SelfAttentionSubmodules(
                    linear_qkv=ColumnParallelLinear,
                    core_attention=CoreAttention,
                    linear_proj=RowParallelLinear,
                ),
            ),
            self_attn_bda=get_bias_dropout_add,
            pre_mlp_layernorm=WrappedTorchNorm,
            mlp=ModuleSpec(
                module=MLP,
                submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear),
            ),
            mlp_bda=get_bias_dropout_add,
        ),
    )


def vision_position_ids(grid_thw: torch.Tensor, merge: int) -> torch.Tensor:
    """(row, column) of every patch, in the order the processor emits them: merge x merge blocks
    row-major, repeated for every temporal patch. Shape [patches, 2]."""
    out = []
    for t, h, w in grid_thw.tolist():
        rows, cols = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
        shape = (h // merge, merge, w // merge, merge)
        rows = rows.reshape(shape).transpose(1, 2).flatten()
        cols = cols.reshape(shape).transpose(1, 2).flatten()
        out.append(torch.stack([rows, cols], dim=-1).repeat(t, 1))
    return torch.cat(out)


def frame_ids(grid_thw: torch.Tensor) -> torch.Tensor:
    """The frame (temporal patch) each patch belongs to, in the processor's order: [patches].
    Qwen2-VL's blocks and Qwen2.5-VL's full-attention blocks attend within a frame. On the host,
    wherever the grid is (the model's inputs are on the GPU there)."""
    grid_thw = grid_thw.cpu()
    return torch.repeat_interleave(torch.arange(int(grid_thw[:, 0].sum())),
                                   torch.repeat_interleave(grid_thw[:, 1] * grid_thw[:, 2], grid_thw[:, 0]))


def window_ids(grid_thw: torch.Tensor, merge: int, window_merged: int) -> torch.Tensor:
    """Qwen2.5-VL's attention windows: for each patch (in the processor's order) the window it
    attends within, the `window_merged` x `window_merged` square of merged tokens of its frame
    that holds its merged token (windows tile each frame from the top-left; edge windows are
    smaller), which is what transformers' and vLLM's `get_window_index` group together. [patches]."""
    ids, offset = [], 0
    for t, h, w in grid_thw.tolist():
        pos = vision_position_ids(torch.tensor([[1, h, w]]), merge)  # [h*w, 2] (row, col) in order
        wr, wc = pos[:, 0] // merge // window_merged, pos[:, 1] // merge // window_merged
        n_wc = -(-(w // merge) // window_merged)
        per_frame = wr * n_wc + wc
        n_windows = int(per_frame.max()) + 1
        for f in range(t):
            ids.append(per_frame + offset + f * n_windows)
        offset += t * n_windows
    return torch.cat(ids)


@dataclass
class AttentionGroups:
    """The patches grouped by the unit (frame or window) they attend within, units of one size
    together: each entry runs as one batch [n, units, h] with no mask, so attention costs
    units x n^2 instead of patches^2 (a minute of video at CP 4: 30,720 patches a rank, whose
    window and frame masks of patches x patches alone were 3.5 GiB in bf16)."""

    rows: list[torch.Tensor]  # per size: the units' patch rows [units * n], unit after unit
    sizes: list[int]  # per size: n, the patches of each of its units
    angles: list[torch.Tensor]  # per size: the rotary angles [n, units, 1, d] of those rows

    @classmethod
    def of(cls, ids: torch.Tensor, rotary: torch.Tensor) -> "AttentionGroups":
        """`ids`: each patch's unit; `rotary`: every patch's angles [patches, 1, 1, d]."""
        _, dense = torch.unique(ids, return_inverse=True)
        order = torch.argsort(dense, stable=True)  # each unit's patches together, in their order
        units = order.split(torch.bincount(dense).tolist())
        by_size: dict[int, list[torch.Tensor]] = {}
        for unit in units:
            by_size.setdefault(len(unit), []).append(unit)
        rows = [torch.cat(u).to(rotary.device) for u in by_size.values()]
        sizes = list(by_size)
        angles = [rotary[r].view(len(r) // n, n, -1)[:, :, None].transpose(0, 1).contiguous()
                  for r, n in zip(rows, sizes)]
        return cls(rows, sizes, angles)

    def run(self, layer, x: torch.Tensor) -> torch.Tensor:
        """One Megatron layer over every unit: x [patches, h] -> [patches, h]."""
        out = torch.empty_like(x)
        for rows, n, angles in zip(self.rows, self.sizes, self.angles):
            batch = x[rows].view(-1, n, x.shape[-1]).transpose(0, 1)  # [n, units, h]
            y, _ = layer(hidden_states=batch.contiguous(), attention_mask=None, rotary_pos_emb=angles)
            out[rows] = y.transpose(0, 1).reshape(-1, x.shape[-1])
        return out


class PatchMerger(nn.Module):
    def __init__(self, embed_dim: int, out_dim: int, merge: int, dtype: torch.dtype, rms_norm: bool = False):
        super().__init__()
        self.hidden = embed_dim * merge * merge
        norm = nn.RMSNorm if rms_norm else nn.LayerNorm  # Qwen2.5-VL: RMSNorm (weight only)
        self.ln_q = norm(embed_dim, eps=1e-6, dtype=dtype)
        self.fc1 = nn.Linear(self.hidden, self.hidden, dtype=dtype)
        self.fc2 = nn.Linear(self.hidden, out_dim, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.ln_q(x).view(-1, self.hidden)
        return self.fc2(nn.functional.gelu(self.fc1(x)))


class Qwen2VisionModel(nn.Module):
    def __init__(self, spec: Qwen2VLSpec, config):
        super().__init__()
        from megatron.core.transformer.transformer_block import TransformerBlock

        self.spec = spec
        self.config = config
        dtype = config.params_dtype
        patch_dim = spec.in_channels * spec.temporal_patch_size * spec.patch_size**2
        self.patch_embed = nn.Linear(patch_dim, spec.vision_embed_dim, bias=False, dtype=dtype)
        self.decoder = TransformerBlock(config=config, spec=vision_layer_spec(),
                                        pre_process=True, post_process=False, post_layer_norm=False)
        self.merger = PatchMerger(spec.vision_embed_dim, spec.hidden_size, spec.spatial_merge_size, dtype,
                                  rms_norm=spec.is_qwen25)
        head_dim = spec.vision_embed_dim // spec.vision_heads
        spatial = head_dim // 2
        inv_freq = 1.0 / (spec.vision_rope_theta ** (torch.arange(0, spatial, 2, dtype=torch.float) / spatial))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def rotary(self, grid_thw: torch.Tensor) -> torch.Tensor:
        """Angles [patches, 1, 1, head_dim]: rows rotate the first quarter of each half, columns
        the second; Megatron's rotate-half application then matches Qwen2-VL's."""
        pos = vision_position_ids(grid_thw, self.spec.spatial_merge_size).float()
        freqs = pos[..., None] * self.inv_freq.to(pos.device)  # [n, 2, spatial/2]
        freqs = freqs.flatten(1)  # [n, spatial]: rows then columns
        return torch.cat([freqs, freqs], dim=-1)[:, None, None, :]

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """pixel_values [patches, C*T*P*P] as the HF processor emits them -> [tokens, hidden]."""
        x = self.patch_embed(pixel_values.to(self.patch_embed.weight.dtype))
        if not self.spec.is_qwen25:
            return self.merger(self._frames_as_batch(x, grid_thw))
        # Qwen2.5-VL: window or full (frame) attention per block, so the layers run one by one,
        # each over its units as batches (the block has no final norm and nothing else to do
        # between layers)
        rotary = self.rotary(grid_thw).to(x.device)
        window = self.spec.window_size // self.spec.spatial_merge_size // self.spec.patch_size
        full = AttentionGroups.of(frame_ids(grid_thw), rotary)
        windows = AttentionGroups.of(window_ids(grid_thw, self.spec.spatial_merge_size, window), rotary)
        for i, layer in enumerate(self.decoder.layers):
            groups = full if i in self.spec.fullatt_block_indexes else windows
            x = run_block(self.config, functools.partial(groups.run, layer), x)
        return self.merger(x)

    def _frames_as_batch(self, x: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """Qwen2-VL attends within each frame only, so frames of the same size run as one batch
        [patches per frame, frames, hidden] without a mask: the cost is frames x patches^2, not
        (all patches)^2 as one sequence with a block-diagonal mask would be (64 images of one
        RL micro-batch: 64x less attention). Patches of a frame are contiguous in the
        processor's order; the result comes back in that order."""
        sizes = torch.repeat_interleave(grid_thw[:, 1:].prod(-1), grid_thw[:, 0]).tolist()  # per frame
        starts = [0]
        for n in sizes[:-1]:
            starts.append(starts[-1] + n)
        out = torch.empty_like(x)
        for hw in {(int(h), int(w)) for h, w in grid_thw[:, 1:].tolist()}:
            n = hw[0] * hw[1]
            frames = [s for s, size in zip(starts, sizes) if size == n]
            rows = torch.cat([torch.arange(s, s + n) for s in frames]).to(x.device)
            batch = x[rows].view(len(frames), n, -1).transpose(0, 1)  # [n, frames, h]
            rotary = self.rotary(torch.tensor([[1, *hw]])).to(x.device)  # the same for every frame of this size
            y = self.decoder(hidden_states=batch.contiguous(), attention_mask=None, rotary_pos_emb=rotary)
            out[rows] = y.transpose(0, 1).reshape(len(frames) * n, -1)
        return out
