"""The parquet index of a dataset: one row per tar member (shard, key, byte offset and size,
media kind, width/height/duration/frame count where known), built from tar headers alone.

With it a reader seeks straight to any sample's members, so sample-range splitting and shuffling
need no pass over the data. Samples are groups of consecutive members with the same key, in shard
order then tar order (the grouping plain webdataset uses).
"""

from __future__ import annotations

import glob
import hashlib
import io
import json
import os
import sys
import time
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from dataio import storage
from dataio.shards import COMPRESSED_SUFFIXES, TAR_ERROR_KIND, MemberReader, cache_root, plain_tar, scan_tar

INDEX_NAME = "index.parquet"
SCHEMA = pa.schema(
    [
        ("shard", pa.string()),  # relative to the index file's directory when inside it
        ("key", pa.string()),
        ("ext", pa.string()),
        ("offset", pa.int64()),
        ("size", pa.int64()),
        ("kind", pa.string()),
        ("width", pa.int32()),
        ("height", pa.int32()),
        ("duration", pa.float32()),
        ("frames", pa.int32()),
        ("error", pa.string()),
    ]
)


SHARD_SUFFIXES = (".tar",) + COMPRESSED_SUFFIXES


def _remote_shards(spec: str, setting: str | None = None) -> list[storage.Entry]:
    """The shards a URL spec names: a .tar object, every shard directly under a prefix, or a glob
    (the store's own listing); FileNotFoundError (none there, or no such bucket) and
    PermissionError (403) name the URL without credentials, and `setting` when given."""
    where = f"{setting}: " if setting else "data shards: "
    storage.check_url(spec, setting or "data shards")
    shown = storage.redact(spec)
    try:
        if any(c in spec.split("://", 1)[1] for c in "*?["):
            found = [e for e in storage.glob(spec) if e.size != 0]
            if not found:
                raise FileNotFoundError(f"{where}{shown} matches no object")
            return sorted(found, key=lambda e: e.url)
        if spec.endswith(SHARD_SUFFIXES):
            entry = storage.info(spec)
            if entry is None:
                raise FileNotFoundError(f"{where}{shown} does not exist")
            if entry.size == 0:
                raise FileNotFoundError(f"{where}{shown} is an empty object (0 bytes), not a shard")
            return [entry]
        found = [e for e in storage.listdir(spec) if e.url.endswith(SHARD_SUFFIXES) and e.size != 0]
        if not found and storage.bucket_missing(spec):
            raise FileNotFoundError(f"{where}{shown}: the bucket does not exist (or is not at this endpoint: "
                                    f"{storage.endpoint_setting(spec)})")
        if not found:
            raise FileNotFoundError(f"{where}{shown} holds no shards (.tar, or {', '.join(COMPRESSED_SUFFIXES)} "
                                    "objects), or does not exist; give a prefix of shards, a .tar URL or a glob")
        return sorted(found, key=lambda e: e.url)
    except PermissionError as e:
        raise PermissionError(f"{where}{e}") from None
    except FileNotFoundError as e:
        msg = str(e)
        raise FileNotFoundError(msg if msg.startswith(where) else f"{where}{msg}") from None
    except OSError as e:  # the store cannot be reached, or failed after its retries
        raise OSError(f"{where}{shown}: {e}") from None


def expand_shards(specs: list[str] | tuple[str, ...]) -> list[str]:
    """Files, directories (their *.tar, and compressed *.tar.gz, *.tgz, *.tar.bz2, *.tar.xz) and
    glob patterns -> sorted, de-duplicated tar paths; a compressed shard becomes its
    decompressed copy in the cache (`dataio.shards.plain_tar`). A URL (s3://, gs://, http(s)://)
    is a shard object, a prefix holding shards, or a glob; its shards stay URLs."""
    return _expand(specs)[0]


