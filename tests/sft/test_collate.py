"""The SFT collator encodes a micro-batch in one processor call: the result must be exactly what
one call per example gives (ids, the prompt/target boundary, media in example order)."""

import random

import numpy as np
import pytest
import torch


def _per_example(processor, spec, examples):
    """The reference: one processor call per example, rows right-padded, targets masked."""
    from models.inputs import VLMInputs

    encoded = []
    for ex in examples:
        prompt = processor.apply_chat_template(ex.messages, add_generation_prompt=True, tokenize=False)
        kw = {k: v for k, v in (("images", ex.images), ("videos", ex.videos)) if v}
        enc = dict(processor(text=[prompt], return_tensors="pt", **kw))
        target = processor.tokenizer(ex.target, add_special_tokens=False, return_tensors="pt")["input_ids"][0]
        enc["prompt_len"] = enc["input_ids"].shape[1]
        enc["input_ids"] = torch.cat([enc["input_ids"][0], target])
        encoded.append(enc)
    n = max(e["input_ids"].shape[0] for e in encoded)
    ids = torch.full((len(encoded), n), processor.tokenizer.pad_token_id, dtype=torch.long)
    attn = torch.zeros((len(encoded), n), dtype=torch.long)
    mask = torch.zeros((len(encoded), n))
    for row, e in enumerate(encoded):
        length = e["input_ids"].shape[0]
        ids[row, :length], attn[row, :length] = e["input_ids"], 1
        mask[row, e["prompt_len"] - 1: length - 1] = 1.0
    batch = {"input_ids": ids, "attention_mask": attn}
    for k in ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw"):
        if any(k in e for e in encoded):
            batch[k] = torch.cat([e[k] for e in encoded if k in e])
    return VLMInputs.from_processor(spec, batch), mask


@pytest.fixture(scope="module")
def processor_and_spec():
    from transformers import AutoProcessor

    from models.qwen2vl.model import Qwen2VLSpec
    from models.tiny import tiny_model_dir

    src = tiny_model_dir("judge")
    processor = AutoProcessor.from_pretrained(str(src))
    processor.tokenizer.padding_side = "right"
    return processor, Qwen2VLSpec.from_hf_dir(str(src))


def test_one_call_per_micro_batch_equals_one_per_example(processor_and_spec):
    from dataio.synth import colour_image, moving_ball_video
    from yatt_mm.sft.collate import Collator
    from yatt_mm.sft.examples import Example

    processor, spec = processor_and_spec
    rng = random.Random(0)

    def user(parts, text):
        return [{"role": "user", "content": [{"type": p} for p in parts] + [{"type": "text", "text": text}]}]

    examples = []
    for i in range(9):  # text only, one image, two images, a video with an image; targets of 1 to 3 words
        s, v = colour_image(rng), moving_ball_video(rng)
        kind = i % 4
        images = [] if kind == 0 else [s.image] if kind in (1, 3) else [s.image, colour_image(rng).image]
        videos = [v.video] if kind == 3 else []
        parts = ["image"] * len(images) + ["video"] * len(videos)
        target = " ".join([s.answer] * (1 + i % 3)) + "<|im_end|>"
        examples.append(Example(f"k{i}", user(parts, s.question + " x" * i), images, videos, target))
    assert isinstance(examples[3].videos[0], np.ndarray)

    collator = Collator(processor, spec)
    for size in (1, 4, 9):
        for start in range(0, len(examples), size):
            chunk = examples[start:start + size]
            want, want_mask = _per_example(processor, spec, chunk)
            got = collator.collate(chunk)
            assert torch.equal(got.extra["mask"], want_mask) and torch.equal(got.score_mask, want_mask > 0)
            for name, value in vars(want).items():
                other = getattr(got.inputs, name)
                if isinstance(value, torch.Tensor):
                    assert other.dtype == value.dtype and torch.equal(other, value), (size, start, name)
                else:
                    assert other == value, (size, start, name)


def test_merged_duplicates_give_the_same_token_sums(processor_and_spec):
    """merge_duplicates: identical text-only examples become one row whose target mask is their
    count, so any loss summed over target tokens (here with per-token values that depend only on
    the row's ids, as a model's logprobs do) is the same; examples with media stay apart."""
    from dataio.synth import colour_image
    from yatt_mm.sft.collate import Collator, merge_duplicates_of
    from yatt_mm.sft.examples import Example

    processor, spec = processor_and_spec
    rng = random.Random(1)
    image = colour_image(rng).image

    def text(t, target):
        return Example("k", [{"role": "user", "content": [{"type": "text", "text": t}]}], [], [], target)

    with_image = Example("m", [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "a"}]}],
                         [image], [], "red<|im_end|>")
    examples = [text("a", "red<|im_end|>"), text("b", "red<|im_end|>"), text("a", "red<|im_end|>"),
                with_image, text("a", "blue<|im_end|>"), with_image, text("a", "red<|im_end|>"), text("b", "red<|im_end|>")]
    kept, weights = merge_duplicates_of(examples)
    assert [(e.messages[0]["content"][-1]["text"], e.target[:4], bool(e.images)) for e in kept] == [
        ("a", "red<", False), ("b", "red<", False), ("a", "red<", True), ("a", "blue", False), ("a", "red<", True)]
    assert weights == [3, 2, 1, 1, 1] and sum(weights) == len(examples)

    collator = Collator(processor, spec)

    def token_sums(mbs):
        total, tokens = 0.0, 0.0
        for mb in mbs:
            ids = mb.inputs.input_ids.double()
            fake_lp = -torch.log1p(ids.cumsum(1) % 97)  # a function of the row's ids up to each position
            total += float((fake_lp * mb.extra["mask"]).sum())
            tokens += float(mb.inputs.attention_mask.sum(1).float() @ mb.extra["rows"])
        return total, float(sum(mb.extra["mask"].sum() for mb in mbs)), tokens

    for size in (2, 8):
        plain = collator.batches(examples, size)
        merged = collator.batches(examples, size, merge_duplicates=True)
        assert sum(mb.inputs.input_ids.shape[0] for mb in merged) == 5
        assert all(torch.equal(mb.extra["rows"], torch.ones(mb.inputs.input_ids.shape[0])) for mb in plain)
        assert token_sums(merged) == pytest.approx(token_sums(plain), rel=1e-12)
