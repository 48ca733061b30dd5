"""A token budget per sample (`data.max_sample_tokens`): a decoded sample whose prompt, media tokens
and the response limit would exceed it gets fewer video frames, chosen uniformly over the frames
the reader decoded (the same clip, sampled more sparsely), so that it fits; it is never cut
mid-sample. A sample that cannot fit even at one temporal group per video (or an image sample
over the budget) raises `MediaError("over_token_budget")`: the reader skips it, counts it and
writes its key to the quarantine log.

Media tokens as the Qwen-VL processors count them (models/family.py's media sizing: `factor` is
patch size x spatial merge, the side multiple the reader resizes to): an image of H x W pixels is
(H / factor) x (W / factor) tokens; a video of T frames is ceil(T / temporal_patch_size) temporal
groups of that many tokens each.

The prompt's tokens are counted by `text_tokens` (the run's tokenizer) or, without one, as its
UTF-8 bytes (a byte-level BPE never makes more tokens than bytes, so the estimate errs on the
safe side); `TEMPLATE_TOKENS` allows for the chat template around it and each medium's
vision start/end markers.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from dataio.errors import MediaError

TEMPLATE_TOKENS = 32  # system prompt, role markers and the generation prompt of a Qwen-VL chat template
MARKER_TOKENS = 2  # <|vision_start|> ... <|vision_end|> around each image or video


@dataclass(frozen=True)
class TokenBudget:
    max_tokens: int  # data.max_sample_tokens (> 0)
    response_tokens: int = 0  # kept free for the response (RL: rollout.sampling.max_tokens)
    factor: int = 28  # media side multiple: patch size x spatial merge (data.media.factor)
    temporal_patch_size: int = 2  # frames per temporal group
    text_tokens: Callable[[str], int] | None = None  # the prompt's token count; None: its UTF-8 bytes

    def image_tokens(self, image) -> int:
        w, h = image.size
        return (h // self.factor) * (w // self.factor)

    def group_tokens(self, video: np.ndarray) -> int:
        """Tokens of one temporal group of a [T, H, W, 3] video."""
        return (video.shape[1] // self.factor) * (video.shape[2] // self.factor)

    def video_tokens(self, video: np.ndarray, frames: int | None = None) -> int:
        frames = video.shape[0] if frames is None else frames
        return math.ceil(frames / self.temporal_patch_size) * self.group_tokens(video)

    def fixed_tokens(self, prompt: str | None, images: list, videos: list) -> int:
        """Everything but the videos' frames: prompt, template, markers, images, the response."""
        text = prompt or ""
        count = self.text_tokens(text) if self.text_tokens else len(text.encode("utf-8"))
        return (count + TEMPLATE_TOKENS + MARKER_TOKENS * (len(images) + len(videos))
                + sum(self.image_tokens(im) for im in images) + self.response_tokens)

    def tokens(self, prompt: str | None, images: list, videos: list) -> int:
        return self.fixed_tokens(prompt, images, videos) + sum(self.video_tokens(v) for v in videos)

    def fit(self, prompt: str | None, images: list, videos: list) -> tuple[list, int]:
        """(videos, frames dropped): the videos unchanged when the sample fits, else each with
        at most the same number of temporal groups, the most that fit. MediaError when not even
        one group per video fits, or a sample without video is over the budget."""
        total = self.tokens(prompt, images, videos)
        if total <= self.max_tokens:
            return videos, 0
        room = self.max_tokens - self.fixed_tokens(prompt, images, videos)
        groups = [math.ceil(v.shape[0] / self.temporal_patch_size) for v in videos]
        cost = lambda k: sum(min(g, k) * self.group_tokens(v) for g, v in zip(groups, videos))  # noqa: E731
        if not videos or cost(1) > room:
            least = total - sum(self.video_tokens(v) for v in videos) + cost(1)
            raise MediaError("over_token_budget",
                             f"{total} tokens (prompt, media and the {self.response_tokens}-token response limit)"
                             + (f", {least} at one temporal group per video" if videos else "")
                             + f"; data.max_sample_tokens is {self.max_tokens}")
        k = max(k for k in range(1, max(groups) + 1) if cost(k) <= room)
        out = []
        for v in videos:
            keep = min(v.shape[0], k * self.temporal_patch_size)
            if keep < v.shape[0]:
                v = v[np.linspace(0, v.shape[0] - 1, keep).round().astype(int)]  # uniform over the clip
            out.append(v)
        dropped = sum(a.shape[0] for a in videos) - sum(b.shape[0] for b in out)
        return out, dropped
