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

from dataio.shards import COMPRESSED_SUFFIXES, TAR_ERROR_KIND, MemberReader, plain_tar, scan_tar

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


def expand_shards(specs: list[str] | tuple[str, ...]) -> list[str]:
    """Files, directories (their *.tar, and compressed *.tar.gz, *.tgz, *.tar.bz2, *.tar.xz) and
    glob patterns -> sorted, de-duplicated tar paths; a compressed shard becomes its
    decompressed copy in the cache (`dataio.shards.plain_tar`)."""
    out: list[str] = []
    for spec in specs:
        spec = os.path.expanduser(str(spec))
        if os.path.isdir(spec):
            out += sorted(p for suffix in (".tar",) + COMPRESSED_SUFFIXES
                          for p in glob.glob(os.path.join(spec, "*" + suffix)))
        elif any(c in spec for c in "*?["):
            out += sorted(glob.glob(spec))
        elif os.path.exists(spec):
            out.append(spec)
        else:
            raise FileNotFoundError(f"data shards: {spec!r} does not exist (give tar files, a directory or a glob)")
    seen, result = set(), []
    for p in out:
        a = os.path.abspath(plain_tar(p))
        if a not in seen:
            seen.add(a)
            result.append(a)
    if not result:
        raise FileNotFoundError(f"data shards: no .tar (or .tar.gz, .tgz, .tar.bz2, .tar.xz) files found in {list(specs)!r}")
    return result


def check_shard_specs(specs: list[str] | tuple[str, ...], setting: str) -> None:
    """A FileNotFoundError naming `setting` (e.g. data.shards, eval.sets[1].shards) unless every
    spec finds a shard: a file that is there and not empty, a directory holding .tar files (or
    compressed ones), a glob matching a file. Reads no shard and decompresses nothing, so it is
    cheap enough to run before a run starts: a typo fails in a second, not inside a rank after
    the models have loaded."""
    if not specs:
        raise FileNotFoundError(f"{setting} is empty: give tar files, a directory of them or a glob")
    suffixes = (".tar",) + COMPRESSED_SUFFIXES
    for i, spec in enumerate(specs):
        where = f"{setting}[{i}]" if len(specs) > 1 else setting
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
    """A FileNotFoundError naming `setting` unless the parquet index `path` is there."""
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


def build_index(shards: list[str], out: str | None = None, progress: bool = False) -> tuple[pa.Table, str | None]:
    """Scan `shards` (paths as from `expand_shards`) and return the index table; write it to
    `out` when given (shard paths are then stored relative to its directory when inside it)."""
    base = os.path.dirname(os.path.abspath(out)) if out else None
    reader = MemberReader()
    parts = []
    t0 = time.time()
    for i, shard in enumerate(shards):
        rel = shard
        if base and os.path.commonpath([base, shard]) == base:
            rel = os.path.relpath(shard, base)
        cols, err = _build_rows(shard, rel, reader)
        parts.append(pa.table(cols, schema=SCHEMA))
        if progress and (err or (i + 1) % 50 == 0 or i + 1 == len(shards)):
            note = f"  (tar broken part way: {err})" if err else ""
            print(f"index: {i + 1}/{len(shards)} shards, {time.time() - t0:.1f}s{note} {shard}", file=sys.stderr)
    reader.close()
    table = pa.concat_tables(parts) if parts else SCHEMA.empty_table()
    if out:
        tmp = f"{out}.tmp{os.getpid()}"
        pq.write_table(table, tmp)
        os.replace(tmp, out)  # a reader never sees a half-written index
    return table, out


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
            shards.append(os.path.normpath(os.path.join(base_dir, s)) if base_dir and not os.path.isabs(s) else s)
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
    if not os.path.exists(path):
        raise FileNotFoundError(f"data index: {path!r} does not exist; build it with `yatt-mm data index SHARDS...`")
    return index_from_table(pq.read_table(path), base_dir=os.path.dirname(os.path.abspath(path)))


def open_dataset(shards: list[str] | tuple[str, ...] = (), index: str | None = None, progress: bool = False) -> Index:
    """The dataset's index: from `index` when given; else `index.parquet` beside the shards when
    it lists exactly them; else built in memory from the tar headers."""
    if index:
        return load_index(index)
    paths = expand_shards(shards)
    candidate = os.path.join(os.path.commonpath([os.path.dirname(p) for p in paths]), INDEX_NAME)
    if os.path.exists(candidate):
        idx = load_index(candidate)
        if sorted(idx.shards) == sorted(paths) and all(os.path.getmtime(candidate) >= os.path.getmtime(p) for p in paths):
            return idx
    table, _ = build_index(paths, progress=progress)
    return index_from_table(table)
