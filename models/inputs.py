"""What the trainer's model takes: a (micro-)batch of token ids, position ids and media, as an
HF processor makes it. The same for every model family (models/family.py)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class VLMInputs:
    """One (micro-)batch, as the HF processor makes it, plus the 3-D position ids."""

    input_ids: torch.Tensor  # [b, s]
    position_ids: torch.Tensor  # [3, b, s]
    attention_mask: torch.Tensor | None = None  # [b, s] 1 = real token (right padding only)
    pixel_values: torch.Tensor | None = None  # [image patches, C*T*P*P]
    image_grid_thw: torch.Tensor | None = None  # [images, 3]
    pixel_values_videos: torch.Tensor | None = None
    video_grid_thw: torch.Tensor | None = None
    # Shared media (GRPO: a prompt's n responses show the same image): the pixel values hold
    # each distinct image once, the grids hold one row per image occurrence in the batch, and
    # these say which distinct image each occurrence is. The vision tower then runs once per
    # distinct image; gradients of its copies add up, as they would for separate copies.
    image_sources: torch.Tensor | None = None  # [image occurrences] index into the distinct images
    video_sources: torch.Tensor | None = None

    @classmethod
    def from_processor(cls, spec, batch: dict) -> "VLMInputs":
        """The processor's `batch` for the model `spec` describes; its family computes the
        position ids."""
        from models.family import family_of

        attention_mask = batch.get("attention_mask")
        if attention_mask is not None and bool((attention_mask[:, 0] == 0).any()):
            raise ValueError("left padding is not supported: set the tokenizer's padding_side='right'")
        position_ids = family_of(spec).position_ids(spec, batch)
        return cls(batch["input_ids"], position_ids, attention_mask, batch.get("pixel_values"),
                   batch.get("image_grid_thw"), batch.get("pixel_values_videos"), batch.get("video_grid_thw"),
                   batch.get("image_sources"), batch.get("video_sources"))

    def to(self, device) -> "VLMInputs":
        return VLMInputs(**{k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in vars(self).items()})

    def text_only(self) -> "VLMInputs":
        """Without the media: what a pipeline stage after the first needs (ids for the labels,
        M-RoPE positions for its layers' rotary embedding)."""
        return VLMInputs(self.input_ids, self.position_ids, self.attention_mask)


def per_frame_grids(grid_thw: torch.Tensor | None) -> torch.Tensor | None:
    """[media, 3] -> [temporal patches, 3]: one (1, h, w) row per temporal patch, in order."""
    if grid_thw is None:
        return None
    grids = torch.repeat_interleave(grid_thw, grid_thw[:, 0], dim=0)
    grids[:, 0] = 1
    return grids
