"""Tar shards written where readers cannot see them half done: `shard-000007.tar.tmp`, then
fsync and rename to `shard-000007.tar` (readers and `dataio.index.expand_shards` look for
`*.tar` only). Tar headers are fixed (mtime 0, uid/gid 0, mode 0644, USTAR), so the same
samples give the same bytes."""

from __future__ import annotations

import os
import tarfile

from dataio.synth import tar_add

SHARD_PATTERN = "shard-{:06d}.tar"
TMP_SUFFIX = ".tmp"


def shard_name(n: int) -> str:
    return SHARD_PATTERN.format(n)


class ShardWriter:
    """Appends samples to the current shard; `need_new(size)` says whether the next sample would
    make it exceed the target size (a shard always takes at least one sample)."""

    def __init__(self, out: str, number: int, target_bytes: int, max_samples: int):
        self.out, self.number = out, number
        self.target_bytes, self.max_samples = target_bytes, max_samples
        self.path = os.path.join(out, shard_name(number))
        self.tmp = self.path + TMP_SUFFIX
        self._tf = tarfile.open(self.tmp, "w", format=tarfile.USTAR_FORMAT)
        self.bytes = 0
        self.samples = 0

    @staticmethod
    def sample_bytes(members: list[tuple[str, bytes]]) -> int:
        return sum(512 + (len(d) + 511) // 512 * 512 for _, d in members)

    def fits(self, members: list[tuple[str, bytes]]) -> bool:
        if self.samples == 0:
            return True
        return self.samples < self.max_samples and self.bytes + self.sample_bytes(members) <= self.target_bytes

    def add(self, members: list[tuple[str, bytes]]) -> None:
        for name, data in members:
            tar_add(self._tf, name, data)
        self.bytes += self.sample_bytes(members)
        self.samples += 1

    def commit(self) -> str:
        """Finish the tar, flush it to disk, and make it visible under its final name."""
        self._tf.close()
        with open(self.tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(self.tmp, self.path)
        _fsync_dir(self.out)
        return self.path

    def abort(self) -> None:
        try:
            self._tf.close()
        finally:
            if os.path.exists(self.tmp):
                os.unlink(self.tmp)


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def remove_temp_shards(out: str) -> list[str]:
    """Leftovers of an interrupted run (the shard that was in flight)."""
    gone = []
    for name in sorted(os.listdir(out)):
        if name.startswith("shard-") and name.endswith(".tar" + TMP_SUFFIX):
            os.unlink(os.path.join(out, name))
            gone.append(name)
    return gone
