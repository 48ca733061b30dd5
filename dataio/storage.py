"""Where shard bytes live: local paths, or object-store URLs (`s3://`, `gs://`, `http(s)://`).

The one seam between the data layer and storage. Local paths are not touched here: the tar scan,
the index and `MemberReader` keep reading them with `open` and `os.pread`, so local reading
costs exactly what it did. A URL goes through fsspec (s3fs for S3 and its compatibles, gcsfs
for GCS, aiohttp for HTTP), one client per process and scheme, whose connection pool every
reader of the process shares:

- `RemoteReads` reads byte ranges: a sample's members in one ranged GET (`read`, `submit`), a
  timeout on each attempt, transient faults (timeouts, 5xx, resets, short bodies) retried with
  exponential backoff and counted (`retries`); a 403 or 404 is final at once.
- `ReadAhead` keeps a window of those requests in flight ahead of the decoders, on fsspec's
  event loop, so storage latency overlaps decoding.
- an optional local cache of what was read (`RemotePolicy.cache_dir`, diskcache's size-limited,
  least-recently-used store shared by the processes of a node), so later epochs read the disk.
- listing, existence, whole-object reads (the index) and uploads (`put_file`: one PUT, or a
  multipart upload for large files; either way the object appears whole under its name or not
  at all) for the index, the pre-launch checks and prep.

Credentials come the client libraries' standard way (S3: AWS_ACCESS_KEY_ID /
AWS_SECRET_ACCESS_KEY, AWS_PROFILE and ~/.aws files, AWS_ENDPOINT_URL for another S3-compatible
store; GCS: GOOGLE_APPLICATION_CREDENTIALS or the gcloud login) and never pass through here: a
URL carrying any (user:password@, a signed query string) is refused (`check_url`), and every
message names a URL through `redact`.
"""

from __future__ import annotations

import asyncio
import errno
import functools
import os
import random
import threading
import time
from concurrent.futures import CancelledError, Future
from dataclasses import dataclass
from urllib.parse import urlsplit, urlunsplit

# scheme -> fsspec protocol, and what to install for it
REMOTE_SCHEMES = {"s3": "s3", "gs": "gcs", "gcs": "gcs", "http": "http", "https": "https"}
_PACKAGE = {"s3": ("s3fs", "s3"), "gcs": ("gcsfs", "gcs"), "http": ("aiohttp", ""), "https": ("aiohttp", "")}
# Errors that say the request itself is wrong: retrying cannot help
_FINAL = (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError, FileExistsError)
# s3fs turns S3's error codes into OSErrors: these errnos are its client errors (a bad range,
# argument or redirect); EIO, EBUSY (503 SlowDown, ServiceUnavailable) and the rest may pass
_FINAL_ERRNOS = {errno.EINVAL, errno.ENOSYS, errno.EMSGSIZE, errno.ENAMETOOLONG, errno.EPERM, errno.EACCES,
                 errno.ENOENT, errno.EREMCHG}


class RemoteReadError(OSError):
    """A ranged read that failed after its retries, or failed for good (403, 404)."""


def is_remote(path) -> bool:
    """Whether `path` is an object-store URL (the schemes of REMOTE_SCHEMES)."""
    if not isinstance(path, str) or "://" not in path:
        return False
    return path.split("://", 1)[0].lower() in REMOTE_SCHEMES


def redact(url: str) -> str:
    """The URL to show: without user:password@ and without its query string (a signature)."""
    if not is_remote(url):
        return url
    parts = urlsplit(url)
    host = parts.hostname or ""
    netloc = host + (f":{parts.port}" if parts.port else "")
    return urlunsplit((parts.scheme, netloc, parts.path, "", ""))


def check_url(url: str, setting: str) -> None:
    """ValueError naming `setting` when a URL carries credentials: they would end up in the
    saved config, the quarantine log and every message naming a shard."""
    if not is_remote(url):
        if "://" in str(url):
            raise ValueError(f"{setting}: {str(url).split('://')[0]}:// is not a storage yatt-mm reads; use a local "
                             f"path or {', '.join(s + '://' for s in ('s3', 'gs', 'http', 'https'))}")
        return
    parts = urlsplit(url)
    if parts.username or parts.password or parts.query:
        raise ValueError(f"{setting}: {redact(url)} is given with credentials in the URL (user:password@ or a "
                         "query string); give the plain URL and the credentials through the environment "
                         "(AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or AWS_PROFILE, GOOGLE_APPLICATION_CREDENTIALS)")


