"""Small real media for the prep tests, made with PyAV (no ffmpeg binary needed): several codecs
and containers, odd frame rates, rotation metadata, and broken files of each kind."""

from __future__ import annotations

import os
import random
from fractions import Fraction

import numpy as np


def frame_at(i: int, w: int, h: int) -> np.ndarray:
    """A moving bar, a colour that changes with the frame, and a white marker at the top left
    (to check rotation)."""
    a = np.zeros((h, w, 3), np.uint8)
    a[..., 2] = (i * 9) % 200
    a[:, (i * 3) % w] = (0, 255, 0)
    a[: h // 4, : w // 4] = 255
    return a


def write_video(path: str, codec: str, fps, seconds: float, w: int = 64, h: int = 48, fmt: str | None = None,
                rotation: int = 0, pix_fmt: str = "yuv420p") -> str:
    import av

    n = int(round(float(fps) * seconds))
    with av.open(path, "w", format=fmt) as c:
        s = c.add_stream(codec, rate=Fraction(fps).limit_denominator(1001))
        s.width, s.height, s.pix_fmt = w, h, pix_fmt
        s.codec_context.thread_count = 1
        if rotation:
            s.set_display_rotation(rotation)
        for i in range(n):
            for p in s.encode(av.VideoFrame.from_ndarray(frame_at(i, w, h), format="rgb24")):
                c.mux(p)
        for p in s.encode():
            c.mux(p)
    return path


def write_audio(path: str, seconds: float = 1.0) -> str:
    import av

    rate = 16000
    with av.open(path, "w", format="mp4") as c:
        s = c.add_stream("aac", rate=rate)
        s.layout = "mono"
        n = 0
        t = np.arange(int(rate * seconds)) / rate
        pcm = (0.2 * np.sin(2 * np.pi * 440 * t)).astype(np.float32)[None]
        for start in range(0, pcm.shape[1], 1024):
            fr = av.AudioFrame.from_ndarray(np.ascontiguousarray(pcm[:, start:start + 1024]), format="fltp", layout="mono")
            fr.sample_rate = rate
            fr.pts = n
            n += fr.samples
            for p in s.encode(fr):
                c.mux(p)
        for p in s.encode():
            c.mux(p)
    return path


GOOD = {
    # name: (codec, fps, seconds, container format, extra)
    "a_h264.mp4": ("libx264", Fraction(30000, 1001), 3.0, "mp4", {}),
    "b_vp9.webm": ("libvpx-vp9", 7, 3.0, "webm", {}),
    "c_mpeg4.avi": ("mpeg4", 25, 2.0, "avi", {}),
    "d_mjpeg.avi": ("mjpeg", 10, 2.0, "avi", {"pix_fmt": "yuvj420p"}),
    "e_rotated.mp4": ("libx264", 12, 2.0, "mp4", {"rotation": 90, "w": 64, "h": 32}),
}


def make_corpus(root: str, broken: bool = True) -> dict:
    """Good videos (with a caption sidecar for one) and broken files. Returns
    {"good": {name: seconds}, "bad": {name: expected reason}}."""
    os.makedirs(root, exist_ok=True)
    good = {}
    for name, (codec, fps, sec, fmt, extra) in GOOD.items():
        kw = dict(extra)
        write_video(os.path.join(root, name), codec, fps, sec, w=kw.pop("w", 64), h=kw.pop("h", 48), fmt=fmt, **kw)
        good[name] = sec
    with open(os.path.join(root, "a_h264.txt"), "w") as f:
        f.write("a green bar moves right")
    bad = {}
    if broken:
        open(os.path.join(root, "z_empty.mp4"), "wb").close()
        bad["z_empty.mp4"] = "empty_file"
        with open(os.path.join(root, "z_text.mp4"), "w") as f:
            f.write("this is not a video\n" * 20)
        bad["z_text.mp4"] = "invalid_data"
        data = open(os.path.join(root, "a_h264.mp4"), "rb").read()
        with open(os.path.join(root, "z_truncated.mp4"), "wb") as f:
            f.write(data[: len(data) // 2])  # mp4 with its index (moov, at the end) cut off
        bad["z_truncated.mp4"] = "invalid_data"
        write_audio(os.path.join(root, "z_audio.mp4"))
        bad["z_audio.mp4"] = "no_video_stream"
        # an AVI whose codec tag no decoder knows
        write_video(os.path.join(root, "z_codec.avi"), "mpeg4", 10, 1.5, fmt="avi")
        raw = bytearray(open(os.path.join(root, "z_codec.avi"), "rb").read())
        for tag in (b"FMP4", b"fmp4"):
            j = raw.find(tag)
            while j >= 0:
                raw[j:j + 4] = b"QQQ9"
                j = raw.find(tag, j + 4)
        open(os.path.join(root, "z_codec.avi"), "wb").write(bytes(raw))
        bad["z_codec.avi"] = "unsupported_codec"
        write_video(os.path.join(root, "z_short.mp4"), "libx264", 10, 0.5)
        bad["z_short.mp4"] = "no_clips"
    return {"good": good, "bad": bad}


def make_images(root: str, n: int = 5) -> list[dict]:
    from PIL import Image

    os.makedirs(root, exist_ok=True)
    rows = []
    rng = random.Random(0)
    for i in range(n):
        w, h = rng.randint(40, 120), rng.randint(40, 120)
        p = os.path.join(root, f"img{i}.{'png' if i % 2 else 'jpg'}")
        Image.fromarray(frame_at(i, w, h)).save(p)
        rows.append({"path": os.path.basename(p), "question": f"What is in image {i}?", "answer": str(i)})
    open(os.path.join(root, "bad.jpg"), "wb").write(b"\xff\xd8\xff\xe0 not really a jpeg")
    rows.append({"path": "bad.jpg", "question": "?", "answer": "x"})
    rows.append({"path": "missing.jpg", "question": "?", "answer": "x"})
    return rows


def write_scene_video(path: str, colours=((200, 30, 30), (30, 200, 30), (30, 30, 200)), seconds_each: float = 1.0,
                      fps: int = 10, w: int = 64, h: int = 48) -> str:
    """Solid colours one after another: hard cuts at seconds_each, 2 x seconds_each, ..."""
    import av

    with av.open(path, "w") as c:
        s = c.add_stream("libx264", rate=fps)
        s.width, s.height, s.pix_fmt = w, h, "yuv420p"
        for k, col in enumerate(colours):
            for i in range(int(fps * seconds_each)):
                a = np.empty((h, w, 3), np.uint8)
                a[:] = col
                a[: h // 3, (i * 4) % w] = 255
                for p in s.encode(av.VideoFrame.from_ndarray(a, format="rgb24")):
                    c.mux(p)
        for p in s.encode():
            c.mux(p)
    return path


def write_truncated_faststart(src: str, path: str, keep: float = 0.5) -> str:
    """An mp4 with its index at the front (faststart) cut part way: it opens, frames stop early."""
    import av

    tmp = path + ".full.mp4"
    with av.open(src) as i, av.open(tmp, "w", options={"movflags": "faststart"}) as o:
        s = o.add_stream_from_template(i.streams.video[0])
        for p in i.demux(i.streams.video[0]):
            if p.dts is None:
                continue
            p.stream = s
            o.mux(p)
    data = open(tmp, "rb").read()
    os.unlink(tmp)
    with open(path, "wb") as f:
        f.write(data[: int(len(data) * keep)])
    return path