def _expand(specs) -> tuple[list[str], dict[str, storage.Entry]]:
    """expand_shards, and the listing entries of its remote shards (size, modification time)."""
    out: list[str] = []
    remote: dict[str, storage.Entry] = {}
    for spec in specs:
        if storage.is_remote(str(spec)) or "://" in str(spec):
            for entry in _remote_shards(str(spec)):
                remote[entry.url] = entry
                out.append(entry.url)
            continue
        spec = os.path.expanduser(str(spec))
        if os.path.isdir(spec):
            out += sorted(p for suffix in SHARD_SUFFIXES for p in glob.glob(os.path.join(spec, "*" + suffix)))
        elif any(c in spec for c in "*?["):
            out += sorted(glob.glob(spec))
        elif os.path.exists(spec):
            out.append(spec)
        else:
            raise FileNotFoundError(f"data shards: {spec!r} does not exist (give tar files, a directory or a glob)")
    seen, result = set(), []
    for p in out:
        a = plain_tar(p, remote[p]) if p in remote else os.path.abspath(plain_tar(p))
        if a not in seen:
            seen.add(a)
            result.append(a)
    if not result:
        raise FileNotFoundError(f"data shards: no .tar (or .tar.gz, .tgz, .tar.bz2, .tar.xz) files found in {list(specs)!r}")
    return result, remote


def check_shard_specs(specs: list[str] | tuple[str, ...], setting: str) -> None:
    """A FileNotFoundError naming `setting` (e.g. data.shards, eval.sets[1].shards) unless every
    spec finds a shard: a file that is there and not empty, a directory holding .tar files (or
    compressed ones), a glob matching a file. Reads no shard and decompresses nothing, so it is
    cheap enough to run before a run starts: a typo fails in a second, not inside a rank after
    the models have loaded."""
    if not specs:
        raise FileNotFoundError(f"{setting} is empty: give tar files, a directory of them or a glob")
    suffixes = SHARD_SUFFIXES
    for i, spec in enumerate(specs):
        where = f"{setting}[{i}]" if len(specs) > 1 else setting
        if "://" in str(spec):  # one listing (or lookup) per spec: missing, empty, 403 refused here
            _remote_shards(str(spec), where)
            continue
        path = os.path.expanduser(str(spec))
        if os.path.isdir(path):
            if not any(glob.glob(os.path.join(path, "*" + suffix)) for suffix in suffixes):
                raise FileNotFoundError(f"{where}: the directory {spec} holds no shards (.tar, or "
                                        f"{', '.join(COMPRESSED_SUFFIXES)} files); make them with yatt-mm prep or "
                                        "yatt-mm data synth")
        elif any(c in path for c in "*?["):
            if not any(os.path.isfile(p) for p in glob.glob(path)):
                raise FileNotFoundError(f"{where}: {spec} matches no file")
        elif not os.path.exists(path):
            raise FileNotFoundError(f"{where}: {spec} does not exist (give tar files, a directory of them or a glob)")
        elif os.path.getsize(path) == 0:
            raise FileNotFoundError(f"{where}: {spec} is an empty file (0 bytes), not a shard")


def check_index_path(path: str, setting: str) -> None:
    """A FileNotFoundError naming `setting` unless the parquet index `path` is there (a URL: a
    PermissionError on a 403, naming it without credentials)."""
    if "://" in str(path):
        storage.check_url(path, setting)
        try:
            found = storage.info(path)
        except OSError as e:
            raise type(e)(f"{setting}: {e}") from None
        if found is None:
            raise FileNotFoundError(f"{setting}: {storage.redact(path)} does not exist; build it with `yatt-mm data "
                                    "index SHARDS... --out INDEX` or leave it unset")
        return
    if not os.path.isfile(os.path.expanduser(path)):
        raise FileNotFoundError(f"{setting}: {path} does not exist; build it with `yatt-mm data index SHARDS... "
                                "--out INDEX` or leave it unset (the index is then built from the shards)")


def _image_header_size(data: bytes) -> tuple[int | None, int | None]:
    from PIL import Image

    try:
        with Image.open(io.BytesIO(data)) as im:  # parses the header only
            return im.size
    except Exception:
        return None, None


def _build_rows(shard: str, rel: str, reader: MemberReader) -> tuple[dict, str | None]:
    scan = scan_tar(shard)
    cols: dict[str, list] = {name: [] for name in SCHEMA.names}
    json_meta: dict[str, dict] = {}
    for m in scan.members:  # small JSON members may carry video width/height/frames/duration
        if m.kind == "json" and m.size < 65536:
            try:
                meta = json.loads(reader.read(shard, m.offset, m.size)).get("metadata", {})
                if isinstance(meta, dict):
                    json_meta[m.key] = meta
            except Exception:
                pass  # a bad JSON is the reader's business (skipped and counted there)
    for m in scan.members:
        w = h = frames = dur = None
        if m.kind in ("image", "frame"):
            w, h = _image_header_size(reader.read(shard, m.offset, min(m.size, 65536)))
        elif m.kind == "video":
            meta = json_meta.get(m.key, {})
            w, h, frames, dur = (meta.get(k) for k in ("width", "height", "frames", "duration"))
        for name, v in (("shard", rel), ("key", m.key), ("ext", m.ext), ("offset", m.offset), ("size", m.size),
                        ("kind", m.kind), ("width", w), ("height", h), ("duration", dur), ("frames", frames),
                        ("error", None)):
            cols[name].append(v)
    if scan.error:
        for name, v in (("shard", rel), ("key", ""), ("ext", ""), ("offset", -1), ("size", 0),
                        ("kind", TAR_ERROR_KIND), ("width", None), ("height", None), ("duration", None),
                        ("frames", None), ("error", scan.error)):
            cols[name].append(v)
    return cols, scan.error