@dataclass(frozen=True)
class RemotePolicy:
    """How remote reads behave (DataConfig's read_* settings)."""

    timeout_s: float = 30.0  # one attempt at one ranged read, connect to last byte
    attempts: int = 5  # tries of a read before the sample is skipped as remote_read_error
    backoff_s: float = 0.2  # the wait before the second try; doubled each time, with jitter
    window: int = 16  # ranged reads in flight ahead of the decoders (per reader)
    cache_dir: str = ""  # a local folder keeping the bytes read, for later epochs ("": no cache)
    cache_bytes: int = 8 << 30  # the cache's size limit: least recently used entries go first


# ------------------------------------------------------------------------ the clients
_clients: dict[tuple, object] = {}
_CLIENT_ENV = ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY",
               "AWS_SESSION_TOKEN", "AWS_PROFILE", "STORAGE_EMULATOR_HOST", "GOOGLE_APPLICATION_CREDENTIALS")
_clients_lock = threading.Lock()


def _protocol(url: str) -> str:
    return REMOTE_SCHEMES[url.split("://", 1)[0].lower()]


def filesystem(url: str):
    """This process's fsspec filesystem for the URL's scheme: one per (scheme, process), shared
    by every thread (fsspec's own cache keeps one per thread, each with its own connections)."""
    protocol = _protocol(url)
    # a new client when the process or the variables that choose the endpoint and the
    # credentials change (a test points one process at two endpoints)
    key = (protocol, os.getpid(), *(os.environ.get(v) for v in _CLIENT_ENV))
    with _clients_lock:
        fs = _clients.get(key)
        if fs is None:
            fs = _clients[key] = _make_filesystem(protocol)
    return fs


def _make_filesystem(protocol: str):
    module, extra = _PACKAGE[protocol]
    try:
        import fsspec
        __import__(module)
    except ImportError:
        how = f"pip install 'yatt-mm[{extra}]'" if extra else f"pip install {module}"
        raise RuntimeError(f"reading {protocol}:// URLs needs {module}: {how}") from None
    timeout = RemotePolicy.timeout_s
    if protocol == "s3":
        # One attempt per call in the client (botocore's and s3fs's own retries off): RemoteReads
        # retries, so that each retry is counted and waits its backoff. The endpoint
        # (AWS_ENDPOINT_URL) and credentials are botocore's standard lookup.
        fs = fsspec.filesystem("s3", skip_instance_cache=True, use_listings_cache=False,
                               config_kwargs={"retries": {"total_max_attempts": 1}, "connect_timeout": timeout,
                                              "read_timeout": timeout, "max_pool_connections": 64})
        fs.retries = 1  # s3fs's own loop (a class attribute, not an argument)
        return fs
    if protocol == "gcs":
        return _one_attempt_gcs()(skip_instance_cache=True, use_listings_cache=False, requests_timeout=timeout)
    import aiohttp

    return fsspec.filesystem(protocol, skip_instance_cache=True, use_listings_cache=False,
                             client_kwargs={"timeout": aiohttp.ClientTimeout(total=timeout)})


@functools.cache
def _one_attempt_gcs():
    """gcsfs's filesystem making one attempt per request, as s3fs is made to above: gcsfs retries
    every request up to 6 times inside (a retry decorator fixed when its class is built, with
    backoffs of 1-2 s and more, longer than a read's timeout), so that RemoteReads could neither
    count the retries nor time an attempt. Its undecorated request under the same decorator with one
    attempt; the plain filesystem where a gcsfs without that method's wrapper is installed."""
    import gcsfs
    from gcsfs.retry import retry_request

    undecorated = getattr(gcsfs.GCSFileSystem._request, "__wrapped__", None)
    if undecorated is None:
        return gcsfs.GCSFileSystem

    class OneAttemptGCSFileSystem(gcsfs.GCSFileSystem):
        _request = retry_request(retries=1)(undecorated)

    return OneAttemptGCSFileSystem


def _path(fs, url: str) -> str:
    """The path as the filesystem's methods take it (s3fs and gcsfs: bucket/key; http: the URL)."""
    return url if _protocol(url) in ("http", "https") else fs._strip_protocol(url)


def _url(fs, url_like: str, path: str) -> str:
    """A path the filesystem returned -> a URL of the scheme the user wrote (gs:// stays gs://)."""
    if "://" in path:
        return path
    return f"{url_like.split('://', 1)[0]}://{path}"


