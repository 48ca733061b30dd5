"""Decoding and Qwen2-VL sizing: images with pillow, videos with decord, frame sequences.

Every output is resized so both sides are multiples of the model's factor (Qwen2-VL: 14-pixel
patches merged 2x2, 28) with the pixel count inside [min_pixels, max_pixels] (`smart_resize`,
transformers' Qwen2-VL rule step for step; outputs already at that size pass through the
processor unchanged).

decord is guarded (see `VideoDecodePool`): it is unmaintained, and a container that
over-reports its frame count can deadlock `get_batch` while holding the GIL, which no thread
can interrupt. So by default video decoding runs in long-lived child processes that are killed
after `decode_timeout_s`, and frame counts are checked before any `get_batch`. Each child also
dies with the process that started it, however that one dies (`die_with_parent`): a child stuck
in decord outlives every signal its Python code could handle.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import io
import json
import math
import mmap
import multiprocessing as mp
import os
import queue
import signal
import socket
import sys
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from multiprocessing import reduction

import numpy as np
from PIL import Image, ImageOps

from dataio.errors import MediaError


DEFAULT_FACTOR = 28  # Qwen2-VL's 14-px patches merged 2 x 2: MediaConfig.factor 0 without a model


@dataclass(frozen=True)
class MediaConfig:
    # output sides are multiples of this: the model's patch size x spatial merge (Qwen2-VL 14 x 2 = 28,
    # Qwen3-VL 16 x 2 = 32). 0: the model's, set by yatt-mm rl/sft once the model is known (28 where
    # no model is: data tools); another value than the model's is refused there
    factor: int = 0
    image_min_pixels: int = 4 * 28 * 28  # images are upscaled to at least this many pixels (H * W)
    image_max_pixels: int = 1280 * 28 * 28  # images are downscaled to at most this many pixels (H * W)
    image_draft: bool = True  # JPEG DCT-domain downscale when the target is smaller (faster)
    video_min_pixels: int = 4 * 28 * 28  # min pixels (H * W) per video frame after resizing
    video_max_pixels: int = 256 * 28 * 28  # max pixels (H * W) per video frame after resizing
    video_frames: int = 16  # N uniformly spaced frames; ignored when video_fps is set
    video_fps: float | None = None  # sample at this rate instead, at most video_max_frames
    video_max_frames: int = 64  # cap on frames sampled per video (also caps video_frames); >= 1
    video_start_s: float | None = None  # window start in seconds; None: from 0; sample JSON start_s wins
    video_end_s: float | None = None  # window end in seconds (exclusive); None: to the end; sample JSON end_s wins
    video_max_reported_frames: int = 1_000_000  # a header claiming more is treated as corrupt
    video_threads: int = 1  # decord decoding threads per video
    frames_fps: float = 1.0  # frame rate assumed for KEY.000.jpg ... sequences without metadata

    # allowed values, checked when yatt-mm loads a config (yatt_mm/config.py)
    RANGES = {"factor": ">= 0", "image_min_pixels": ">= 1", "image_max_pixels": ">= 1", "video_min_pixels": ">= 1",
              "video_max_pixels": ">= 1", "video_frames": ">= 1", "video_fps": "> 0", "video_max_frames": ">= 1",
              "video_start_s": ">= 0", "video_end_s": "> 0", "video_max_reported_frames": ">= 1", "video_threads": ">= 0",
              "frames_fps": "> 0"}

    @property
    def side(self) -> int:
        """The side multiple media are resized to: `factor`, or Qwen2-VL's 28 while it is 0."""
        return self.factor or DEFAULT_FACTOR

    def validate(self) -> None:
        if self.factor < 0:
            raise ValueError(f"factor must be >= 0, got {self.factor}")
        for lo, hi in (("image_min_pixels", "image_max_pixels"), ("video_min_pixels", "video_max_pixels")):
            a, b = getattr(self, lo), getattr(self, hi)
            if not 0 < a <= b:
                raise ValueError(f"{lo} ({a}) must be > 0 and <= {hi} ({b})")
            if b < self.side * self.side:
                raise ValueError(f"{hi} ({b}) must be >= factor^2 = {self.side ** 2}")
        if self.video_fps is None and self.video_frames < 1:
            raise ValueError(f"video_frames must be >= 1 (or set video_fps), got {self.video_frames}")
        if self.video_fps is not None and self.video_fps <= 0:
            raise ValueError(f"video_fps must be > 0, got {self.video_fps}")
        if self.video_max_frames < 1:
            raise ValueError(f"video_max_frames must be >= 1, got {self.video_max_frames}")


