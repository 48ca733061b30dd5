"""One input -> its encoded samples, or why it produced none. Runs in a worker process (local
pool or Ray); everything it needs travels in `PrepOptions` and `Item`, both plain data."""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import time
import traceback
from dataclasses import asdict, dataclass, field

import numpy as np

from dataio.errors import MediaError
from dataio.prep.inputs import Item


@dataclass(frozen=True)
class PrepOptions:
    kind: str = "video"  # video | images
    clips: str = "stride"  # stride | scenes
    max_clip_len: float = 10.0  # seconds
    min_clip_len: float = 1.0
    stride: float | None = None  # seconds between clip starts (default max_clip_len)
    scene_threshold: float = 30.0  # mean abs difference of tiny gray frames (0-255) that makes a cut
    fps: float = 2.0  # frames sampled per second of clip
    max_frames: int = 32  # per clip (thinned uniformly beyond)
    max_side: int | None = 448
    max_pixels: int | None = None
    store: str = "frames"  # frames (KEY.000.jpg ...) | mp4 (KEY.mp4, re-encoded)
    jpeg_quality: int = 90
    crf: int = 23
    caption_prompt: str = "Describe the video."
    decode_threads: int = 1
    shard_size: int = 256 * 2**20  # target bytes of one shard
    max_samples_per_shard: int = 10_000
    base_dir: str = ""  # source paths are recorded relative to it when inside it

    def check(self) -> None:
        if self.kind not in ("video", "images"):
            raise ValueError(f"kind must be video or images, got {self.kind!r}")
        if self.clips not in ("stride", "scenes"):
            raise ValueError(f"--clips must be 'stride' or 'scenes', got {self.clips!r}")
        if self.store not in ("frames", "mp4"):
            raise ValueError(f"--store must be 'frames' or 'mp4', got {self.store!r}")
        if not 0 < self.min_clip_len <= self.max_clip_len:
            raise ValueError(f"need 0 < --min-clip-len ({self.min_clip_len}) <= --max-clip-len ({self.max_clip_len})")
        if self.stride is not None and self.stride <= 0:
            raise ValueError(f"--stride must be > 0, got {self.stride}")
        if self.fps <= 0 or self.max_frames < 1:
            raise ValueError(f"need --fps > 0 and --max-frames >= 1 (got {self.fps}, {self.max_frames})")
        if self.max_side is not None and self.max_side < 2 or self.max_pixels is not None and self.max_pixels < 4:
            raise ValueError("--max-side must be >= 2 and --max-pixels >= 4")
        if not 1 <= self.jpeg_quality <= 100:
            raise ValueError(f"--jpeg-quality must be in 1..100, got {self.jpeg_quality}")
        if self.shard_size < 1 or self.max_samples_per_shard < 1:
            raise ValueError("--shard-size and --max-samples-per-shard must be >= 1")

    def fingerprint_dict(self) -> dict:
        d = asdict(self)
        d.pop("decode_threads")  # does not change the output
        return d


@dataclass
class Sample:
    key: str
    members: list[tuple[str, bytes]]  # (member name, data), in tar order; the JSON is last


@dataclass
class WorkResult:
    index: int  # position of the item in the sorted input list
    path: str
    samples: list[Sample] = field(default_factory=list)
    reason: str | None = None  # set when the item produced nothing
    detail: str = ""
    seconds: dict = field(default_factory=dict)  # probe / decode / encode

    @property
    def ok(self) -> bool:
        return self.reason is None


_UNSAFE = re.compile(r"[^A-Za-z0-9_-]+")


def item_key(path: str, base_dir: str) -> str:
    """A WebDataset key (no dots: the first dot starts the extension) that is stable for a
    source path: a readable stem plus a hash of the path relative to the run's base dir."""
    rel = source_name(path, base_dir)
    stem = _UNSAFE.sub("_", os.path.splitext(os.path.basename(path))[0]).strip("_")[:40] or "x"
    return f"{stem}-{hashlib.sha1(rel.encode()).hexdigest()[:10]}"


def source_name(path: str, base_dir: str) -> str:
    if base_dir and os.path.commonpath([base_dir, path]) == base_dir:
        return os.path.relpath(path, base_dir)
    return path


def _text_fields(item: Item, opts: PrepOptions) -> dict:
    rec: dict = {}
    if item.question is not None:
        rec["prompt"] = item.question
    elif item.caption is not None:
        rec["prompt"] = opts.caption_prompt  # a captioning task: the caption is the reference answer
    if item.answer is not None:
        rec["answer"] = item.answer
    elif item.caption is not None and item.question is None:
        rec["answer"] = item.caption
    if item.caption is not None:
        rec["caption"] = item.caption
    return rec


