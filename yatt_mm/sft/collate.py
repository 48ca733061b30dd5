"""SFT examples -> right-padded micro-batches for the Megatron trainer."""

from __future__ import annotations

import torch

from models.qwen2vl.model import VLMInputs
from models.trainer import MicroBatch
from yatt_mm.sft.examples import Example


class Collator:
    """Examples -> right-padded MicroBatch with a mask on the target tokens (one processor call
    per example, so the prompt/target boundary is exact)."""

    def __init__(self, processor, spec):
        self.processor = processor
        self.spec = spec
        self.pad_id = processor.tokenizer.pad_token_id

    def encode(self, ex: Example) -> dict:
        prompt = self.processor.apply_chat_template(ex.messages, add_generation_prompt=True, tokenize=False)
        kw = {}
        if ex.images:
            kw["images"] = ex.images
        if ex.videos:
            kw["videos"] = ex.videos
        enc = self.processor(text=[prompt], return_tensors="pt", **kw)
        target = self.processor.tokenizer(ex.target, add_special_tokens=False, return_tensors="pt")["input_ids"][0]
        enc = dict(enc)
        enc["prompt_len"] = enc["input_ids"].shape[1]
        enc["input_ids"] = torch.cat([enc["input_ids"][0], target])
        return enc

    def collate(self, encoded: list[dict]):
        n = max(e["input_ids"].shape[0] for e in encoded)
        ids = torch.full((len(encoded), n), self.pad_id, dtype=torch.long)
        attn = torch.zeros((len(encoded), n), dtype=torch.long)
        mask = torch.zeros((len(encoded), n), dtype=torch.float32)
        for row, e in enumerate(encoded):
            length = e["input_ids"].shape[0]
            ids[row, :length] = e["input_ids"]
            attn[row, :length] = 1
            mask[row, e["prompt_len"] - 1: length - 1] = 1.0  # logits at t predict token t + 1
        batch = {"input_ids": ids, "attention_mask": attn}
        for k in ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw",
                  "second_per_grid_ts"):  # Qwen2.5-VL processors: temporal M-RoPE spacing per video
            parts = [e[k] for e in encoded if k in e]
            if parts:
                batch[k] = torch.cat(parts)
        # the loss needs logprobs at the target positions only: the softmax over the vocabulary
        # of every prompt token would be most of the loss's work
        return MicroBatch(VLMInputs.from_processor(self.spec, batch), {"mask": mask}, score_mask=mask > 0)

    def batches(self, examples: list[Example], size: int) -> list[MicroBatch]:
        encoded = [self.encode(e) for e in examples]
        return [self.collate(encoded[i:i + size]) for i in range(0, len(encoded), size)]