MAX_ASPECT_RATIO = 200  # Qwen2-VL's processor refuses longer/shorter side ratios above this


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """(height, width) rounded to multiples of `factor`, scaled (keeping the aspect ratio as
    closely as the rounding allows) into [min_pixels, max_pixels]: transformers' Qwen2-VL
    `smart_resize` (models/qwen2_vl/image_processing_qwen2_vl.py), step for step, so the
    processor takes our outputs as they are. Not imported from there: that module loads torch
    and torchvision (seconds of CPU) into every video decoding process and the data tools;
    tests/dataio/test_dataio_decode_cli.py compares the two on odd shapes.

    Media the processor would refuse are MediaErrors, which the reader counts and skips:
    an empty image, and an aspect ratio over 200 (transformers raises a ValueError)."""
    if height < 1 or width < 1:
        raise MediaError("corrupt_image", f"empty image {width}x{height}")
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise MediaError("bad_aspect_ratio", f"{width}x{height} has an aspect ratio over {MAX_ASPECT_RATIO}, "
                                             "which Qwen-VL processors refuse")
    # a side under factor / 2 rounds to 0 here: the pixel count is then under min_pixels, and
    # the upscale below gives that side its multiple of factor (3 x 300 -> 28 x 560, not 28 x 308)
    h = round(height / factor) * factor
    w = round(width / factor) * factor
    if h * w > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h = math.ceil(height * beta / factor) * factor
        w = math.ceil(width * beta / factor) * factor
    return h, w


def to_rgb(im: Image.Image) -> Image.Image:
    """Any pillow mode -> RGB; transparent pixels become white, 16-bit and float are rescaled."""
    if im.mode == "RGB":
        return im
    if im.mode.startswith("I;16"):
        a = np.asarray(im, dtype=np.float32) / 257.0
        return Image.fromarray(a.clip(0, 255).astype(np.uint8), "L").convert("RGB")
    if im.mode in ("I", "F"):
        a = np.asarray(im, dtype=np.float32)
        lo, hi = float(a.min()), float(a.max())
        a = (a - lo) * (255.0 / (hi - lo)) if hi > lo else np.zeros_like(a)
        return Image.fromarray(a.astype(np.uint8), "L").convert("RGB")
    if im.mode in ("RGBA", "LA", "PA", "La", "RGBa") or (im.mode == "P" and "transparency" in im.info):
        rgba = im.convert("RGBA")
        bg = Image.new("RGB", rgba.size, (255, 255, 255))
        bg.paste(rgba, mask=rgba.getchannel("A"))
        return bg
    return im.convert("RGB")


def decode_image(data: bytes, cfg: MediaConfig, min_pixels: int | None = None, max_pixels: int | None = None,
                 size: tuple[int, int] | None = None) -> Image.Image:
    """Encoded image bytes -> RGB image at its Qwen2-VL size (or at `size` = (h, w) if given)."""
    min_pixels = cfg.image_min_pixels if min_pixels is None else min_pixels
    max_pixels = cfg.image_max_pixels if max_pixels is None else max_pixels
    try:
        im = Image.open(io.BytesIO(data))
        orientation = im.getexif().get(0x0112, 1)
        w, h = im.size
        rotated = orientation in (5, 6, 7, 8)  # EXIF transposes that swap width and height
        ow, oh = (h, w) if rotated else (w, h)
        th, tw = size or smart_resize(oh, ow, cfg.side, min_pixels, max_pixels)
        if cfg.image_draft and im.format == "JPEG" and tw * th < ow * oh:
            # decode at the smallest 1/2, 1/4, 1/8 scale still >= the target (libjpeg DCT scaling)
            im.draft("RGB", (th, tw) if rotated else (tw, th))
        im.load()
        if orientation != 1:
            im = ImageOps.exif_transpose(im)
        im = to_rgb(im)
    except MediaError:
        raise
    except Exception as e:  # PIL raises many types for bad data (OSError, SyntaxError, ValueError, ...)
        raise MediaError("corrupt_image", f"{type(e).__name__}: {e}") from None
    if im.size != (tw, th):
        im = im.resize((tw, th), Image.Resampling.BICUBIC)
    return im


