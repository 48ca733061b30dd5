"""3-D (temporal, height, width) position ids of Qwen3-VL's M-RoPE: a port of transformers'
`Qwen3VLModel.get_rope_index`.

Qwen3-VL's processor writes a video as one group of tokens per temporal patch, each preceded by
its timestamp as text ("<0.2 seconds><|vision_start|>...<|vision_end|>"), so the time lives in
the text and every group's positions are those of a one-frame image: t, h and w start at the
position where the group starts, and the text after it continues from there + max(h, w) merged
tokens (= the largest position used + 1, since t = 1). transformers splits `video_grid_thw`
into t rows of (1, h, w) for this; so does `rope_index`, then Qwen2-VL's walk over the tokens
(models/qwen2vl/rope_index.py) gives the same positions: it advances by the largest position
used + 1, which for t = 1 is the same as transformers' max(h, w).
"""

from __future__ import annotations

import torch

from models.inputs import per_frame_grids
from models.qwen2vl.rope_index import rope_index as _qwen2_rope_index


def rope_index(input_ids: torch.Tensor, image_grid_thw: torch.Tensor | None, video_grid_thw: torch.Tensor | None,
               image_token_id: int, video_token_id: int, merge: int,
               attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Position ids [3, b, s]; padding positions (mask 0) get 1 (they are never attended)."""
    return _qwen2_rope_index(input_ids, image_grid_thw, per_frame_grids(video_grid_thw), image_token_id,
                             video_token_id, merge, attention_mask)


def position_ids(spec, batch: dict) -> torch.Tensor:
    """M-RoPE positions of a processor batch (the family hook, models/family.py)."""
    return rope_index(batch["input_ids"], batch.get("image_grid_thw"), batch.get("video_grid_thw"),
                      spec.image_token_id, spec.video_token_id, spec.spatial_merge_size, batch.get("attention_mask"))
