"""Synthetic images and videos with questions whose answers can be checked by a rule.

They give RL a real, verifiable signal without any downloaded data set: the colour of a shape,
how many shapes there are, which way a ball moves.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageDraw

COLOURS = {
    "red": (220, 30, 30),
    "green": (30, 180, 60),
    "blue": (30, 60, 220),
    "yellow": (240, 220, 40),
}
DIRECTIONS = ("left", "right", "up", "down")


@dataclass
class SynthSample:
    question: str
    answer: str
    image: Image.Image | None = None
    video: np.ndarray | None = None  # uint8 [T, H, W, 3]


def colour_image(rng: random.Random, size: int = 112) -> SynthSample:
    """One filled square on a gray background; the answer is its colour's name."""
    name = rng.choice(sorted(COLOURS))
    img = Image.new("RGB", (size, size), (128, 128, 128))
    side = rng.randint(size // 3, size // 2)
    x, y = rng.randint(0, size - side), rng.randint(0, size - side)
    ImageDraw.Draw(img).rectangle([x, y, x + side, y + side], fill=COLOURS[name])
    return SynthSample("What colour is the square?", name, image=img)


def moving_ball_video(rng: random.Random, frames: int = 8, size: int = 56) -> SynthSample:
    """A white ball moving in one direction over black; the answer is that direction."""
    direction = rng.choice(DIRECTIONS)
    dx, dy = {"left": (-1, 0), "right": (1, 0), "up": (0, -1), "down": (0, 1)}[direction]
    step = max(1, size // (2 * frames))
    cx = cy = size // 2
    cx -= dx * step * frames // 2
    cy -= dy * step * frames // 2
    video = np.zeros((frames, size, size, 3), dtype=np.uint8)
    r = size // 8
    for t in range(frames):
        img = Image.new("RGB", (size, size))
        x, y = cx + dx * step * t, cy + dy * step * t
        ImageDraw.Draw(img).ellipse([x - r, y - r, x + r, y + r], fill=(255, 255, 255))
        video[t] = np.asarray(img)
    return SynthSample("Which direction does the ball move?", direction, video=video)