def is_transient(e: BaseException) -> bool:
    """Whether a failed request may succeed when tried again: timeouts, resets, 5xx, throttling,
    short bodies; not a 403, a 404 or a malformed request."""
    if isinstance(e, _FINAL) or isinstance(e, RemoteReadError):
        return False
    if isinstance(e, OSError) and e.errno in _FINAL_ERRNOS:
        return False
    status = getattr(e, "status", None) or getattr(e, "code", None)  # aiohttp's ClientResponseError
    if isinstance(status, int):
        return status >= 500 or status in (408, 429)
    return isinstance(e, (OSError, asyncio.TimeoutError, EOFError)) or _from_client_library(e)


def _from_client_library(e: BaseException) -> bool:
    """An error of the HTTP stack (a reset, a payload cut short, an endpoint refusing), as
    opposed to a bug (TypeError, AttributeError), which is never retried or renamed."""
    return type(e).__module__.split(".")[0] in ("aiohttp", "botocore", "aiobotocore", "urllib3", "requests",
                                                "google", "gcsfs", "s3fs", "fsspec")


def final_error(e: BaseException, url: str, doing: str = "reading", attempts: int = 1) -> OSError:
    """A failed call as the OSError to raise: 403 PermissionError, 404 FileNotFoundError, else
    RemoteReadError; the message names the URL without credentials and what was being done."""
    if isinstance(e, RemoteReadError):
        return e
    status = getattr(e, "status", None)
    said = f"{type(e).__name__}: {e}"[:300]
    if isinstance(e, PermissionError) or status in (401, 403):
        return PermissionError(f"{redact(url)}: access denied (403) when {doing} it ({said}); check the "
                               "credentials in the environment and what they may read")
    if isinstance(e, FileNotFoundError) or status == 404:
        return FileNotFoundError(f"{redact(url)} does not exist (404 when {doing} it: {said})")
    tries = f" {attempts} times" if attempts > 1 else ""
    return RemoteReadError(f"{redact(url)}: {doing} it failed{tries}, last: {said}")


class RemoteReads:
    """Ranged reads of remote objects with retries: one per reader, its `retries` the count of
    retried attempts (data/remote_retries). Safe to share between threads."""

    def __init__(self, policy: RemotePolicy = RemotePolicy()):
        self.policy = policy
        self.retries = 0  # attempts that failed transiently and were tried again
        self.cache_hits = 0  # reads answered by the local cache
        self._lock = threading.Lock()
        self._cache = None  # diskcache.Cache, opened per process (its SQLite handle is not fork-safe)
        self._cache_pid = None

    def _cached(self):
        if not self.policy.cache_dir:
            return None
        if self._cache_pid != os.getpid():
            import diskcache

            # shards are immutable objects: the key is the URL and the range; a shard rewritten
            # under its name needs the folder cleared (docs/data.md)
            self._cache = diskcache.Cache(self.policy.cache_dir, size_limit=self.policy.cache_bytes,
                                          eviction_policy="least-recently-used")
            self._cache_pid = os.getpid()
        return self._cache

    @property
    def caching(self) -> bool:
        return bool(self.policy.cache_dir)

    def has(self, url: str, start: int, end: int) -> bool:
        """Whether the cache holds bytes [start, end) of `url` (False without a cache)."""
        return (cache := self._cached()) is not None and (url, start, end) in cache

    def keep(self, url: str, start: int, end: int, data: bytes) -> None:
        """Store what a read returned in the cache (when there is one); called by the consumer,
        not on the event loop, so a disk write never holds up the reads in flight."""
        if (cache := self._cached()) is not None:
            import diskcache

            try:
                cache.set((url, start, end), data)
            except (diskcache.Timeout, OSError):  # a busy or full disk: the bytes are read again next time
                pass

    async def _read(self, fs, url: str, start: int, end: int) -> bytes:
        p = self.policy
        for attempt in range(p.attempts):
            try:
                data = await asyncio.wait_for(fs._cat_file(_path(fs, url), start=start, end=end), p.timeout_s)
                if len(data) > end - start:  # a server that ignores Range sends the whole object
                    raise RemoteReadError(f"{redact(url)}: the server ignores HTTP Range requests (sent "
                                          f"{len(data)} bytes for {end - start}); yatt-mm reads by byte range")
                if len(data) < end - start:
                    raise EOFError(f"wanted bytes {start}-{end}, got {len(data)} (the body was cut short)")
                return data
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - classified below; nothing escapes unnamed
                if not isinstance(e, (OSError, EOFError)) and not _from_client_library(e):
                    raise  # a bug, not storage
                if not is_transient(e) or attempt + 1 == p.attempts:
                    raise final_error(e, url, f"reading bytes {start}-{end} of", attempt + 1) from None
                with self._lock:
                    self.retries += 1
                await asyncio.sleep(p.backoff_s * 2 ** attempt * random.uniform(0.75, 1.25))
        raise AssertionError("unreachable")

    def submit(self, url: str, start: int, end: int) -> Future:
        """Start reading bytes [start, end) of `url`; a Future of the bytes (or the OSError),
        done at once when the cache has them. Give the bytes to `keep` once read."""
        if (cache := self._cached()) is not None and (data := cache.get((url, start, end))) is not None:
            with self._lock:
                self.cache_hits += 1
            done: Future = Future()
            done.set_result(data)
            done.from_cache = True
            return done
        fs = filesystem(url)
        return asyncio.run_coroutine_threadsafe(self._read(fs, url, start, end), fs.loop)

    def read(self, url: str, start: int, end: int) -> bytes:
        fut = self.submit(url, start, end)
        data = fut.result()
        if not getattr(fut, "from_cache", False):
            self.keep(url, start, end, data)
        return data


