"""Which clips to cut from a video: fixed stride, or scene cuts.

Both return [(start_s, end_s), ...] in time order; clips shorter than `min_len` are dropped and
longer spans are cut into pieces of at most `max_len`."""

from __future__ import annotations

import numpy as np


def stride_clips(duration: float, max_len: float, min_len: float, stride: float | None = None) -> list[tuple[float, float]]:
    """[k*stride, k*stride + max_len) clipped to the duration, for k = 0, 1, ...; a tail shorter
    than `min_len` is dropped (a video shorter than `min_len` has no clip)."""
    stride = stride or max_len
    out = []
    k = 0
    while True:
        s = round(k * stride, 6)
        if s >= duration - 1e-6:
            break
        e = round(min(s + max_len, duration), 6)
        if e - s >= min_len - 1e-6:
            out.append((s, e))
        k += 1
    return out


def split_span(s: float, e: float, max_len: float, min_len: float) -> list[tuple[float, float]]:
    """One scene -> pieces of equal length <= max_len (none if the scene is shorter than min_len)."""
    if e - s < min_len - 1e-6:
        return []
    n = max(1, int(np.ceil((e - s) / max_len - 1e-9)))
    step = (e - s) / n
    return [(round(s + i * step, 6), round(s + (i + 1) * step if i < n - 1 else e, 6)) for i in range(n)]


def scene_cuts(times: list[float], signatures: list[np.ndarray], threshold: float, min_gap: float) -> list[float]:
    """Cut times where the mean absolute difference of consecutive tiny gray frames (0-255) is
    above `threshold`, at least `min_gap` seconds after the previous cut."""
    cuts = []
    last = times[0] if times else 0.0
    for i in range(1, len(times)):
        d = float(np.abs(signatures[i].astype(np.int16) - signatures[i - 1].astype(np.int16)).mean())
        if d > threshold and times[i] - last >= min_gap:
            cuts.append(times[i])
            last = times[i]
    return cuts


def scene_clips(duration: float, cuts: list[float], max_len: float, min_len: float) -> list[tuple[float, float]]:
    bounds = [0.0] + [c for c in cuts if 0 < c < duration] + [duration]
    out = []
    for s, e in zip(bounds[:-1], bounds[1:]):
        out += split_span(s, e, max_len, min_len)
    return out


def sample_times(start: float, end: float, fps: float, max_frames: int) -> list[float]:
    """Times to take frames at inside [start, end): every 1/fps s, thinned uniformly to at most
    `max_frames` (the same rule as `dataio.decode.sample_frame_indices`)."""
    n = max(1, int(np.floor((end - start) * fps + 1e-6)))
    t = start + np.arange(n) / fps
    if n > max_frames:
        t = t[np.linspace(0, n - 1, max_frames).round().astype(int)]
    return [round(float(x), 6) for x in t]
