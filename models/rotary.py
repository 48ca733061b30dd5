"""Rotary embeddings applied with their cos and sin computed once per forward.

Without Transformer Engine's fused kernel, Megatron-Core's rotary application
(`rope_utils._apply_rotary_pos_emb_bshd`) computes cos and sin of the same angles in every layer,
once for Q and once for K, and copies the rotated tensor once more to append an empty
pass-through part. Inside `angles_computed_once()` (the model's forward) the first call for an
angle tensor keeps its cos and sin, and later calls with the same tensor reuse them; the
results are bitwise the same (the same ops on the same values), about 4% of a tiny-model
train step on this CPU. Outside it (a recompute in the backward pass) Megatron's own code runs.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from megatron.core.models.common.embeddings import rope_utils

_megatron_apply = rope_utils._apply_rotary_pos_emb_bshd
_angles: list | None = None  # (freqs, mscale, dtype, cos, sin) of the forward that runs


@contextmanager
def angles_computed_once():
    """Reuse cos and sin of an angle tensor across the layers of one forward; dropped after it."""
    global _angles
    outer, _angles = _angles, []
    try:
        yield
    finally:
        _angles = outer


def _apply_rotary_pos_emb_bshd(t, freqs, rotary_interleaved: bool = False, multi_latent_attention: bool = False,
                               mscale: float = 1.0):
    if _angles is None or multi_latent_attention:
        return _megatron_apply(t, freqs, rotary_interleaved, multi_latent_attention, mscale)
    cos, sin = _cos_sin(freqs, mscale, t.dtype)
    rot_dim = freqs.shape[-1]
    if t.shape[-1] == rot_dim:
        return t * cos + rope_utils._rotate_half(t, rotary_interleaved) * sin
    t, t_pass = t[..., :rot_dim], t[..., rot_dim:]
    return torch.cat((t * cos + rope_utils._rotate_half(t, rotary_interleaved) * sin, t_pass), dim=-1)


def _cos_sin(freqs: torch.Tensor, mscale: float, dtype: torch.dtype):
    for f, m, d, cos, sin in _angles:
        if f is freqs and m == mscale and d == dtype:  # the same tensor object: its values too
            return cos, sin
    cos, sin = (torch.cos(freqs) * mscale).to(dtype), (torch.sin(freqs) * mscale).to(dtype)
    _angles.append((freqs, mscale, dtype, cos, sin))
    return cos, sin


rope_utils._apply_rotary_pos_emb_bshd = _apply_rotary_pos_emb_bshd