class _Read:
    """One ranged request in flight: bytes [start, end) of `url`, the span of `members` samples."""

    def __init__(self, url: str, start: int, end: int, future: Future, members: int):
        self.url, self.start, self.end, self.future = url, start, end, future
        self.members = self.left = members  # samples it carries, and those not handed out yet

    @property
    def size(self) -> int:
        return self.end - self.start


class ReadAhead:
    """The items a decoder maps over, fetched ahead: `ahead[pos]` is `(todo[pos], payload)` with
    payload `(start, bytes)` of its span, the read's OSError, or None where `span(i)` is None (a
    local shard, or a sample that reads nothing). Positions are asked for in order (decoders
    take the next item), each once.

    At most `window` requests are started ahead of the furthest position asked for. A request
    is merged: with a sample go its neighbours in the shard (adjacent spans, at most HOLE bytes
    apart) that this reader reads within the next `reach` positions, while the bytes of the
    requests whose samples are not all handed out stay within `merge_bytes` (0: one request per
    sample). The shuffle buffer scatters a slice's consecutive samples over a few buffer lengths
    of the order, so one request then brings many samples: a request costs the client and the
    store far more than the bytes it carries. A merged request that fails after its retries
    falls back to one request per sample, so that each sample is read or skipped on its own."""

    HOLE = 256 << 10  # bytes between two samples' spans read anyway to merge them (tar headers, unread members)

    def __init__(self, reads: RemoteReads, todo: list[int], span, window: int, merge_bytes: int = 0,
                 reach: int = 0):
        self.reads, self.todo, self.span, self.window = reads, todo, span, max(1, window)
        self.merge_bytes, self.reach = merge_bytes, reach
        self._pos: dict[int, int] = {}  # index -> position, for the positions within reach ahead
        self._mapped = 0  # positions [0, _mapped) were entered in _pos
        self._planned: dict[int, tuple[_Read, int, int]] = {}  # position -> (its request, its span)
        self._held = 0  # bytes of the requests whose samples are not all handed out yet
        self._next = 0  # the next position to plan
        self._lock = threading.Lock()
        self._closed = False
        with self._lock:
            self._fill(self.window)  # the first reads start before the first decode asks

    def __len__(self) -> int:
        return len(self.todo)

    def __iter__(self):
        for pos in range(len(self.todo)):
            yield self[pos]

    def _fill(self, upto: int) -> None:
        while self._next < min(upto, len(self.todo)) and not self._closed:
            pos, self._next = self._next, self._next + 1
            if self._pos.get(self.todo[pos]) == pos:  # behind the planning now: no longer a neighbour to merge
                del self._pos[self.todo[pos]]
            if pos not in self._planned and (where := self.span(self.todo[pos])) is not None:
                self._start(pos, *where)

    def _start(self, pos: int, url: str, start: int, end: int) -> None:
        members = [(pos, start, end)]
        if self.merge_bytes > 0 and not self.reads.has(url, start, end):
            while self._mapped < min(pos + self.reach + 1, len(self.todo)):  # a window of the order, not all of it
                self._pos[self.todo[self._mapped]] = self._mapped
                self._mapped += 1
            i, lo, hi = self.todo[pos], start, end
            for step in (1, -1):  # the shard's later samples, then its earlier ones
                j = i + step
                while (q := self._pos.get(j)) is not None and pos < q <= pos + self.reach and q not in self._planned:
                    where = self.span(j)
                    if where is None or where[0] != url or self.reads.has(*where):
                        break
                    new_lo, new_hi = min(lo, where[1]), max(hi, where[2])
                    gap = where[1] - hi if step == 1 else lo - where[2]
                    if gap > self.HOLE or self._held + new_hi - new_lo > self.merge_bytes:
                        break
                    members.append((q, where[1], where[2]))
                    lo, hi, j = new_lo, new_hi, j + step
            start, end = lo, hi
        read = _Read(url, start, end, self.reads.submit(url, start, end), len(members))
        self._held += read.size
        for q, s, e in members:
            self._planned[q] = (read, s, e)

    def __getitem__(self, pos: int):
        if not 0 <= pos < len(self.todo):
            raise IndexError(pos)
        with self._lock:
            self._fill(pos + 1 + self.window)
            planned = self._planned.pop(pos, None)
        if planned is None:
            return self.todo[pos], None
        read, start, end = planned
        try:
            data = read.future.result()
            if read.members > 1:  # the sample's own bytes: a process worker gets them pickled
                data = data[start - read.start:end - read.start]
            if self.reads.caching and not getattr(read.future, "from_cache", False):
                self.reads.keep(read.url, start, end, data)
            return self.todo[pos], (start, data)
        except CancelledError:
            return self.todo[pos], RemoteReadError("the read was cancelled (the reader was closed)")
        except OSError as e:
            if read.members == 1:
                return self.todo[pos], e
            try:  # the merged request failed for good: this sample's own request decides
                return self.todo[pos], (start, self.reads.read(read.url, start, end))
            except OSError as e:
                return self.todo[pos], e
        finally:
            with self._lock:
                read.left -= 1
                if read.left == 0:
                    self._held -= read.size

    def close(self) -> None:
        """Cancel the reads still in flight (the stream was closed or the epoch ended)."""
        with self._lock:
            self._closed = True
            for read, _, _ in self._planned.values():
                read.future.cancel()
            self._planned.clear()


