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


# ---------------------------------------------------------------- more tasks, and shard writing

SHAPES = ("circle", "square", "triangle")
NUMBER_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")


def count_shapes_image(rng: random.Random, size: int = 112) -> SynthSample:
    """1-6 non-overlapping shapes of one kind (plus distractors of another kind); the answer is
    how many of the asked kind there are, as a digit."""
    kind, other = rng.sample(SHAPES, 2)
    n, m = rng.randint(1, 6), rng.randint(0, 3)
    img = Image.new("RGB", (size, size), (235, 235, 235))
    draw = ImageDraw.Draw(img)
    cell = size // 4  # a 4x4 grid: shapes sit in distinct cells, so they never overlap
    cells = rng.sample(range(16), n + m)
    for j, c in enumerate(cells):
        shape = kind if j < n else other
        x0, y0 = (c % 4) * cell + 2, (c // 4) * cell + 2
        x1, y1 = x0 + cell - 5, y0 + cell - 5
        colour = COLOURS[rng.choice(sorted(COLOURS))]
        if shape == "circle":
            draw.ellipse([x0, y0, x1, y1], fill=colour)
        elif shape == "square":
            draw.rectangle([x0, y0, x1, y1], fill=colour)
        else:
            draw.polygon([((x0 + x1) // 2, y0), (x0, y1), (x1, y1)], fill=colour)
    return SynthSample(f"How many {kind}s are there? Answer with a number.", str(n), image=img)


def counting_video(rng: random.Random, frames: int = 8, size: int = 56) -> SynthSample:
    """Squares appear one per frame until there are k; the answer is k."""
    k = rng.randint(1, min(5, frames))
    video = np.full((frames, size, size, 3), 40, dtype=np.uint8)
    s = size // 6
    spots = rng.sample(range(9), k)
    for t in range(frames):
        img = Image.fromarray(video[t])
        draw = ImageDraw.Draw(img)
        shown = min(k, 1 + t * k // max(1, frames - 1)) if frames > 1 else k
        for c in spots[:shown]:
            x, y = (c % 3) * size // 3 + 4, (c // 3) * size // 3 + 4
            draw.rectangle([x, y, x + s, y + s], fill=(240, 220, 40))
        video[t] = np.asarray(img)
    return SynthSample("How many yellow squares are there at the end? Answer with a number.", str(k), video=video)


def grounding_image(rng: random.Random, size: int = 112, cells: int = 2) -> SynthSample:
    """A coloured box on a gray background, on a `cells` x `cells` grid, one or two cells wide and
    high; the answer is its bounding box [x1, y1, x2, y2] in 0-1000 coordinates (Qwen3-VL's
    convention), checked by the `iou`/`giou` rewards. The grid keeps the answers few enough for
    a tiny model to learn; the rewards give credit for a partial overlap."""
    name = rng.choice(sorted(COLOURS))
    w, h = rng.randint(1, 2), rng.randint(1, 2)
    x, y = rng.randint(0, cells - w), rng.randint(0, cells - h)
    box = [round(1000 * v / cells) for v in (x, y, x + w, y + h)]
    img = Image.new("RGB", (size, size), (128, 128, 128))
    px = [round(v * size / 1000) for v in box]
    ImageDraw.Draw(img).rectangle([px[0], px[1], px[2] - 1, px[3] - 1], fill=COLOURS[name])
    question = f"Where is the {name} box? Answer with its box [x1, y1, x2, y2] in 0-1000 coordinates."
    return SynthSample(question, f"[{box[0]}, {box[1]}, {box[2]}, {box[3]}]", image=img)


IMAGE_TASKS = {"colour": colour_image, "count": count_shapes_image, "grounding": grounding_image}
# drawn only when asked for by name (`tasks`): a default mix keeps the answers the word rules score
OPT_IN_TASKS = {"grounding"}
VIDEO_TASKS = {"direction": moving_ball_video, "count": counting_video}


def encode_image(img: Image.Image, fmt: str) -> bytes:
    import io

    buf = io.BytesIO()
    if fmt == "jpg":
        img.save(buf, format="JPEG", quality=90)
    else:
        img.save(buf, format=fmt.upper())
    return buf.getvalue()


def encode_mp4(video: np.ndarray, fps: float = 8.0) -> bytes:
    """uint8 [T, H, W, 3] RGB -> mp4 bytes (MPEG-4 part 2 via OpenCV's bundled encoder; decord
    reads it). Sides are padded up to even numbers, as encoders want."""
    import os
    import tempfile

    import cv2

    t, h, w, _ = video.shape
    hh, ww = h + h % 2, w + w % 2
    fd, path = tempfile.mkstemp(suffix=".mp4")
    os.close(fd)
    try:
        writer = cv2.VideoWriter(path, cv2.VideoWriter_fourcc(*"mp4v"), fps, (ww, hh))
        if not writer.isOpened():
            raise RuntimeError("OpenCV cannot open an mp4v VideoWriter (opencv-python-headless missing its codecs?)")
        for f in video:
            if (hh, ww) != (h, w):
                f = np.pad(f, ((0, hh - h), (0, ww - w), (0, 0)))
            writer.write(np.ascontiguousarray(f[:, :, ::-1]))  # OpenCV wants BGR
        writer.release()
        with open(path, "rb") as fh:
            return fh.read()
    finally:
        os.unlink(path)


def tar_add(tf, name: str, data: bytes, mtime: float = 0.0) -> None:
    import io
    import tarfile

    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mtime = mtime
    info.mode = 0o644
    tf.addfile(info, io.BytesIO(data))


def write_shards(
    out: str,
    images: int,
    videos: int,
    samples_per_shard: int = 100,
    seed: int = 0,
    image_size: int = 112,
    video_size: int = 56,
    video_frames: int = 16,
    video_fps: float = 8.0,
    frame_sequences: int = 0,
    progress: bool = False,
    tasks: list[str] | None = None,
) -> list[str]:
    """Write `images` image samples and `videos` mp4 samples (plus `frame_sequences` samples
    stored as KEY.000.jpg ...) into WebDataset shards `OUT/shard-000000.tar`, ...

    Each sample has KEY.json {prompt, answer, task, metadata}; images alternate JPEG and PNG.
    `tasks` limits the tasks drawn (names from IMAGE_TASKS / VIDEO_TASKS; default all).
    Deterministic for a seed. Returns the shard paths."""
    import json
    import os
    import sys
    import tarfile
    import time

    unknown = set(tasks or []) - set(IMAGE_TASKS) - set(VIDEO_TASKS)
    if unknown:
        raise ValueError(f"unknown synth task(s) {sorted(unknown)}; image tasks {sorted(IMAGE_TASKS)}, "
                         f"video tasks {sorted(VIDEO_TASKS)}")
    image_tasks = sorted(t for t in IMAGE_TASKS if (t in tasks if tasks is not None else t not in OPT_IN_TASKS))
    video_tasks = sorted(t for t in VIDEO_TASKS if tasks is None or t in tasks)
    if (images and not image_tasks) or ((videos or frame_sequences) and not video_tasks):
        raise ValueError(f"synth tasks {tasks} leave no task for the requested images/videos")
    os.makedirs(out, exist_ok=True)
    rng = random.Random(seed)
    plan = ["image"] * images + ["video"] * videos + ["frames"] * frame_sequences
    rng.shuffle(plan)
    paths: list[str] = []
    tf = None
    t0 = time.time()
    for n, what in enumerate(plan):
        if n % samples_per_shard == 0:
            if tf is not None:
                tf.close()
            paths.append(os.path.join(out, f"shard-{len(paths):06d}.tar"))
            tf = tarfile.open(paths[-1] + ".tmp", "w", format=tarfile.USTAR_FORMAT)
        key = f"s{n:08d}"
        if what == "image":
            task = rng.choice(image_tasks)
            s = IMAGE_TASKS[task](rng, image_size)
            fmt = "jpg" if n % 2 == 0 else "png"
            meta = {"width": s.image.width, "height": s.image.height, "format": fmt}
            tar_add(tf, f"{key}.{fmt}", encode_image(s.image, fmt))
        else:
            task = rng.choice(video_tasks)
            s = VIDEO_TASKS[task](rng, video_frames, video_size)
            t, h, w, _ = s.video.shape
            meta = {"width": w + w % 2, "height": h + h % 2, "frames": t, "fps": video_fps, "duration": t / video_fps}
            if what == "video":
                tar_add(tf, f"{key}.mp4", encode_mp4(s.video, video_fps))
            else:
                meta.pop("frames")  # for sequences the member count is the frame count
                for i, frame in enumerate(s.video):
                    tar_add(tf, f"{key}.{i:03d}.jpg", encode_image(Image.fromarray(frame), "jpg"))
        rec = {"prompt": s.question, "answer": s.answer, "task": f"{what}/{task}", "metadata": meta}
        tar_add(tf, f"{key}.json", json.dumps(rec).encode())
        if progress and ((n + 1) % 200 == 0 or n + 1 == len(plan)):
            print(f"synth: {n + 1}/{len(plan)} samples, {len(paths)} shards, {time.time() - t0:.1f}s", file=sys.stderr,
                  flush=True)
    if tf is not None:
        tf.close()
    for p in paths:
        os.replace(p + ".tmp", p)
    return paths