def _remote_rows(shard: str, rel: str, reader: MemberReader) -> tuple[dict, str | None]:
    """A remote shard's rows: its headers are spread through it, so the scan reads it whole
    anyway; it is downloaded once to a temporary file and scanned there."""
    os.makedirs(os.path.join(cache_root(), "tmp"), exist_ok=True)
    tmp = os.path.join(cache_root(), "tmp", f"scan-{os.getpid()}-{storage.basename(shard)}")
    try:
        storage.get_file(shard, tmp)
        return _build_rows(tmp, rel, reader)
    finally:
        reader.close()  # the temporary file's descriptor, before it goes
        if os.path.exists(tmp):
            os.unlink(tmp)


def build_index(shards: list[str], out: str | None = None, progress: bool = False) -> tuple[pa.Table, str | None]:
    """Scan `shards` (paths as from `expand_shards`) and return the index table; write it to
    `out` when given (shard paths are then stored relative to its directory when inside it).
    `out` may be a URL: the index is uploaded whole when complete."""
    base = (storage.dirname(out) if storage.is_remote(out) else os.path.dirname(os.path.abspath(out))) if out else None
    reader = MemberReader()
    parts = []
    t0 = time.time()
    for i, shard in enumerate(shards):
        rel = shard
        if base and (inside := storage.relative_to(base, shard)) is not None:
            rel = inside
        cols, err = (_remote_rows if storage.is_remote(shard) else _build_rows)(shard, rel, reader)
        parts.append(pa.table(cols, schema=SCHEMA))
        if progress and (err or (i + 1) % 50 == 0 or i + 1 == len(shards)):
            note = f"  (tar broken part way: {err})" if err else ""
            print(f"index: {i + 1}/{len(shards)} shards, {time.time() - t0:.1f}s{note} {storage.redact(shard)}",
                  file=sys.stderr)
    reader.close()
    table = pa.concat_tables(parts) if parts else SCHEMA.empty_table()
    if out:
        write_table(table, out)
    return table, out


def write_table(table: pa.Table, out: str) -> None:
    """Write a parquet file so that no reader sees it half-written: a local one renamed into
    place, a remote one uploaded whole (an object store shows an object only once complete)."""
    if storage.is_remote(out):
        os.makedirs(os.path.join(cache_root(), "tmp"), exist_ok=True)
        tmp = os.path.join(cache_root(), "tmp", f"{storage.basename(out)}.{os.getpid()}")
        try:
            pq.write_table(table, tmp)
            storage.put_file(tmp, out)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        return
    tmp = f"{out}.tmp{os.getpid()}"
    pq.write_table(table, tmp)
    os.replace(tmp, out)  # a reader never sees a half-written index