# ------------------------------------------------------------------------ metadata and whole objects
def retrying(what: str, url: str, call, policy: RemotePolicy = RemotePolicy()):
    """`call()` with the read policy's retries for transient faults; a final failure as the
    OSError of `final_error` (403 PermissionError, 404 FileNotFoundError)."""
    for attempt in range(policy.attempts):
        try:
            return call()
        except Exception as e:  # noqa: BLE001 - classified below
            if not isinstance(e, (OSError, EOFError)) and not _from_client_library(e):
                raise  # a bug, not storage
            if not is_transient(e) or attempt + 1 == policy.attempts:
                raise final_error(e, url, what, attempt + 1) from None
            time.sleep(policy.backoff_s * 2 ** attempt * random.uniform(0.75, 1.25))
    raise AssertionError("unreachable")


@dataclass(frozen=True)
class Entry:
    url: str
    size: int | None  # None where a listing does not say (an HTTP directory page)
    mtime: float | None  # seconds since the epoch; None where the store does not say


def info(url: str) -> Entry | None:
    """The object at `url` (None when there is none; a "directory" prefix is not an object)."""
    fs = filesystem(url)

    def call():
        try:
            d = fs.info(_path(fs, url))
        except FileNotFoundError:
            return None
        if d.get("type") == "directory":
            return None
        return _entry(fs, url, d)

    return retrying("looking up", url, call)


def _entry(fs, url_like: str, d: dict) -> Entry:
    mtime = d.get("LastModified") or d.get("mtime") or d.get("updated") or d.get("Last-Modified")
    if isinstance(mtime, str):  # GCS: ISO 8601; HTTP: an RFC 1123 date
        from datetime import datetime
        from email.utils import parsedate_to_datetime

        try:
            mtime = datetime.fromisoformat(mtime.replace("Z", "+00:00"))
        except ValueError:
            try:
                mtime = parsedate_to_datetime(mtime)
            except (TypeError, ValueError):
                mtime = None
    if hasattr(mtime, "timestamp"):
        mtime = mtime.timestamp()
    size = d.get("size")
    return Entry(_url(fs, url_like, d["name"]), None if size is None else int(size), mtime)


