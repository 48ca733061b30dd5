"""WebDataset tar shards read by byte offset: list members from tar headers, group them into
samples by key, read one member's bytes.

Nothing here unpickles or otherwise interprets member content: it only sees names, offsets and
sizes. Decoding is `dataio.decode`'s job, and only for the extensions it knows.
"""

from __future__ import annotations

import bz2
import fcntl
import gzip
import hashlib
import lzma
import os
import re
import shutil
import sys
import tarfile
import threading
from collections import OrderedDict
from dataclasses import dataclass

from dataio import storage

IMAGE_EXTS = {"jpg", "jpeg", "png", "webp"}
VIDEO_EXTS = {"mp4", "webm", "avi", "mkv", "mov"}
TEXT_EXTS = {"json", "txt", "cls"}
_FRAME_RE = re.compile(r"^(\d+)\.([a-z0-9]+)$")

# Index rows that are not sample members: a shard whose tar structure broke part way.
TAR_ERROR_KIND = "tar_error"


# Shards compressed as a whole (webdataset reads .tar.gz / .tgz): a member cannot be read by
# byte offset, so each is decompressed once, streaming, into the cache and read from there.
_DECOMPRESSORS = {b"\x1f\x8b": gzip.open, b"BZh": bz2.open, b"\xfd7zXZ\x00": lzma.open}
_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
COMPRESSED_SUFFIXES = (".tar.gz", ".tgz", ".tar.bz2", ".tar.xz")


def _decompressor(path: str):
    with open(path, "rb") as f:
        head = f.read(6)
    if head.startswith(_ZSTD_MAGIC):
        raise ValueError(f"data shards: {path} is zstd-compressed, which this Python cannot stream: decompress it "
                         "(`zstd -d FILE -o FILE.tar`) or rewrite the data with `yatt-mm prep`")
    return next((opener for magic, opener in _DECOMPRESSORS.items() if head.startswith(magic)), None)


def cache_root() -> str:
    return os.environ.get("YATT_MM_CACHE") or os.path.expanduser("~/.cache/yatt-mm")


def _tar_name(name: str) -> str:
    for suffix in COMPRESSED_SUFFIXES + (".gz", ".bz2", ".xz"):
        if name.endswith(suffix):
            name = name[: -len(suffix)]
            break
    return name if name.endswith(".tar") else name + ".tar"


