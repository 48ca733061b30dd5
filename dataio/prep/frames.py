"""Decode a video once, front to back, and take the frames every clip needs: the frame shown at
each sample time, turned upright (rotation metadata) and resized (aspect kept, long side at most
`max_side`, at most `max_pixels`, never enlarged, even sides so any encoder takes them)."""

from __future__ import annotations

import math

import numpy as np

from dataio.errors import MediaError
from dataio.prep.probe import VideoInfo, open_container, probe


def target_size(width: int, height: int, max_side: int | None, max_pixels: int | None) -> tuple[int, int]:
    """(width, height) scaled down (never up) to fit both limits, aspect kept, sides even."""
    scale = 1.0
    if max_side and max(width, height) > max_side:
        scale = min(scale, max_side / max(width, height))
    if max_pixels and width * height * scale * scale > max_pixels:
        scale = min(scale, math.sqrt(max_pixels / (width * height)))
    w = max(2, int(width * scale) // 2 * 2)
    h = max(2, int(height * scale) // 2 * 2)
    return w, h


def _upright(frame, rotation: int, size: tuple[int, int]) -> np.ndarray:
    """av.VideoFrame -> uint8 [H, W, 3] RGB at `size` (display orientation)."""
    w, h = size
    cw, ch = (h, w) if rotation in (90, 270) else (w, h)  # size before turning
    if (frame.width, frame.height) != (cw, ch):
        frame = frame.reformat(width=cw, height=ch, format="rgb24", interpolation="AREA")
    a = frame.to_ndarray(format="rgb24")
    if rotation:
        a = np.ascontiguousarray(np.rot90(a, k=rotation // 90))  # rotation is counter-clockwise
    return a


def decode_clips(path: str, clip_times: list[list[float]], max_side: int | None, max_pixels: int | None,
                 threads: int = 1, info: VideoInfo | None = None) -> tuple[VideoInfo, list[np.ndarray]]:
    """One pass over the video; returns its info and, per clip, uint8 [T, H, W, 3] frames at
    the clip's sample times (seconds from the first frame)."""
    import av

    targets = sorted((t, c, j) for c, ts in enumerate(clip_times) for j, t in enumerate(ts))
    info = info or probe(path)
    with open_container(path) as cont:
        s = cont.streams.video[0]
        s.thread_type = "AUTO" if threads > 1 else "SLICE"
        s.codec_context.thread_count = threads
        size = target_size(*info.display_size, max_side, max_pixels)
        out = [np.empty((len(ts), size[1], size[0], 3), np.uint8) for ts in clip_times]
        p, prev, t0, last_t = 0, None, None, 0.0
        try:
            for frame in cont.decode(s):
                if frame.time is None:
                    continue
                if t0 is None:
                    t0 = frame.time
                tf = frame.time - t0
                while p < len(targets) and targets[p][0] < tf - 1e-3:
                    _, c, j = targets[p]
                    out[c][j] = _upright(prev if prev is not None else frame, info.rotation, size)
                    p += 1
                if p >= len(targets):
                    break
                prev, last_t = frame, tf
        except av.FFmpegError as e:
            if prev is None or last_t < info.duration - 2.0 / info.fps:
                raise MediaError("decode_error", f"at {last_t:.2f}s: {type(e).__name__}: {e}"[:300]) from None
        if p < len(targets):
            if prev is None:
                raise MediaError("decode_error", "no frame decoded")
            if targets[-1][0] > last_t + 2.0 / info.fps:
                raise MediaError("truncated", f"frames end at {last_t:.2f}s, the container says {info.duration:.2f}s")
            while p < len(targets):  # the tail of the last clip: the last frame is still on screen
                _, c, j = targets[p]
                out[c][j] = _upright(prev, info.rotation, size)
                p += 1
    return info, out


def scene_signatures(path: str, threads: int = 1) -> tuple[VideoInfo, list[float], list[np.ndarray]]:
    """Every frame's time and a tiny (32x18) gray copy, for scene-cut detection."""
    import av

    info = probe(path)
    with open_container(path) as cont:
        s = cont.streams.video[0]
        s.codec_context.thread_count = threads
        times, sigs, t0 = [], [], None
        try:
            for frame in cont.decode(s):
                if frame.time is None:
                    continue
                t0 = frame.time if t0 is None else t0
                times.append(frame.time - t0)
                sigs.append(frame.reformat(width=32, height=18, format="gray", interpolation="AREA").to_ndarray())
        except av.FFmpegError as e:
            if not times:
                raise MediaError("decode_error", f"{type(e).__name__}: {e}"[:300]) from None
    return info, times, sigs
