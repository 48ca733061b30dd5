"""3-D (temporal, height, width) position ids of Qwen2-VL's multimodal RoPE (M-RoPE).

Text tokens count up by one on all three axes; the tokens of an image or video take their
(t, h, w) grid coordinates offset by the position where the media starts, and the text after it
continues from the largest position used plus one. This is the original Qwen2-VL definition and
vLLM's. transformers 5.x continues after a video from max(h, w) instead, ignoring t: the two
agree except for videos with more temporal patches than merged rows and columns, where we follow
vLLM, because vLLM is what samples the responses we train on.
"""

from __future__ import annotations

import torch


def rope_index(
    input_ids: torch.Tensor,  # [b, s]
    image_grid_thw: torch.Tensor | None,
    video_grid_thw: torch.Tensor | None,
    image_token_id: int,
    video_token_id: int,
    merge: int,
    attention_mask: torch.Tensor | None = None,  # [b, s], 1 = real token
) -> torch.Tensor:
    """Position ids [3, b, s]. Padding positions (mask 0) get 1 (they are never attended)."""
    b, s = input_ids.shape
    out = torch.ones(3, b, s, dtype=torch.long)
    grids = {
        image_token_id: iter(image_grid_thw.tolist() if image_grid_thw is not None else []),
        video_token_id: iter(video_grid_thw.tolist() if video_grid_thw is not None else []),
    }
    for row in range(b):
        keep = attention_mask[row].bool() if attention_mask is not None else torch.ones(s, dtype=torch.bool)
        ids = input_ids[row][keep].tolist()
        pieces, pos, i = [], 0, 0
        while i < len(ids):
            tok = ids[i]
            if tok in grids:
                t, h, w = next(grids[tok])
                h, w = h // merge, w // merge
                tt, hh, ww = torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij")
                pieces.append(torch.stack([tt.flatten(), hh.flatten(), ww.flatten()]) + pos)
                pos += max(t, h, w)
                i += t * h * w
                if i > len(ids) or any(x != tok for x in ids[i - t * h * w : i]):
                    raise ValueError("media tokens in input_ids do not match the grid sizes given")
            else:
                j = i
                while j < len(ids) and ids[j] not in grids:
                    j += 1
                pieces.append(torch.arange(pos, pos + j - i).expand(3, -1))
                pos += j - i
                i = j
        out[:, row, keep] = torch.cat(pieces, dim=1)
    return out