@dataclass
class Index:
    """A dataset's samples in global order, held as flat arrays (memory ~ tens of bytes a member).

    Sample i is members member_start[i]:member_end[i]; its shard is shards[sample_shard[i]].
    """

    shards: list[str]
    sample_shard: np.ndarray  # int32
    sample_key: list[str]
    member_start: np.ndarray  # int64
    member_end: np.ndarray
    member_ext: list[str]
    member_kind: list[str]
    member_offset: np.ndarray
    member_size: np.ndarray
    member_error: list[str | None]

    def __len__(self) -> int:
        return len(self.sample_key)

    def members(self, i: int) -> list[tuple[str, str, int, int]]:
        """(ext, kind, offset, size) of sample i's members."""
        s, e = int(self.member_start[i]), int(self.member_end[i])
        return [(self.member_ext[j], self.member_kind[j], int(self.member_offset[j]), int(self.member_size[j]))
                for j in range(s, e)]

    def shard_of(self, i: int) -> str:
        return self.shards[int(self.sample_shard[i])]

    def fingerprint(self) -> str:
        """Identifies the sample list (shard names and keys): a resume state belongs to one."""
        h = hashlib.sha1()
        for s in self.shards:
            h.update(os.path.basename(s).encode() + b"\0")
        h.update(str(len(self)).encode())
        for k in self.sample_key[:: max(1, len(self) // 1000)]:
            h.update(k.encode() + b"\0")
        return h.hexdigest()[:16]


def index_from_table(table: pa.Table, base_dir: str | None = None) -> Index:
    shard_col = table.column("shard").to_pylist()
    keys = table.column("key").to_pylist()
    kinds = table.column("kind").to_pylist()
    shards: list[str] = []
    shard_id: dict[str, int] = {}
    sample_shard, sample_key, starts = [], [], []
    prev = None
    for j, (s, k, kind) in enumerate(zip(shard_col, keys, kinds)):
        if s not in shard_id:
            shard_id[s] = len(shards)
            if not base_dir or os.path.isabs(s) or storage.is_remote(s):
                shards.append(s)
            elif storage.is_remote(base_dir):  # an index in a bucket: its shards beside it
                shards.append(storage.join(base_dir, s))
            else:
                shards.append(os.path.normpath(os.path.join(base_dir, s)))
        cur = (s, k)
        # consecutive members with one key form a sample; a tar error row is a sample of its own
        if cur != prev or kind == TAR_ERROR_KIND:
            sample_shard.append(shard_id[s])
            sample_key.append(k)
            starts.append(j)
        prev = cur if kind != TAR_ERROR_KIND else None
    n = table.num_rows
    start = np.asarray(starts, dtype=np.int64)
    end = np.append(start[1:], n).astype(np.int64)
    return Index(
        shards=shards,
        sample_shard=np.asarray(sample_shard, dtype=np.int32),
        sample_key=sample_key,
        member_start=start,
        member_end=end,
        member_ext=table.column("ext").to_pylist(),
        member_kind=kinds,
        member_offset=table.column("offset").to_numpy().astype(np.int64),
        member_size=table.column("size").to_numpy().astype(np.int64),
        member_error=table.column("error").to_pylist(),
    )


def load_index(path: str) -> Index:
    if storage.is_remote(path):
        storage.check_url(path, "data index")
        if storage.info(path) is None:
            raise FileNotFoundError(f"data index: {storage.redact(path)} does not exist; build it with "
                                    "`yatt-mm data index SHARDS...`")
        table = pq.read_table(pa.BufferReader(storage.cat(path)))
        return index_from_table(table, base_dir=storage.dirname(path))
    if not os.path.exists(path):
        raise FileNotFoundError(f"data index: {path!r} does not exist; build it with `yatt-mm data index SHARDS...`")
    return index_from_table(pq.read_table(path), base_dir=os.path.dirname(os.path.abspath(path)))


def open_dataset(shards: list[str] | tuple[str, ...] = (), index: str | None = None, progress: bool = False) -> Index:
    """The dataset's index: from `index` when given; else `index.parquet` beside the shards when
    it lists exactly them; else built in memory from the tar headers."""
    if index:
        return load_index(index)
    paths, listed = _expand(shards)
    candidate = storage.join(storage.common_dir(paths), INDEX_NAME)
    if storage.is_remote(candidate):
        if (idx := _remote_index_beside(candidate, paths, listed)) is not None:
            return idx
    elif os.path.exists(candidate):
        idx = load_index(candidate)
        if sorted(idx.shards) == sorted(paths) and all(os.path.getmtime(candidate) >= os.path.getmtime(p) for p in paths):
            return idx
    table, _ = build_index(paths, progress=progress)
    return index_from_table(table)


def _remote_index_beside(candidate: str, paths: list[str], listed: dict[str, storage.Entry]) -> Index | None:
    """The index beside remote shards when it lists exactly them and is not older than any
    (their listing's modification times; a store that gives none: listing them is enough)."""
    entry = storage.info(candidate)
    if entry is None:
        return None
    idx = index_from_table(pq.read_table(pa.BufferReader(storage.cat(candidate))), base_dir=storage.dirname(candidate))
    if sorted(idx.shards) != sorted(paths):
        return None
    times = [listed[p].mtime for p in paths if p in listed]
    return idx if entry.mtime is None or all(t is None or entry.mtime >= t for t in times) else None
