"""Encode what a sample stores: JPEG frames (pillow, fixed settings) or one mp4 clip (PyAV:
libx264 when the bundled ffmpeg has it, else MPEG-4 part 2), byte-for-byte repeatable for the
same frames and library versions (single-threaded encoders, bitexact muxing, no timestamps)."""

from __future__ import annotations

import io
from fractions import Fraction

import numpy as np


def jpeg_bytes(frame: np.ndarray, quality: int = 90) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(frame).save(buf, format="JPEG", quality=quality, optimize=False, progressive=False)
    return buf.getvalue()


_MP4_CODEC: str | None = None


def mp4_codec() -> str:
    global _MP4_CODEC
    if _MP4_CODEC is None:
        import av

        _MP4_CODEC = "libx264" if "libx264" in av.codecs_available else "mpeg4"
    return _MP4_CODEC


def mp4_bytes(frames: np.ndarray, fps: float, crf: int = 23) -> bytes:
    """uint8 [T, H, W, 3] (even sides) -> mp4 with exactly T frames at `fps`, a keyframe every
    second (short GOP: readers seek cheaply inside a clip)."""
    import av

    t, h, w, _ = frames.shape
    rate = Fraction(fps).limit_denominator(1001)
    codec = mp4_codec()
    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4", options={"fflags": "+bitexact"}) as c:
        s = c.add_stream(codec, rate=rate)
        s.width, s.height, s.pix_fmt = w, h, "yuv420p"
        s.codec_context.thread_count = 1
        s.codec_context.gop_size = max(1, int(round(fps)))
        s.codec_context.flags |= av.codec.context.Flags.bitexact if hasattr(av.codec.context, "Flags") else 0
        if codec == "libx264":
            s.options = {"preset": "veryfast", "crf": str(crf), "threads": "1"}
        else:
            s.codec_context.bit_rate = max(200_000, w * h * 4)
        for f in frames:
            for pkt in s.encode(av.VideoFrame.from_ndarray(np.ascontiguousarray(f), format="rgb24")):
                c.mux(pkt)
        for pkt in s.encode():
            c.mux(pkt)
    return buf.getvalue()