def sample_frame_indices(n: int, fps: float, cfg: MediaConfig, start_s: float | None = None,
                         end_s: float | None = None) -> list[int]:
    """Frame indices to decode: N uniform ones, or one every 1/video_fps seconds (at most
    video_max_frames, thinned uniformly), inside the optional [start_s, end_s) window."""
    start_s = cfg.video_start_s if start_s is None else start_s
    end_s = cfg.video_end_s if end_s is None else end_s
    lo = 0 if start_s is None else max(0, min(n - 1, int(math.floor(start_s * fps))))
    hi = n if end_s is None else max(lo + 1, min(n, int(math.ceil(end_s * fps))))
    if cfg.video_fps is not None:
        idx = np.arange(lo, hi, max(fps / cfg.video_fps, 1e-9))
        if len(idx) > cfg.video_max_frames:
            idx = idx[np.linspace(0, len(idx) - 1, cfg.video_max_frames).round().astype(int)]
    else:
        k = min(cfg.video_frames, cfg.video_max_frames)
        idx = np.linspace(lo, hi - 1, k) if hi - lo > 1 else np.full(k, lo)
    return [int(i) for i in np.clip(np.round(idx), lo, hi - 1)]


def resize_frames(frames: np.ndarray, cfg: MediaConfig, alloc=None) -> np.ndarray:
    """alloc(shape) -> uint8 array for the output (e.g. a view of shared memory); default np.empty."""
    import cv2

    t, h, w, _ = frames.shape
    th, tw = smart_resize(h, w, cfg.side, cfg.video_min_pixels, cfg.video_max_pixels)
    if (th, tw) == (h, w):
        return np.ascontiguousarray(frames)
    interp = cv2.INTER_AREA if th * tw < h * w else cv2.INTER_CUBIC
    out = (alloc or np.empty)((t, th, tw, 3), dtype=np.uint8)
    for i in range(t):
        out[i] = cv2.resize(frames[i], (tw, th), interpolation=interp)
    return out


def import_decord():
    """decord bundles an older libvpx: loaded before PyAV's ffmpeg, it breaks PyAV's VP9 encoder
    for the rest of the process (avcodec_open2 returns EINVAL). Loading PyAV first keeps both."""
    try:
        import av  # noqa: F401
    except ImportError:
        pass
    import decord

    return decord


_STDERR_LOCK = threading.Lock()  # one redirection of the process's fd 2 at a time


@contextlib.contextmanager
def _c_stderr_held():
    """The process's stderr (fd 2, where C libraries write) into a temporary file for the
    block; yields a list that then holds what was written. A video decoding child does nothing
    else meanwhile; in a decoding thread (data.video_isolation=none) another thread's lines of
    that moment are caught too, which the caller writes out again unless the open failed."""
    with _STDERR_LOCK, tempfile.TemporaryFile() as held:
        sys.stderr.flush()
        saved = os.dup(2)
        said: list[str] = [""]
        os.dup2(held.fileno(), 2)
        try:
            yield said
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            held.seek(0)
            said[0] = held.read().decode("utf-8", "replace")


def _write_stderr(text: str) -> None:
    sys.stderr.write(text)
    sys.stderr.flush()


