"""From rollouts to training tensors: groups, per-response training samples, cost, micro-batches.

A `TrainSample` is one response with everything the trainer needs: prompt + response token ids,
the media's pixel values and grids (from the policy's HF processor, the same preprocessing vLLM
ran), the loss mask, the advantage and vLLM's logprobs. It packs into plain tensors so it can
move between DP ranks without pickle.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from models.qwen2vl.model import VLMInputs
from models.trainer import MicroBatch
from yatt_mm.rollout.engine import Request, Response


@dataclass
class Prompt:
    """One data sample as the controller sees it (media stay in this process)."""

    key: str
    question: str
    answer: str
    images: list = field(default_factory=list)
    videos: list = field(default_factory=list)
    metadata: dict = field(default_factory=dict)

    def request(self) -> Request:
        parts = [{"type": "image"} for _ in self.images] + [{"type": "video"} for _ in self.videos]
        return Request([{"role": "user", "content": parts + [{"type": "text", "text": self.question}]}],
                       images=list(self.images), videos=list(self.videos))


@dataclass
class Group:
    """One prompt with its n responses and their rewards (the GRPO unit)."""

    prompt: Prompt
    responses: list[Response]
    rewards: list[float]
    reward_parts: dict[str, list[float]] = field(default_factory=dict)


_TENSORS = ("input_ids", "loss_mask", "rollout_logprobs", "pixel_values", "image_grid_thw",
            "pixel_values_videos", "video_grid_thw")


@dataclass
class TrainSample:
    input_ids: torch.Tensor  # [s] prompt + response
    loss_mask: torch.Tensor  # [s] 1 where the logit predicts a response token
    rollout_logprobs: torch.Tensor  # [s] vLLM's logprob at those positions, 0 elsewhere
    advantage: float
    group_id: str
    masked: bool = False  # a padding group from dynamic sampling: kept out of the loss
    pixel_values: torch.Tensor | None = None
    image_grid_thw: torch.Tensor | None = None
    pixel_values_videos: torch.Tensor | None = None
    video_grid_thw: torch.Tensor | None = None

    @property
    def text_tokens(self) -> int:
        return int(self.input_ids.numel())

    @property
    def vision_patches(self) -> int:
        return sum(int(g.prod(-1).sum()) for g in (self.image_grid_thw, self.video_grid_thw) if g is not None)

    def pack(self) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        tensors = {k: getattr(self, k) for k in _TENSORS if getattr(self, k) is not None}
        meta = {"advantage": repr(self.advantage), "group_id": self.group_id, "masked": json.dumps(self.masked)}
        return tensors, meta

    @classmethod
    def unpack(cls, tensors: dict[str, torch.Tensor], meta: dict[str, str]) -> "TrainSample":
        return cls(advantage=float(meta["advantage"]), group_id=meta["group_id"], masked=json.loads(meta["masked"]),
                   **{k: tensors.get(k) for k in _TENSORS})


class SampleBuilder:
    """Turns a group into training samples with the policy's own processor."""

    def __init__(self, processor, prompt_text):
        self.processor = processor
        self.prompt_text = prompt_text  # the rollout engine's chat formatting

    def build(self, group: Group, advantages: list[float], masked: bool) -> list[TrainSample]:
        prompt = group.prompt
        media: dict[str, Any] = {}
        if prompt.images:
            media["images"] = prompt.images
        if prompt.videos:
            media["videos"] = prompt.videos
        enc = self.processor(text=[self.prompt_text(prompt.request())], return_tensors="pt", **media)
        prompt_ids = enc["input_ids"][0]
        p = prompt_ids.numel()
        out = []
        for response, adv in zip(group.responses, advantages):
            n = len(response.token_ids)
            ids = torch.cat([prompt_ids, torch.tensor(response.token_ids, dtype=prompt_ids.dtype)])
            mask = torch.zeros(ids.numel(), dtype=torch.float32)
            mask[p - 1 : p - 1 + n] = 1.0  # logits at t predict token t + 1
            lp = torch.zeros(ids.numel(), dtype=torch.float32)
            lp[p - 1 : p - 1 + n] = torch.tensor(response.logprobs, dtype=torch.float32)
            out.append(TrainSample(
                input_ids=ids, loss_mask=mask, rollout_logprobs=lp, advantage=float(adv),
                group_id=prompt.key, masked=masked,
                pixel_values=enc.get("pixel_values"), image_grid_thw=enc.get("image_grid_thw"),
                pixel_values_videos=enc.get("pixel_values_videos"), video_grid_thw=enc.get("video_grid_thw")))
        return out


def micro_batches(samples: list[TrainSample], max_tokens: int, spec, pad_id: int) -> list[MicroBatch]:
    """Length-sorted samples packed into right-padded micro-batches of at most `max_tokens`
    (rows x longest row); a sample longer than that gets a micro-batch of its own."""
    order = sorted(range(len(samples)), key=lambda i: samples[i].text_tokens)
    batches, current = [], []
    for i in order:
        longest = max([samples[j].text_tokens for j in current] + [samples[i].text_tokens])
        if current and longest * (len(current) + 1) > max_tokens:
            batches.append(current)
            current = []
        current.append(i)
    if current:
        batches.append(current)
    return [_collate([samples[i] for i in b], spec, pad_id) for b in batches]


def _cat(tensors):
    tensors = [t for t in tensors if t is not None]
    return torch.cat(tensors) if tensors else None


def _collate(rows: list[TrainSample], spec, pad_id: int) -> MicroBatch:
    s = max(r.text_tokens for r in rows)

    def pad(t, value):
        return torch.nn.functional.pad(t, (0, s - t.numel()), value=value)

    input_ids = torch.stack([pad(r.input_ids, pad_id) for r in rows])
    attention = torch.stack([pad(torch.ones_like(r.input_ids), 0) for r in rows])
    batch = {"input_ids": input_ids, "attention_mask": attention,
             "pixel_values": _cat([r.pixel_values for r in rows]),
             "image_grid_thw": _cat([r.image_grid_thw for r in rows]),
             "pixel_values_videos": _cat([r.pixel_values_videos for r in rows]),
             "video_grid_thw": _cat([r.video_grid_thw for r in rows])}
    keep = torch.tensor([0.0 if r.masked else 1.0 for r in rows])[:, None]
    extra = {
        "loss_mask": torch.stack([pad(r.loss_mask, 0.0) for r in rows]) * keep,
        "rollout_logprobs": torch.stack([pad(r.rollout_logprobs, 0.0) for r in rows]),
        "advantages": torch.tensor([r.advantage for r in rows], dtype=torch.float32),
    }
    return MicroBatch(VLMInputs.from_processor(spec, batch), extra, [r.group_id for r in rows])


def media_bytes(prompt: Prompt) -> int:
    return sum(np.asarray(im).nbytes for im in prompt.images) + sum(v.nbytes for v in prompt.videos)