def plain_tar(path: str, remote: "storage.Entry | None" = None) -> str:
    """`path` for a plain tar shard; for a compressed one (gzip, bzip2, xz: by content, not name),
    its decompressed copy under $YATT_MM_CACHE/shards, made once with bounded memory (the key
    covers the path, size and modification time; concurrent callers wait on a lock).

    A remote shard (`remote`: its listing entry) is taken as plain by its name (`.tar`: reading
    each one's first bytes would cost a request per shard at every start); one named as
    compressed is downloaded once and decompressed into the same cache (keyed by its URL, size
    and modification time), the download deleted."""
    if remote is not None:
        if not remote.url.endswith(COMPRESSED_SUFFIXES + (".gz", ".bz2", ".xz")):
            return path
        key = hashlib.sha1(f"{remote.url}:{remote.size}:{remote.mtime}".encode()).hexdigest()[:16]
        return _decompressed_once(None, remote, os.path.join(cache_root(), "shards", key),
                                  _tar_name(storage.basename(remote.url)))
    if _decompressor(path) is None:
        return path
    st = os.stat(path)
    key = hashlib.sha1(f"{os.path.abspath(path)}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:16]
    return _decompressed_once(path, None, os.path.join(cache_root(), "shards", key), _tar_name(os.path.basename(path)))


def _decompressed_once(path: str | None, remote: "storage.Entry | None", cache: str, name: str) -> str:
    out = os.path.join(cache, name)
    if os.path.exists(out):
        return out
    os.makedirs(cache, exist_ok=True)
    with open(os.path.join(cache, ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another rank may be decompressing it: wait, then reuse
        if not os.path.exists(out):
            shown = storage.redact(remote.url) if remote else path
            download = None
            if remote is not None:
                print(f"data: downloading {shown} once to decompress it", file=sys.stderr, flush=True)
                download = path = f"{out}.download{os.getpid()}"
                storage.get_file(remote.url, download)
            print(f"data: decompressing {shown} once into {out}", file=sys.stderr, flush=True)
            tmp = f"{out}.tmp{os.getpid()}"
            try:
                opener = _decompressor(path)
                if opener is None:  # a remote shard named as compressed that is not: use it as it is
                    os.replace(path, tmp)
                else:
                    with opener(path, "rb") as src, open(tmp, "wb") as dst:
                        shutil.copyfileobj(src, dst, 1 << 20)
            except (OSError, EOFError, lzma.LZMAError) as e:
                if os.path.exists(tmp):
                    os.unlink(tmp)
                raise ValueError(f"data shards: {shown} is compressed but cannot be decompressed "
                                 f"({type(e).__name__}: {e})") from None
            finally:
                if download and os.path.exists(download):
                    os.unlink(download)
            os.replace(tmp, out)
    return out


@dataclass(frozen=True)
class Member:
    name: str  # full member name inside the tar
    key: str  # the sample key: the name up to the first dot of its last path component
    ext: str  # the rest after that dot, lower case: "jpg", "000.jpg", "json", "left.png"
    offset: int  # byte offset of the member's data in the tar
    size: int
    kind: str  # image | video | frame | json | txt | cls | unknown


def split_name(name: str) -> tuple[str, str]:
    """WebDataset's convention: `dir/abc.000.jpg` -> key `dir/abc`, extension `000.jpg`."""
    head, _, base = name.rpartition("/")
    stem, dot, ext = base.partition(".")
    key = f"{head}/{stem}" if head else stem
    return key, ext.lower() if dot else ""


def member_kind(ext: str) -> str:
    last = ext.rsplit(".", 1)[-1]
    m = _FRAME_RE.match(ext)
    if m and m.group(2) in IMAGE_EXTS:
        return "frame"
    if last in IMAGE_EXTS:
        return "image"
    if last in VIDEO_EXTS:
        return "video"
    if last in TEXT_EXTS:
        return last
    return "unknown"


@dataclass
class TarScan:
    members: list[Member]
    error: str | None  # set when the tar structure broke; members before it are still listed


def scan_tar(path: str | os.PathLike) -> TarScan:
    """List a shard's file members from their headers only (no data is read or decoded).

    A member whose data runs past the end of the file (a truncated shard) is reported with
    kind `truncated`; a header that cannot be parsed ends the scan with `error` set.
    """
    members: list[Member] = []
    error = None
    file_size = os.path.getsize(path)
    try:
        with tarfile.open(path, mode="r:") as tf:
            while True:
                try:
                    info = tf.next()
                except (tarfile.TarError, OSError, EOFError) as e:
                    error = f"{type(e).__name__}: {e}"
                    break
                if info is None:
                    # tarfile ends quietly at an invalid header after the first one; a non-zero
                    # block where the end-of-archive zeros should be means the shard is corrupt
                    with open(path, "rb") as fh:
                        fh.seek(tf.offset)
                        block = fh.read(512)
                    if block.strip(b"\0"):
                        error = f"invalid tar header at byte {tf.offset}; the rest of the shard is unreadable"
                    break
                if not info.isfile():
                    continue
                key, ext = split_name(info.name)
                kind = member_kind(ext)
                if info.offset_data + info.size > file_size:
                    kind = "truncated"
                members.append(Member(info.name, key, ext, info.offset_data, info.size, kind))
    except (tarfile.TarError, OSError, EOFError) as e:
        error = f"{type(e).__name__}: {e}"
    if error and members and members[-1].kind == "truncated":
        error = None  # the end of data is the truncated member's: that sample already reports it
    return TarScan(members, error)


class MemberReader:
    """Reads member bytes by (path, offset, size) with `os.pread`, keeping at most `max_open`
    files open (least recently used are closed), so a reader's open files do not grow with the
    number of shards. Safe to share between threads."""

    def __init__(self, max_open: int = 16):
        self.max_open = max_open
        self._fds: OrderedDict[str, int] = OrderedDict()
        self._lock = threading.Lock()

    def read(self, path: str, offset: int, size: int) -> bytes:
        # The read happens under the lock so that no other thread can close (evict) this fd
        # and have its number reused by another open in between; a pread from the page cache
        # is short next to any decode.
        with self._lock:
            fd = self._fds.pop(path, None)
            if fd is None:
                fd = os.open(path, os.O_RDONLY)
            self._fds[path] = fd
            while len(self._fds) > self.max_open:
                _, old = self._fds.popitem(last=False)
                os.close(old)
            data = os.pread(fd, size, offset)
        if len(data) != size:
            raise EOFError(f"{path}: wanted {size} bytes at {offset}, got {len(data)} (truncated shard?)")
        return data

    def close(self) -> None:
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()

    def __getstate__(self):  # process workers get a fresh, empty cache
        return {"max_open": self.max_open}

    def __setstate__(self, state):
        self.__init__(state["max_open"])
