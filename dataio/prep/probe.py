"""Probe a video in-process with PyAV (a few ms, against ~100 ms to spawn ffprobe): duration,
frame rate, codec, coded size, rotation (the display matrix, read from the first decoded frame)
and the reported frame count. Decoding that first frame also proves the codec is decodable."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass

from dataio.errors import MediaError


@dataclass(frozen=True)
class VideoInfo:
    duration: float  # seconds
    fps: float  # average frame rate
    codec: str
    width: int  # coded size, before rotation
    height: int
    rotation: int  # counter-clockwise degrees to turn the coded picture upright: 0, 90, 180, 270
    frames: int  # reported by the container; 0 when unknown
    container: str

    @property
    def display_size(self) -> tuple[int, int]:
        return (self.height, self.width) if self.rotation in (90, 270) else (self.width, self.height)

    def as_dict(self) -> dict:
        return asdict(self)


def open_container(path: str):
    """av.open with the failure reasons of failures.parquet."""
    import av

    try:
        size = os.path.getsize(path)
    except OSError as e:
        raise MediaError("unreadable", f"{type(e).__name__}: {e.strerror or e}") from None
    if size == 0:
        raise MediaError("empty_file", "0 bytes")
    if not os.access(path, os.R_OK):
        raise MediaError("unreadable", "permission denied")
    try:
        return av.open(path, metadata_errors="ignore")
    except PermissionError as e:
        raise MediaError("unreadable", str(e)) from None
    except av.FFmpegError as e:
        raise MediaError("invalid_data", f"{type(e).__name__}: {e}"[:300]) from None
    except Exception as e:
        raise MediaError("invalid_data", f"{type(e).__name__}: {e}"[:300]) from None


def normal_rotation(deg: float) -> int:
    return int(round((deg or 0) / 90.0)) % 4 * 90


def probe_container(c, path: str = "") -> VideoInfo:
    import av

    if not c.streams.video:
        kinds = sorted({s.type for s in c.streams}) or ["none"]
        raise MediaError("no_video_stream", f"streams: {', '.join(kinds)}")
    s = c.streams.video[0]
    ctx = s.codec_context
    name = getattr(ctx, "name", None) if ctx is not None else None
    if not name or name == "none":
        raise MediaError("unsupported_codec", f"no decoder for codec tag {getattr(ctx, 'codec_tag', '?')!r}")
    rate = s.average_rate or s.guessed_rate or s.base_rate
    fps = float(rate) if rate else 0.0
    duration = 0.0
    if s.duration is not None and s.time_base:
        duration = float(s.duration * s.time_base)
    elif c.duration is not None:
        duration = c.duration / 1_000_000.0
    if duration <= 0 and s.frames and fps > 0:
        duration = s.frames / fps
    rotation = 0
    try:
        s.thread_type = "AUTO"
        frame = next(c.decode(s), None)
    except av.FFmpegError as e:
        raise MediaError("decode_error", f"first frame: {type(e).__name__}: {e}"[:300]) from None
    if frame is None:
        raise MediaError("decode_error", "no frame could be decoded")
    rotation = normal_rotation(getattr(frame, "rotation", 0))
    if not (fps > 0):
        raise MediaError("no_duration", "frame rate unknown")
    if not (duration > 0):
        raise MediaError("no_duration", "duration unknown or zero")
    return VideoInfo(duration=duration, fps=fps, codec=name, width=frame.width, height=frame.height,
                     rotation=rotation, frames=int(s.frames or 0), container=c.format.name)


def probe(path: str) -> VideoInfo:
    with open_container(path) as c:
        return probe_container(c, path)

