"""Where a prep run's outputs go: a local folder (`--out DIR`), or a prefix in object storage
(`--out s3://bucket/prefix`, `gs://...`; http(s) is read-only).

For a URL, the run works in a local staging folder ($YATT_MM_CACHE/prep-out/KEY, KEY from the
URL) exactly as it would in a local --out, and publishes each finished piece through
`dataio.storage`: a shard is uploaded once it is complete (a PUT, or a multipart upload for a
large one: the store shows the object under its name only when all of it is stored, so a reader
never sees it half-written), then its local copy is deleted, so the staging folder holds one
shard at a time. The resume state (`.prep/run.json`, `.prep/journal.jsonl`) is uploaded after
each change and, with one small index part per shard (`.prep/index/`), is what a rerun, on this
machine or another, resumes from: the bucket, not the staging folder, is the truth.
"""

from __future__ import annotations

import hashlib
import os

import pyarrow as pa
import pyarrow.parquet as pq

from dataio import storage
from dataio.shards import cache_root

STATE_DIR = ".prep"
STATE_FILES = ("run.json", "journal.jsonl")


class Destination:
    """`out` as given; `local`: the folder the run writes into (`out` itself when local)."""

    def __init__(self, out: str):
        self.out = out
        self.remote = storage.is_remote(out)
        if self.remote:
            storage.check_url(out, "--out")
            key = hashlib.sha1(storage.redact(out).rstrip("/").encode()).hexdigest()[:16]
            self.local = os.path.join(cache_root(), "prep-out", key)
        else:
            self.local = out

    def shown(self, name: str = "") -> str:
        """`out` (or a file in it) as messages name it: without credentials."""
        return storage.redact(storage.join(self.out, name)) if name else storage.redact(self.out)

    def check_writable(self) -> None:
        """Refuse, before any work, a destination prep cannot write: read-only http(s), a 403
        (the listing's PermissionError names the URL), a missing bucket."""
        if not self.remote:
            return
        if self.out.split("://", 1)[0].lower() in ("http", "https"):
            raise ValueError(f"--out {self.shown()}: http(s) storage is read-only; write to s3:// or gs://")
        try:
            self.names()
        except PermissionError as e:
            raise PermissionError(f"--out {e}") from None
        if storage.bucket_missing(self.out):
            raise ValueError(f"--out {self.shown()}: the bucket does not exist (or is not at this endpoint: "
                             f"{storage.endpoint_setting(self.out)})")

    # ------------------------------------------------------------------ what the destination holds
    def names(self) -> list[str]:
        """The files (objects) directly in `out`."""
        if not self.remote:
            return sorted(os.listdir(self.out))
        return sorted(storage.basename(e.url) for e in storage.listdir(self.out))

    def remove(self, name: str) -> None:
        if self.remote:
            storage.remove(storage.join(self.out, name))
        path = os.path.join(self.local, name)
        if os.path.exists(path):
            os.unlink(path)

    # ------------------------------------------------------------------ publishing
    def publish(self, name: str) -> None:
        """A finished file of the staging folder (failures.parquet, stats.json) -> `out`."""
        if self.remote:
            storage.put_file(os.path.join(self.local, name), storage.join(self.out, name))

    def publish_shard(self, path: str) -> None:
        """A committed shard -> `out`, with its index part; the local copy then goes."""
        if not self.remote:
            return
        from dataio.index import build_index

        name = os.path.basename(path)
        table, _ = build_index([path])  # its rows, named as the final index names it
        table = table.set_column(table.schema.get_field_index("shard"), "shard", pa.array([name] * table.num_rows))
        part = os.path.join(self.local, STATE_DIR, "index", name + ".parquet")
        os.makedirs(os.path.dirname(part), exist_ok=True)
        pq.write_table(table, part)
        storage.put_file(path, storage.join(self.out, name))
        storage.put_file(part, storage.join(self.out, STATE_DIR, "index", name + ".parquet"))
        os.unlink(path)

    def publish_state(self, name: str) -> None:
        if self.remote:
            storage.put_file(os.path.join(self.local, STATE_DIR, name), storage.join(self.out, STATE_DIR, name))

    def fetch_state(self) -> None:
        """The resume state of `out` -> the staging folder (and a stale local one dropped)."""
        if not self.remote:
            return
        state = os.path.join(self.local, STATE_DIR)
        os.makedirs(state, exist_ok=True)
        for name in STATE_FILES:
            local, url = os.path.join(state, name), storage.join(self.out, STATE_DIR, name)
            if storage.info(url) is not None:
                storage.get_file(url, local)
            elif os.path.exists(local):
                os.unlink(local)
        for name in os.listdir(self.local):  # a shard committed here but not uploaded: redone
            if name.startswith("shard-"):
                os.unlink(os.path.join(self.local, name))

    def clear_state(self) -> None:
        if self.remote:
            for e in storage.listdir(storage.join(self.out, STATE_DIR, "index")):
                storage.remove(e.url)
            for name in STATE_FILES:
                storage.remove(storage.join(self.out, STATE_DIR, name))

    def index_table(self, shards: list[str]) -> pa.Table:
        """The index of a remote `out`: its shards' parts, in order (the rows `build_index` over
        the shards gives, without reading a shard back)."""
        parts = []
        for name in shards:
            part = os.path.join(self.local, STATE_DIR, "index", name + ".parquet")
            if not os.path.exists(part):  # written by a run on another machine
                os.makedirs(os.path.dirname(part), exist_ok=True)
                storage.get_file(storage.join(self.out, STATE_DIR, "index", name + ".parquet"), part)
            parts.append(pq.read_table(part))
        return pa.concat_tables(parts)
