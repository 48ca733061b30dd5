"""Builders for the dataio tests: real tar shards with real encoded media, good and bad."""

from __future__ import annotations

import json
import os
import pickle
import random
import tarfile

from PIL import Image

from dataio.synth import colour_image, encode_image, encode_mp4, moving_ball_video, tar_add


def good_image_bytes(seed: int, fmt: str = "jpg") -> bytes:
    return encode_image(colour_image(random.Random(seed)).image, fmt)


def good_video_bytes(seed: int, frames: int = 8) -> bytes:
    return encode_mp4(moving_ball_video(random.Random(seed), frames=frames).video)


def js(prompt="q?", answer="a", **meta) -> bytes:
    return json.dumps({"prompt": prompt, "answer": answer, "metadata": meta}).encode()


class PickleBomb:
    """Unpickling this creates a file: the test checks the reader never does it."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def write_tar(path: str, members: list[tuple[str, bytes]]) -> str:
    with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tf:
        for name, data in members:
            tar_add(tf, name, data)
    return path


def make_bad_dataset(root: str) -> dict:
    """Shards mixing good samples with one sample of every kind of bad input. Returns the
    expected skip reasons by key and the good keys."""
    os.makedirs(root, exist_ok=True)
    jpg = good_image_bytes(1)
    mp4 = good_video_bytes(2)
    bomb_target = os.path.join(root, "UNPICKLED")
    bad = {
        "corrupt_jpg": [("corrupt_jpg.jpg", b"\xff\xd8\xff\xe0" + os.urandom(500)), ("corrupt_jpg.json", js())],
        "truncated_jpg": [("truncated_jpg.jpg", jpg[: len(jpg) // 2]), ("truncated_jpg.json", js())],
        "corrupt_mp4": [("corrupt_mp4.mp4", os.urandom(3000)), ("corrupt_mp4.json", js())],
        "truncated_mp4": [("truncated_mp4.mp4", mp4[: len(mp4) // 2]), ("truncated_mp4.json", js())],
        "wrong_frames": [("wrong_frames.mp4", mp4), ("wrong_frames.json", js(frames=80))],
        "corrupt_json": [("corrupt_json.jpg", jpg), ("corrupt_json.json", b'{"prompt": "unterminated')],
        "missing_media": [("missing_media.json", js())],
        # 500 x 2: an aspect ratio the Qwen-VL processors refuse
        "too_wide": [("too_wide.png", encode_image(Image.new("RGB", (500, 2), (9, 9, 9)), "png")),
                     ("too_wide.json", js())],
    }
    expected = {"corrupt_jpg": "corrupt_image", "truncated_jpg": "corrupt_image", "corrupt_mp4": "corrupt_video",
                "truncated_mp4": "corrupt_video", "wrong_frames": "bad_frame_count", "corrupt_json": "corrupt_json",
                "missing_media": "missing_media", "too_wide": "bad_aspect_ratio"}
    members: list[tuple[str, bytes]] = []
    good = []
    for n, (key, mems) in enumerate(bad.items()):
        members += [(f"good{n}.jpg", good_image_bytes(10 + n, "png" if n % 2 else "jpg")), (f"good{n}.json", js(answer=str(n)))]
        good.append(f"good{n}")
        members += mems
    members += [("goodvid.mp4", mp4), ("goodvid.json", js(frames=8))]
    good.append("goodvid")
    # extra members the reader does not decode: a feature array and two pickles, one of them a
    # bomb; the image decodes, the others are counted as ignored and never read
    members += [("extra.jpg", jpg), ("extra.npy", b"\x93NUMPY" + bytes(100)),
                ("extra.pyd", pickle.dumps(PickleBomb(bomb_target))), ("extra.pickle", pickle.dumps(PickleBomb(bomb_target))),
                ("extra.json", js())]
    good.append("extra")
    write_tar(os.path.join(root, "a-bad-samples.tar"), members)

    # a shard truncated in the middle of its last member's data
    p = write_tar(os.path.join(root, "b-truncated.tar"),
                  [("t_good.jpg", jpg), ("t_good.json", js()), ("t_cut.png", good_image_bytes(3, "png") * 20),
                   ("t_cut.json", js())])
    data = open(p, "rb").read()
    cut_at = data.index(b"t_cut.png") + 512 + 300  # inside t_cut.png's data
    open(p, "wb").write(data[:cut_at])
    good.append("t_good")
    expected["t_cut"] = "truncated_tar"

    # a shard whose structure breaks part way: a garbage header after two samples
    p = write_tar(os.path.join(root, "c-corrupt.tar"),
                  [("c_good.jpg", jpg), ("c_good.json", js()), ("c_lost.jpg", jpg), ("c_lost.json", js())])
    data = bytearray(open(p, "rb").read())
    h = data.index(b"c_lost.jpg")
    data[h: h + 512] = os.urandom(512)
    open(p, "wb").write(bytes(data))
    good.append("c_good")
    expected[""] = "corrupt_tar"  # the tar error row has an empty key
    return {"expected": expected, "good": good, "bomb_target": bomb_target}
