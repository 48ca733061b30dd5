"""Qwen3-VL's vision tower on Megatron-Core blocks, with its DeepStack outputs.

Patch embedding (a Conv3d with kernel == stride and bias, run as transformers runs it: see
`embed_patches`), plus a learned position table of `num_position_embeddings` = side x side
entries bilinearly resampled (align_corners) to each image's patch grid; then Megatron
TransformerLayers (LayerNorm, GELU(tanh) MLP, biased linears) attending within each frame, with
Qwen2-VL's 2-D rotary embedding over (row, column); then the patch merger (2x2 patches -> one
LLM token). The outputs of the blocks listed in `deepstack_visual_indexes` each go through
their own merger, whose LayerNorm runs after the 2x2 merge ("post-shuffle"), and become the
DeepStack features the language model adds after its first layers.

As for Qwen2-VL (models/qwen2vl/vision.py), frames of the same size run as one batch without a
mask instead of all patches as one sequence: the same attention at frames x patches^2 cost.
The layers run one by one so the DeepStack blocks' outputs can be taken.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from models.qwen2vl.vision import vision_layer_spec, vision_position_ids
from models.qwen3vl.config import Qwen3VLSpec
from models.vision_blocks import run_block


class PatchMerger(nn.Module):
    """LayerNorm, 2x2 merge, Linear, GELU (exact), Linear. `postshuffle`: the norm runs over the
    merged 4 x width vector (the DeepStack mergers) instead of each patch (the final merger)."""

    def __init__(self, embed_dim: int, out_dim: int, merge: int, dtype: torch.dtype, postshuffle: bool = False):
        super().__init__()
        self.hidden = embed_dim * merge * merge
        self.postshuffle = postshuffle
        self.norm = nn.LayerNorm(self.hidden if postshuffle else embed_dim, eps=1e-6, dtype=dtype)
        self.linear_fc1 = nn.Linear(self.hidden, self.hidden, dtype=dtype)
        self.linear_fc2 = nn.Linear(self.hidden, out_dim, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x.view(-1, self.hidden) if self.postshuffle else x).view(-1, self.hidden)
        return self.linear_fc2(nn.functional.gelu(self.linear_fc1(x)))


def interpolation_taps(index: torch.Tensor, size: torch.Tensor, side: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Bilinear resampling (align_corners=True, edges clamped) of a `side`-long table onto an
    axis of `size` entries: for each target `index`, the two source entries and their weights.
    The same arithmetic as transformers' get_vision_interpolation_indices_and_weights, so the
    resampled positions agree bitwise."""
    src = index.to(torch.float32) * (side - 1) / torch.clamp(size - 1, min=1)
    floor = torch.floor(src)
    offsets = torch.arange(0, 2, device=index.device)
    taps = (floor.long()[:, None] + offsets).clamp(0, side - 1)
    weights = (1 - (src[:, None] - floor[:, None] - offsets).abs()).clamp(min=0)
    return taps, weights


class _ConvForwardLinearBackward(torch.autograd.Function):
    """The patch embedding: forward as transformers' Conv3d (its output bitwise), backward as
    the equal Linear's matrix products. Conv3d's backward on the CPU (oneDNN) took ~9 ms a
    micro-batch of the tiny benchmark, the matrix products ~1.4 ms; the gradients are the same
    sums in another order."""

    @staticmethod
    def forward(ctx, x, weight, bias, shape):
        """x [patches, C*T*P*P], weight [width, C*T*P*P] -> [patches, width]."""
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        out = F.conv3d(x.view(-1, *shape), weight.view(-1, *shape), bias, stride=shape[1:])
        return out.view(-1, weight.shape[0])

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        grad_x = grad @ weight if ctx.needs_input_grad[0] else None
        grad_w = grad.t() @ x if ctx.needs_input_grad[1] else None
        grad_b = grad.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_x, grad_w, grad_b, None


def _block(layer, hidden: torch.Tensor, rotary: torch.Tensor) -> torch.Tensor:
    """One vision block over frames as a batch: attention within each, no mask."""
    return layer(hidden_states=hidden, attention_mask=None, rotary_pos_emb=rotary)[0]