def process_video(index: int, item: Item, opts: PrepOptions) -> WorkResult:
    from dataio.prep.clips import sample_times, scene_clips, scene_cuts, stride_clips
    from dataio.prep.encode import jpeg_bytes, mp4_bytes
    from dataio.prep.frames import decode_clips, scene_signatures
    from dataio.prep.probe import probe

    res = WorkResult(index, item.path)
    video = item.files[0]
    t0 = time.perf_counter()
    if opts.clips == "scenes":
        info, times, sigs = scene_signatures(video, opts.decode_threads)
        cuts = scene_cuts(times, sigs, opts.scene_threshold, opts.min_clip_len)
        spans = scene_clips(info.duration, cuts, opts.max_clip_len, opts.min_clip_len)
    else:
        info = probe(video)
        spans = stride_clips(info.duration, opts.max_clip_len, opts.min_clip_len, opts.stride)
    res.seconds["probe"] = time.perf_counter() - t0
    if not spans:
        raise MediaError("no_clips", f"{info.duration:.2f}s is shorter than --min-clip-len {opts.min_clip_len}")
    rate = min(opts.fps, info.fps)  # never sample faster than the source has frames
    times = [sample_times(s, e, rate, opts.max_frames) for s, e in spans]
    t1 = time.perf_counter()
    info, clips = decode_clips(video, times, opts.max_side, opts.max_pixels, opts.decode_threads, info)
    t2 = time.perf_counter()
    res.seconds["decode"] = t2 - t1
    key0 = item_key(item.path, opts.base_dir)
    text = _text_fields(item, opts)
    src = {**_source(item, opts), **info.as_dict()}
    for c, ((s, e), ts, frames) in enumerate(zip(spans, times, clips)):
        key = f"{key0}-{c:04d}"
        t, h, w, _ = frames.shape
        # the clip's own start/end live under `clip`, not as metadata start_s/end_s, which
        # the reader would apply as a window inside the stored clip
        meta = {"width": w, "height": h, "fps": rate, "duration": round(e - s, 6),
                "clip": {"index": c, "of": len(spans), "start_s": s, "end_s": e, "times": ts}, "source": src}
        if opts.store == "mp4":
            members = [(f"{key}.mp4", mp4_bytes(frames, rate, opts.crf))]
            meta["frames"] = t
        else:
            digits = max(3, len(str(t - 1)))
            members = [(f"{key}.{i:0{digits}d}.jpg", jpeg_bytes(f, opts.jpeg_quality)) for i, f in enumerate(frames)]
            meta["num_frames"] = t
        rec = {**text, "metadata": _with_row_fields(meta, item)}
        members.append((f"{key}.json", json.dumps(rec, sort_keys=True).encode()))
        res.samples.append(Sample(key, members))
    res.seconds["encode"] = time.perf_counter() - t2
    return res


def process_image(index: int, item: Item, opts: PrepOptions) -> WorkResult:
    """An image file, or a dataset row's images (several: KEY.image0.jpg, KEY.image1.jpg, ...)."""
    from dataio.prep.encode import jpeg_bytes

    res = WorkResult(index, item.path)
    t0 = time.perf_counter()
    loaded = [_load_image(path, opts) for path in item.files]
    t1 = time.perf_counter()
    res.seconds["decode"] = t1 - t0
    key = item_key(item.path, opts.base_dir)
    names = [f"{key}.jpg"] if len(loaded) == 1 else [f"{key}.image{i}.jpg" for i in range(len(loaded))]
    sizes = [{"width": w0, "height": h0, "format": fmt} for _, (w0, h0, fmt) in loaded]
    meta = {"width": loaded[0][0].width, "height": loaded[0][0].height,
            "source": {**_source(item, opts), **(sizes[0] if len(loaded) == 1 else {"images": sizes})}}
    if len(loaded) > 1:
        meta["images"] = [{"width": im.width, "height": im.height} for im, _ in loaded]
    rec = {**_text_fields(item, opts), "metadata": _with_row_fields(meta, item)}
    members = [(name, jpeg_bytes(np.asarray(im), opts.jpeg_quality)) for name, (im, _) in zip(names, loaded)]
    res.samples.append(Sample(key, members + [(f"{key}.json", json.dumps(rec, sort_keys=True).encode())]))
    res.seconds["encode"] = time.perf_counter() - t1
    return res


def _load_image(path: str, opts: PrepOptions):
    """(RGB image shrunk to the size limits, (source width, height, format))."""
    from PIL import Image, ImageOps

    from dataio.decode import to_rgb
    from dataio.prep.frames import target_size

    try:
        if os.path.getsize(path) == 0:
            raise MediaError("empty_file", "0 bytes")
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise MediaError("unreadable", f"{type(e).__name__}: {e.strerror or e}") from None
    try:
        im = Image.open(io.BytesIO(data))
        fmt = im.format
        im.load()
        im = to_rgb(ImageOps.exif_transpose(im))
    except Exception as e:
        raise MediaError("not_an_image", f"{type(e).__name__}: {e}"[:300]) from None
    w0, h0 = im.size
    w, h = target_size(w0, h0, opts.max_side, opts.max_pixels)
    if w < w0 - 1 or h < h0 - 1:  # only to shrink (target_size also evens the sides, not needed here)
        im = im.resize((w, h), Image.Resampling.BICUBIC)
    return im, (w0, h0, fmt)


def _source(item: Item, opts: PrepOptions) -> dict:
    """Where a sample came from: its media file, or its dataset file and row."""
    if not item.media:
        return {"path": source_name(item.path, opts.base_dir)}
    file, _, row = item.path.rpartition("#")
    out = {"file": source_name(file, opts.base_dir), "row": int(row)}
    if not file.endswith(".parquet"):  # a parquet row's images came as bytes: only a staged copy exists
        out["media"] = [source_name(m, opts.base_dir) for m in item.media]
    return out


def _with_row_fields(meta: dict, item: Item) -> dict:
    if item.extra:
        meta["extra"] = dict(item.extra)
    if item.conversation:
        meta["conversations"] = json.loads(item.conversation)
    return meta


def process(index: int, item: Item, opts: PrepOptions) -> WorkResult:
    """Never raises: a bad input becomes a WorkResult with a reason."""
    if item.problem is not None:  # a dataset row that cannot become a sample
        return WorkResult(index, item.path, reason=item.problem[0], detail=item.problem[1][:300])
    fn = process_video if opts.kind == "video" else process_image
    try:
        return fn(index, item, opts)
    except MediaError as e:
        return WorkResult(index, item.path, reason=e.reason, detail=e.detail)
    except MemoryError:
        raise
    except Exception as e:
        tb = traceback.format_exception_only(type(e), e)[-1].strip()
        return WorkResult(index, item.path, reason="error", detail=tb[:300])
