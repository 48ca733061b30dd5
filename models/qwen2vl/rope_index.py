"""3-D (temporal, height, width) position ids of Qwen2-VL's multimodal RoPE (M-RoPE).

Text tokens count up by one on all three axes; the tokens of an image or video take their
(t, h, w) grid coordinates offset by the position where the media starts, and the text after it
continues from the largest position used plus one. This is the original Qwen2-VL definition and
vLLM's. transformers 5.x continues after a video from max(h, w) instead, ignoring t: the two
agree except for videos with more temporal patches than merged rows and columns, where we follow
vLLM, because vLLM is what samples the responses we train on.

Qwen2.5-VL spaces a video's temporal positions by time: temporal patch i sits at
int(i * second_per_grid_t * tokens_per_second) (the processor's `second_per_grid_ts` =
temporal_patch_size / sampled fps; `tokens_per_second` from the vision config), images keep
t = 0. As vLLM 0.32 (`Qwen2_5_VLForConditionalGeneration.get_mrope_input_positions`) does, the
factor is computed in double precision from the float32 `second_per_grid_ts`, truncated toward
zero, and the text after the video continues from the largest position used plus one.
transformers 5 (`Qwen2_5_VLModel.get_rope_index`) computes the factor in float32 (the
truncation can differ by one where the product is within float32 rounding of an integer) and
continues after max(h, w) whatever the scaled temporal extent is: the two disagree after any
video whose last temporal position int((t - 1) * factor) reaches max(h, w) merged tokens.
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
    second_per_grid_ts: torch.Tensor | list[float] | None = None,  # [videos] (Qwen2.5-VL)
    tokens_per_second: float = 1.0,
) -> torch.Tensor:
    """Position ids [3, b, s]. Padding positions (mask 0) get 1 (they are never attended).
    Without `second_per_grid_ts` (Qwen2-VL) temporal patches are one position apart."""
    b, s = input_ids.shape
    out = torch.ones(3, b, s, dtype=torch.long)
    grids = {
        image_token_id: iter(image_grid_thw.tolist() if image_grid_thw is not None else []),
        video_token_id: iter(video_grid_thw.tolist() if video_grid_thw is not None else []),
    }
    n_videos = len(video_grid_thw) if video_grid_thw is not None else 0
    if second_per_grid_ts is None:
        factors = iter([1.0] * n_videos)
    else:
        seconds = torch.as_tensor(second_per_grid_ts, dtype=torch.float32).flatten().tolist()  # float32 -> double, as vLLM's .item()
        if len(seconds) != n_videos:
            raise ValueError(f"{len(seconds)} second_per_grid_ts values for {n_videos} videos")
        factors = iter([x * tokens_per_second for x in seconds])
    for row in range(b):
        keep = attention_mask[row].bool() if attention_mask is not None else torch.ones(s, dtype=torch.bool)
        ids = input_ids[row][keep].tolist()
        pieces, pos, i = [], 0, 0
        while i < len(ids):
            tok = ids[i]
            if tok in grids:
                grid = next(grids[tok], None)
                if grid is None:  # a media token beyond the media given: one sampled into a response?
                    raise ValueError(f"input_ids hold more {'image' if tok == image_token_id else 'video'} "
                                     "media tokens than the grid sizes given describe")
                t, h, w = grid
                h, w = h // merge, w // merge
                temporal = torch.arange(t)
                factor = next(factors) if tok == video_token_id else 1.0
                if factor != 1.0:  # float64 product truncated toward zero, as numpy's astype(int64)
                    temporal = torch.tensor([int(j * factor) for j in range(t)], dtype=torch.long)
                tt, hh, ww = torch.meshgrid(temporal, torch.arange(h), torch.arange(w), indexing="ij")
                piece = torch.stack([tt.flatten(), hh.flatten(), ww.flatten()]) + pos
                pieces.append(piece)
                pos = int(piece.max()) + 1  # = pos + max(t, h, w) when factor is 1
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


def position_ids(spec, batch: dict) -> torch.Tensor:
    """The family's position-id hook (models/family.py): M-RoPE positions of a processor batch."""
    seconds = batch.get("second_per_grid_ts")
    if spec.is_qwen25 and batch.get("video_grid_thw") is not None and seconds is None:
        # vLLM always has the processor's value; guessing one would shift temporal positions
        raise ValueError("Qwen2.5-VL video inputs need the processor's second_per_grid_ts in the batch")
    return rope_index(batch["input_ids"], batch.get("image_grid_thw"), batch.get("video_grid_thw"),
                      spec.image_token_id, spec.video_token_id, spec.spatial_merge_size, batch.get("attention_mask"),
                      seconds if spec.is_qwen25 else None, spec.tokens_per_second)
