"""Examples for SFT: a sample (question, media, answer) becomes a chat prompt and a target.

An example builder is a function `(sample, rng) -> Example | str` (a string is the reason the
sample was skipped, counted in the metrics), chosen by name in the config (`examples:`):
`answer` (question -> the sample's answer) is built in; `module:function` names anyone's own,
such as the demo's warm-start builders in `yatt_mm/demo/examples.py`. A builder may name the
builder its held-out examples are scored with (`@example_builder(eval_with=...)`), e.g. a
format-only start is scored against the true answers.
"""

from __future__ import annotations

import random
import zlib
from collections import Counter
from dataclasses import dataclass
from typing import Callable

from yatt_mm.registry import Registry


@dataclass
class Example:
    key: str
    messages: list[dict]
    images: list
    videos: list
    target: str  # text the model must produce, ending with <|im_end|>


Builder = Callable[[object, random.Random], "Example | str"]
BUILDERS: Registry[Builder] = Registry("example builder")


def example_builder(name: str | None = None, eval_with: Builder | None = None) -> Callable[[Builder], Builder]:
    """Register a builder under `name` (optional: `module:function` finds it anyway) and the
    builder its held-out examples use (default: itself)."""
    def register(fn: Builder) -> Builder:
        fn.eval_builder = eval_with or fn
        return BUILDERS.register(name)(fn) if name else fn

    return register


def get_builder(spec: str) -> Builder:
    build = BUILDERS.get(spec)
    if not hasattr(build, "eval_builder"):  # a user's plain function: held out with itself
        build.eval_builder = build
    return build


def media_parts(sample) -> list[dict]:
    return [{"type": "image"} for _ in sample.images] + [{"type": "video"} for _ in sample.videos]


@example_builder("answer")
def answer_example(sample, rng: random.Random) -> Example | str:
    msgs = [{"role": "user", "content": media_parts(sample) + [{"type": "text", "text": sample.prompt}]}]
    return Example(sample.key, msgs, sample.images, sample.videos, f"{sample.answer}<|im_end|>")


def is_held_out(key: str, fraction: float) -> bool:
    return fraction > 0 and zlib.crc32(key.encode()) % 10_000 < fraction * 10_000


def unusable(sample, tasks: set[str]) -> str | None:
    """Why a sample cannot become an example (counted, never silent), or None."""
    if tasks and sample.metadata.get("task") not in tasks:
        return "other_task"
    if not sample.images and not sample.videos:
        return "no_media"
    if sample.answer is None or not sample.answer.strip():
        return "no_answer"
    if sample.prompt is None or not sample.prompt.strip():
        return "no_question"
    return None


class ExampleStream:
    """Examples from one rank's samples; unusable ones are skipped and counted in `skipped`."""

    def __init__(self, samples, build: Builder, tasks: list[str], seed: int, keep: Callable[[str], bool]):
        self.build = build
        self.tasks = set(tasks)
        self.rng = random.Random(seed)
        self.keep = keep
        self.skipped: Counter[str] = Counter()
        self._it = iter(samples)

    def __next__(self) -> Example:
        while True:
            s = next(self._it)
            if not self.keep(s.key):
                self.skipped["held_out"] += 1
                continue
            reason = unusable(s, self.tasks)
            ex = self.build(s, self.rng) if reason is None else reason
            if isinstance(ex, str):
                self.skipped[ex] += 1
                continue
            return ex

    def __iter__(self):
        return self

    def take(self, n: int) -> list[Example]:
        """Up to n examples; fewer when the samples run out (a held-out pass)."""
        out: list[Example] = []
        for ex in self if n > 0 else ():
            out.append(ex)
            if len(out) >= n:
                break
        return out