def decode_video_bytes(data: bytes, cfg: MediaConfig, window: tuple[float | None, float | None] = (None, None),
                       expected_frames: int | None = None, alloc=None) -> np.ndarray:
    """Encoded video bytes -> uint8 [T, H, W, 3] at the Qwen2-VL video size (resized into
    alloc(shape, dtype=np.uint8) when given).

    Checks before `get_batch`: the reported frame count is positive and plausible, matches the
    frames decord actually indexed (packets with timestamps), and matches `expected_frames`
    (the sample's JSON metadata) when that is given."""
    decord = import_decord()

    with _c_stderr_held() as said:  # decord writes the member's bytes into its message when opening fails
        try:
            vr, failure = decord.VideoReader(io.BytesIO(data), num_threads=cfg.video_threads), None
        except Exception as e:
            vr, failure = None, e
    if failure is not None:
        # its log line is "ERROR opening: <the bytes>, <libav's reason>": the reason alone
        reason = said[0].rsplit(", ", 1)[-1].strip() if "ERROR opening:" in said[0] else str(failure)[:200]
        raise MediaError("corrupt_video", f"decord cannot open: {type(failure).__name__}: {reason}") from None
    if said[0]:
        _write_stderr(said[0])  # an open that worked: whatever was written meanwhile goes out as it was
    try:
        n = len(vr)
        if not 0 < n <= cfg.video_max_reported_frames:
            raise MediaError("bad_frame_count", f"container reports {n} frames")
        if expected_frames is not None and int(expected_frames) != n:
            raise MediaError("bad_frame_count", f"container reports {n} frames, metadata says {expected_frames}")
        try:
            vr.get_frame_timestamp(n - 1)  # raises if fewer frames were indexed than reported
        except IndexError:
            raise MediaError("bad_frame_count", f"container reports {n} frames but fewer are indexed") from None
        fps = float(vr.get_avg_fps())
        if not (math.isfinite(fps) and fps > 0):
            raise MediaError("corrupt_video", f"frame rate {fps}")
        idx = sample_frame_indices(n, fps, cfg, *window)
        try:
            frames = vr.get_batch(idx).asnumpy()
        except Exception as e:
            raise MediaError("corrupt_video", f"get_batch: {type(e).__name__}: {str(e)[:200]}") from None
        if frames.ndim != 4 or frames.shape[0] != len(idx) or frames.shape[-1] != 3:
            raise MediaError("bad_frame_count", f"asked {len(idx)} frames, got shape {frames.shape}")
        vr.seek(0)  # decord's get_batch leak workaround (dmlc/decord#208)
    finally:
        del vr
    return resize_frames(frames, cfg, alloc)


def decode_frame_sequence(datas: list[bytes], cfg: MediaConfig, fps: float | None = None,
                          window: tuple[float | None, float | None] = (None, None)) -> np.ndarray:
    """KEY.000.jpg, KEY.001.jpg, ... (in order) -> uint8 [T, H, W, 3], sampled like a video."""
    idx = sample_frame_indices(len(datas), fps or cfg.frames_fps, cfg, *window)
    first = Image.open(io.BytesIO(datas[idx[0]])) if datas else None
    if first is None:
        raise MediaError("missing_media", "empty frame sequence")
    try:
        w, h = first.size
    except Exception as e:
        raise MediaError("corrupt_image", str(e)) from None
    size = smart_resize(h, w, cfg.side, cfg.video_min_pixels, cfg.video_max_pixels)
    out = [np.asarray(decode_image(datas[i], cfg, size=size)) for i in idx]
    return np.stack(out)


# ---------------------------------------------------------------- video decoding in child processes

VIDEO_DECODER = "dataio.decode:decode_video_bytes"