def listdir(url: str) -> list[Entry]:
    """The objects directly under the prefix `url` (none when there is nothing there)."""
    fs = filesystem(url)

    def call():
        try:
            found = fs.ls(_path(fs, url).rstrip("/"), detail=True)
        except FileNotFoundError:
            return []
        return [_entry(fs, url, d) for d in found if d.get("type") != "directory"]

    return retrying("listing", url, call)


def bucket_missing(url: str) -> bool:
    """Whether the bucket of an s3:// or gs:// URL is not there (False for http(s))."""
    if _protocol(url) not in ("s3", "gcs"):
        return False
    fs = filesystem(url)
    bucket = _path(fs, url).split("/", 1)[0]
    return not retrying("checking the bucket of", url, lambda: fs.exists(bucket))


def endpoint_setting(url: str) -> str:
    """The variable that points this URL's client at another server, as a message shows it:
    `AWS_ENDPOINT_URL=...` for s3://, `STORAGE_EMULATOR_HOST=...` for gs://."""
    name = "STORAGE_EMULATOR_HOST" if _protocol(url) == "gcs" else "AWS_ENDPOINT_URL"
    return f"{name}={redact(os.environ.get(name, '(unset)'))}"


def glob(url: str) -> list[Entry]:
    fs = filesystem(url)
    return retrying("listing", url, lambda: [_entry(fs, url, d) for d in fs.glob(_path(fs, url), detail=True).values()
                                             if d.get("type") != "directory"])


def cat(url: str) -> bytes:
    """A whole (small) object: an index, a journal."""
    fs = filesystem(url)
    return retrying("reading", url, lambda: fs.cat_file(_path(fs, url)))


def get_file(url: str, local: str) -> None:
    """Download the whole object to the local file `local` (the index scan, compressed shards)."""
    fs = filesystem(url)
    retrying("downloading", url, lambda: fs.get_file(_path(fs, url), local))


def put_file(local: str, url: str) -> None:
    """Upload a finished local file to `url`. The object store makes it visible under its name
    only once all of it is stored (one PUT, or s3fs's multipart upload for large files), so a
    reader never sees it half-written."""
    fs = filesystem(url)
    if _protocol(url) in ("http", "https"):
        raise PermissionError(f"{redact(url)}: http(s) storage is read-only; write to s3:// or gs://")
    retrying("uploading to", url, lambda: fs.put_file(local, _path(fs, url)))


def remove(url: str) -> None:
    fs = filesystem(url)

    def call():
        try:
            fs.rm_file(_path(fs, url))
        except FileNotFoundError:
            pass

    retrying("removing", url, call)


# ------------------------------------------------------------------------ URL paths
def join(base: str, *names: str) -> str:
    """`os.path.join` for local paths; for a URL, names appended with `/` (`..` not resolved)."""
    if not is_remote(base):
        return os.path.join(base, *names)
    out = base
    for n in names:
        out = n if is_remote(n) else out.rstrip("/") + "/" + n.lstrip("/")
    return out


def dirname(path: str) -> str:
    if not is_remote(path):
        return os.path.dirname(path)
    head = path.rstrip("/").rsplit("/", 1)[0]
    return head if "://" in head and head.split("://", 1)[1] else path.rstrip("/")


def basename(path: str) -> str:
    return path.rstrip("/").rsplit("/", 1)[-1] if is_remote(path) else os.path.basename(path)


def common_dir(paths: list[str]) -> str:
    """The deepest folder (prefix) holding all of `paths`."""
    if not any(is_remote(p) for p in paths):
        return os.path.commonpath([os.path.dirname(p) for p in paths])
    dirs = [dirname(p).rstrip("/").split("/") for p in paths]
    common = dirs[0]
    for d in dirs[1:]:
        n = 0
        while n < min(len(common), len(d)) and common[n] == d[n]:
            n += 1
        common = common[:n]
    return "/".join(common)


def relative_to(base: str, path: str) -> str | None:
    """`path` relative to the folder `base` when inside it, else None."""
    if not is_remote(path):
        if is_remote(base) or os.path.commonpath([base, path]) != base:
            return None
        return os.path.relpath(path, base)
    prefix = base.rstrip("/") + "/"
    return path[len(prefix):] if path.startswith(prefix) else None