class Qwen3VisionModel(nn.Module):
    def __init__(self, spec: Qwen3VLSpec, config):
        super().__init__()
        from megatron.core.transformer.transformer_block import TransformerBlock

        self.spec = spec
        self.config = config
        dtype = config.params_dtype
        width = spec.vision_embed_dim
        patch_dim = spec.in_channels * spec.temporal_patch_size * spec.patch_size**2
        self.patch_embed = nn.Linear(patch_dim, width, bias=True, dtype=dtype)
        self.pos_embed = nn.Embedding(spec.num_position_embeddings, width, dtype=dtype)
        self.decoder = TransformerBlock(config=config, spec=vision_layer_spec(),
                                        pre_process=True, post_process=False, post_layer_norm=False)
        merge = spec.spatial_merge_size
        self.merger = PatchMerger(width, spec.hidden_size, merge, dtype)
        self.deepstack_merger_list = nn.ModuleList(
            PatchMerger(width, spec.hidden_size, merge, dtype, postshuffle=True) for _ in spec.deepstack_visual_indexes)
        head_dim = width // spec.vision_heads
        spatial = head_dim // 2
        inv_freq = 1.0 / (spec.vision_rope_theta ** (torch.arange(0, spatial, 2, dtype=torch.float) / spatial))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def embed_patches(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[patches, C*T*P*P] -> [patches, width]. The weight is stored as the equal Linear's, but
        applied as transformers' Conv3d (kernel == stride): the same sums in the same order, so
        the tower's output is bitwise transformers'. As a Linear the embeddings came 3.6e-6 apart
        and the tiny model's logits 1.2e-5 (measured), all of it float32 summation order."""
        s, w = self.spec, self.patch_embed.weight
        shape = (s.in_channels, s.temporal_patch_size, s.patch_size, s.patch_size)
        return _ConvForwardLinearBackward.apply(pixel_values.to(w.dtype), w, self.patch_embed.bias, shape)

    def rotary(self, grid_thw: torch.Tensor) -> torch.Tensor:
        """Angles [patches, 1, 1, head_dim]: rows then columns, the whole repeated (rotate-half)."""
        pos = vision_position_ids(grid_thw, self.spec.spatial_merge_size).float()
        freqs = (pos[..., None] * self.inv_freq.to(pos.device)).flatten(1)  # [n, spatial]: rows then columns
        return torch.cat([freqs, freqs], dim=-1)[:, None, None, :]

    def position_embedding(self, grid_thw: torch.Tensor) -> torch.Tensor:
        """The learned position table resampled to every frame's grid, in the processor's patch
        order (merge x merge blocks row-major), repeated for each temporal patch: [patches, width].
        Resampled once per distinct grid: a batch's media mostly share a few sizes (a per-item
        loop cost ~8 ms of a tiny training step)."""
        resampled: dict[tuple[int, int], torch.Tensor] = {}
        out = []
        for t, h, w in grid_thw.tolist():
            if (h, w) not in resampled:
                resampled[(h, w)] = self._resample_table(h, w)
            out.append(resampled[(h, w)].repeat(t, 1))
        return torch.cat(out)

    def _resample_table(self, h: int, w: int) -> torch.Tensor:
        side, device = self.spec.position_grid_side, self.pos_embed.weight.device
        pos = vision_position_ids(torch.tensor([[1, h, w]]), self.spec.spatial_merge_size).to(device)
        h_taps, h_w = interpolation_taps(pos[:, 0], torch.tensor(h, device=device), side)
        w_taps, w_w = interpolation_taps(pos[:, 1], torch.tensor(w, device=device), side)
        index = (h_taps[:, :, None] * side + w_taps[:, None, :]).reshape(-1, 4)
        taps = (h_w[:, :, None] * w_w[:, None, :]).reshape(-1, 4)
        return (self.pos_embed(index) * taps[:, :, None]).sum(1)  # in float32, as transformers

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """pixel_values [patches, C*T*P*P] as the HF processor emits them -> the merged features
        [tokens, hidden] and one DeepStack feature [tokens, hidden] per deepstack index."""
        x = self.embed_patches(pixel_values)
        x = x + self.position_embedding(grid_thw).to(x.dtype)
        taken = self._frames_as_batch(x, grid_thw)
        deepstack = [m(h) for m, h in zip(self.deepstack_merger_list, taken[:-1])]
        return self.merger(taken[-1]), deepstack

    def _frames_as_batch(self, x: torch.Tensor, grid_thw: torch.Tensor) -> list[torch.Tensor]:
        """The hidden states after each DeepStack block and after the last block, each in the
        processor's patch order. Frames of one size run as a batch [patches per frame, frames,
        width]: attention within each frame, no mask."""
        keep = list(self.spec.deepstack_visual_indexes)
        sizes = torch.repeat_interleave(grid_thw[:, 1:].prod(-1), grid_thw[:, 0]).tolist()  # per frame
        starts = [0]
        for n in sizes[:-1]:
            starts.append(starts[-1] + n)
        outs = [torch.empty_like(x) for _ in range(len(keep) + 1)]
        for hw in {(int(h), int(w)) for h, w in grid_thw[:, 1:].tolist()}:
            n = hw[0] * hw[1]
            frames = [s for s, size in zip(starts, sizes) if size == n]
            rows = torch.cat([torch.arange(s, s + n) for s in frames]).to(x.device)
            h = x[rows].view(len(frames), n, -1).transpose(0, 1).contiguous()  # [n, frames, width]
            rotary = self.rotary(torch.tensor([[1, *hw]])).to(x.device)  # the same for every frame of this size
            taken = []
            for i, layer in enumerate(self.decoder.layers):
                h = run_block(self.config, functools.partial(_block, layer, rotary=rotary), h)
                if i in keep:
                    taken.append(h)
            taken.append(h)
            for out, t in zip(outs, taken):
                out[rows] = t.transpose(0, 1).reshape(len(frames) * n, -1)
        return outs
