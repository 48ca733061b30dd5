"""Shared helpers for the dataio benchmarks: realistic test media written to tar shards."""

from __future__ import annotations

import io
import os
import tarfile

import numpy as np
from PIL import Image, ImageDraw, ImageFilter


def photo_like_jpeg(rng: np.random.Generator, size: int = 512, quality: int = 90) -> bytes:
    """A 512x512 JPEG of roughly photo-like entropy (about 60-90 KB): smooth gradients, shapes,
    blur and sensor-like noise."""
    y, x = np.mgrid[0:size, 0:size].astype(np.float32) / size
    base = np.stack([np.sin(x * rng.uniform(2, 9) + rng.uniform(0, 6)), np.cos(y * rng.uniform(2, 9)),
                     np.sin((x + y) * rng.uniform(2, 9))], -1) * 70 + 128
    img = Image.fromarray(base.clip(0, 255).astype(np.uint8))
    d = ImageDraw.Draw(img)
    for _ in range(12):
        x0, y0 = rng.integers(0, size, 2)
        d.ellipse([x0, y0, x0 + rng.integers(20, 160), y0 + rng.integers(20, 160)],
                  fill=tuple(int(v) for v in rng.integers(0, 255, 3)))
    img = img.filter(ImageFilter.GaussianBlur(1.5))
    arr = np.asarray(img).astype(np.int16) + rng.normal(0, 9, (size, size, 3)).astype(np.int16)
    buf = io.BytesIO()
    Image.fromarray(arr.clip(0, 255).astype(np.uint8)).save(buf, format="JPEG", quality=quality)
    return buf.getvalue()


def write_shards(root: str, samples: list[tuple[str, str, bytes]], per_shard: int) -> list[str]:
    """samples: (key, ext, bytes) -> shards of `per_shard` samples, each with a small KEY.json."""
    os.makedirs(root, exist_ok=True)
    paths = []
    for s in range(0, len(samples), per_shard):
        p = os.path.join(root, f"shard-{s // per_shard:05d}.tar")
        with tarfile.open(p, "w") as tf:
            for key, ext, data in samples[s:s + per_shard]:
                for name, blob in ((f"{key}.{ext}", data), (f"{key}.json", b'{"prompt": "q", "answer": "a"}')):
                    info = tarfile.TarInfo(name)
                    info.size = len(blob)
                    tf.addfile(info, io.BytesIO(blob))
        paths.append(p)
    return paths