def die_with_parent() -> None:
    """Call first in a child process: SIGKILL reaches it when the thread that started it ends
    (Linux PR_SET_PDEATHSIG; a signal the kernel delivers, so also to a child stuck in C with the
    GIL held), and it exits at once if the process that started it is gone already (died before
    the request). yatt_mm.processes has the same for the trainer's processes; dataio imports
    nothing of yatt_mm."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)  # 1: PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass  # not Linux: the child outlives a killed parent, as without this
    parent = mp.parent_process()
    if parent is not None and not parent.is_alive():
        os._exit(1)


class EndsWithItsParent:
    """`fn`, for torchdata's process workers (data.worker_kind: process), which otherwise poll
    their queue forever once the reading process is killed -9: the first call in a worker process
    starts a thread there that ends the worker when the process that forked it is gone. Not the
    kernel's parent-death signal: that fires when the forking *thread* ends, and the thread that
    starts an epoch's workers may end before the epoch does (the next step's rollout thread). A
    worker that never got an item is not covered (an epoch with fewer items than workers)."""

    def __init__(self, fn):
        self.fn = fn
        self.parent = os.getpid()
        self.watched_in: int | None = None

    def __call__(self, item):
        if os.getpid() not in (self.parent, self.watched_in):
            self.watched_in = os.getpid()
            threading.Thread(target=_exit_when_orphaned, args=(self.parent,), daemon=True,
                             name="yatt-mm-parent-watch").start()
        return self.fn(item)


def _exit_when_orphaned(parent: int) -> None:
    import time

    while os.getppid() == parent:  # the parent gone, the kernel hands this process to another
        time.sleep(0.5)
    os._exit(1)


# The kernel's parent-death signal fires when the *thread* that started a child ends, not its
# process; the reader's decode threads end with each epoch while other threads may still use the
# children they started. So every decode child is started from this one thread, which lives as
# long as the process.
_STARTER = ThreadPoolExecutor(1, thread_name_prefix="yatt-mm-video-starter")


_SHM_GRAIN = 1 << 20  # the frame buffer grows in whole MiB


def _shm_supported() -> bool:
    return hasattr(os, "memfd_create") and hasattr(socket, "CMSG_LEN")


def _worker_main(conn, decoder: str, shared: bool = False) -> None:
    """A child process: receive (JSON header, video bytes), answer a JSON header and the raw
    frames. Raw bytes both ways, so nothing is unpickled in either process.

    shared: the parent first sends an anonymous shared-memory file (memfd). The child writes the
    frames into it (growing it when a clip needs more) and sends only the header; a pipe would
    cost a copy into the socket, a copy out and ~100 syscalls for a 6 MB clip."""
    die_with_parent()
    mod, _, fn = decoder.partition(":")
    decode = getattr(importlib.import_module(mod), fn)
    fd, mm = None, None
    if shared:
        try:
            fd = reduction.recv_handle(conn)
        except (EOFError, OSError):
            return
    takes_alloc = shared and "alloc" in inspect.signature(decode).parameters

    def shm_view(shape, dtype=np.uint8):
        """The start of the shared buffer as an array of `shape`, growing the buffer if needed."""
        nonlocal mm
        nbytes = math.prod(shape)
        if mm is None or len(mm) < nbytes:
            size = max(_SHM_GRAIN, -(-nbytes // _SHM_GRAIN) * _SHM_GRAIN)
            if mm is not None:
                try:
                    mm.close()
                except BufferError:  # a view of it is still alive somewhere: let GC unmap it
                    pass
            os.ftruncate(fd, size)
            mm = mmap.mmap(fd, size)
        return np.frombuffer(mm, np.uint8, nbytes).reshape(shape)

    while True:
        try:
            head = json.loads(conn.recv_bytes())
            data = conn.recv_bytes()
        except (EOFError, OSError):
            return
        arr = None
        try:
            cfg = MediaConfig(**head["cfg"])
            args = (data, cfg, tuple(head["window"]), head["expected_frames"])
            arr = decode(*args, alloc=shm_view) if takes_alloc else decode(*args)
            arr = np.asarray(arr, dtype=np.uint8)
            if fd is None:
                arr = np.ascontiguousarray(arr)
                conn.send_bytes(json.dumps({"shape": list(arr.shape)}).encode())
                conn.send_bytes(memoryview(arr).cast("B"))
                continue
            if arr.nbytes and not (mm is not None and arr.flags.c_contiguous
                                   and arr.ctypes.data == np.frombuffer(mm, np.uint8, 1).ctypes.data):
                np.copyto(shm_view(arr.shape), arr)  # not resized into the buffer already
            conn.send_bytes(json.dumps({"shape": list(arr.shape), "shm": True}).encode())
        except MediaError as e:
            conn.send_bytes(json.dumps({"reason": e.reason, "detail": e.detail}).encode())
        except Exception as e:
            conn.send_bytes(json.dumps({"reason": "corrupt_video", "detail": f"{type(e).__name__}: {e}"[:300]}).encode())


class _Worker:
    def __init__(self, ctx, decoder: str, shared: bool):
        self.conn, child = ctx.Pipe()
        self.fd, self.mm = None, None
        self.proc = ctx.Process(target=_worker_main, args=(child, decoder, shared), daemon=True, name="yatt-mm-video")
        self.proc.start()
        child.close()
        if shared:
            # anonymous: no /dev/shm name that a crash could leak; freed when both ends close it
            self.fd = os.memfd_create("yatt-mm-video-frames", os.MFD_CLOEXEC)
            reduction.send_handle(self.conn, self.fd, self.proc.pid)

    def frames(self, shape: list[int]) -> np.ndarray:
        """A copy of the frames the child left in the shared buffer."""
        nbytes = math.prod(shape)
        if nbytes == 0:
            return np.empty(shape, np.uint8)
        if self.mm is None or len(self.mm) < nbytes:  # the child grew the buffer
            if self.mm is not None:
                self.mm.close()
            self.mm = mmap.mmap(self.fd, os.fstat(self.fd).st_size, prot=mmap.PROT_READ)
        view = np.frombuffer(self.mm, np.uint8, nbytes)
        out = view.reshape(shape).copy()
        del view  # release the buffer export, so that mm can be closed
        return out

    def kill(self) -> None:
        self.proc.kill()
        self.proc.join(5)
        self.conn.close()
        if self.mm is not None:
            self.mm.close()
            self.mm = None
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


class VideoDecodePool:
    """Up to `size` child processes that decode videos; a decode that takes longer than
    `timeout_s` gets its process killed (and replaced on next use) and raises
    MediaError("video_timeout"). Usable from several threads at once.

    Frames come back through a shared-memory buffer per child (`shared_memory`, default where
    the OS has memfd, i.e. Linux), else through the pipe."""

    def __init__(self, size: int, timeout_s: float, decoder: str = VIDEO_DECODER, start_method: str = "spawn",
                 shared_memory: bool | None = None):
        if size < 1:
            raise ValueError(f"video decode pool size must be >= 1, got {size}")
        if timeout_s <= 0:
            raise ValueError(f"decode_timeout_s must be > 0, got {timeout_s}")
        self.timeout_s = timeout_s
        self.decoder = decoder
        self.shared_memory = _shm_supported() if shared_memory is None else shared_memory
        self._ctx = mp.get_context(start_method)
        self._idle: queue.LifoQueue[_Worker | None] = queue.LifoQueue()
        for _ in range(size):
            self._idle.put(None)  # a slot; its process starts on first use
        self._lock = threading.Lock()
        self.killed = 0

    def decode(self, data: bytes, cfg: MediaConfig, window=(None, None), expected_frames: int | None = None) -> np.ndarray:
        w = self._idle.get()
        try:
            if w is None or not w.proc.is_alive():
                if w is not None:
                    w.kill()
                w = _STARTER.submit(_Worker, self._ctx, self.decoder, self.shared_memory).result()
            head = {"cfg": asdict(cfg), "window": list(window), "expected_frames": expected_frames}
            w.conn.send_bytes(json.dumps(head).encode())
            w.conn.send_bytes(data)
            if not w.conn.poll(self.timeout_s):
                w.kill()
                w = None
                with self._lock:
                    self.killed += 1
                raise MediaError("video_timeout", f"no result within {self.timeout_s}s; decoder process killed")
            reply = json.loads(w.conn.recv_bytes())
            if "reason" in reply:
                raise MediaError(reply["reason"], reply.get("detail", ""))
            if reply.get("shm"):
                return w.frames(reply["shape"])
            arr = np.empty(reply["shape"], dtype=np.uint8)
            w.conn.recv_bytes_into(memoryview(arr).cast("B"))
            return arr
        except (EOFError, OSError, BrokenPipeError) as e:  # the child died (e.g. a crash in libav)
            if w is not None:
                w.kill()
                w = None
            raise MediaError("corrupt_video", f"decoder process died: {type(e).__name__}") from None
        finally:
            self._idle.put(w)

    def close(self) -> None:
        while True:
            try:
                w = self._idle.get_nowait()
            except queue.Empty:
                return
            if w is not None:
                w.kill()
