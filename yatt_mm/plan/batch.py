"""The largest training micro-batch of an RL step: its rows, length, scored and media tokens."""

from __future__ import annotations

from dataclasses import dataclass

from yatt_mm.plan.constants import PROMPT_TEXT_TOKENS



@dataclass(frozen=True)
class MicroBatchShape:
    """The largest micro-batch the trainer sees: `rows` right-padded rows of `seq` tokens."""

    rows: int
    seq: int
    scored: int  # positions whose logprob the loss needs, all rows (RL: the responses)
    media_tokens: int  # LLM positions filled by vision features, all rows (distinct media: no sharing assumed)
    frame_tokens: int  # merged tokens per image or video frame (the vision tower attends within one)

    @property
    def tokens(self) -> int:
        return self.rows * self.seq


def context_share(shape: MicroBatchShape, cp: int) -> MicroBatchShape:
    """The fullest context-parallel rank's share of `shape` (models/context.py): each row padded
    to a multiple of 2 x cp and cut into 2 x cp chunks, rank r holding chunks r and 2cp-1-r, so
    every rank's rows are padded / cp long. The responses end the rows, in the last chunk (rank
    0's) and, when longer than a chunk, the ones before it (other ranks'): the fullest rank scores
    at most one chunk of each row. Media: the vision tower's frames are split over the CP ranks
    (models/context.py `ContextParallel.vision`), the fullest rank running ceil(frames / cp) of
    them (all of them when there are fewer than cp)."""
    if cp == 1:
        return shape
    from models.context import padded_length

    padded = padded_length(shape.seq, cp)
    chunk = padded // (2 * cp)
    scored = shape.rows * min(shape.scored // shape.rows, chunk)
    media = shape.media_tokens
    frames = media // max(shape.frame_tokens, 1)
    if frames >= cp:
        media = -(-frames // cp) * shape.frame_tokens
    return MicroBatchShape(rows=shape.rows, seq=padded // cp, scored=scored, media_tokens=media,
                           frame_tokens=shape.frame_tokens)


def media_per_sample(media, factor: int | None = None) -> tuple[int, int]:
    """(media tokens, tokens per frame) of the larger of one image and one video at the
    data.media limits (dataio/decode.py MediaConfig): a merged token covers factor^2 pixels,
    `factor` the model's (its family's `media_factor`; default data.media.factor)."""
    per_token = (factor or media.side) ** 2
    image = media.image_max_pixels // per_token
    frames = media.video_max_frames if media.video_fps is not None else min(media.video_frames, media.video_max_frames)
    frame = media.video_max_pixels // per_token
    video = -(-frames // 2) * frame  # two frames make one temporal patch
    return (video, frame) if video >= image else (image, image)


def rl_micro_batch(cfg, seq_len: int = 0, media_tokens: int = -1, frame_tokens: int = 0,
                   factor: int | None = None) -> MicroBatchShape:
    """The largest micro-batch of an RL step: rows as long as vLLM allows (max_model_len), as
    many as run.micro_batch_tokens holds (at least one: a longer sample gets its own).
    `factor`: the pixels per merged token's side (see media_per_sample)."""
    seq = seq_len or cfg.rollout.engine.max_model_len
    answer = min(cfg.rollout.sampling.max_tokens, seq - 1)
    default_media, default_frame = media_per_sample(cfg.data.media, factor)
    media = default_media if media_tokens < 0 else media_tokens
    media = max(0, min(media, seq - answer - PROMPT_TEXT_TOKENS))
    rows = max(1, cfg.run.micro_batch_tokens // seq)
    return MicroBatchShape(rows=rows, seq=seq, scored=rows * answer, media_tokens=rows * media,
                           frame_tokens=max(1, min(frame_tokens or default_frame, media or 1)))
