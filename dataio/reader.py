"""The per-DP-rank sample stream: the rank's order (`dataio.split`), members read by offset
(`dataio.shards`), decoded in parallel (`dataio.decode`) on torchdata.nodes, bad samples
skipped, counted and quarantined, position saved and restored exactly.

    reader = DataReader(DataConfig(shards=["data/"]), dp_rank=r, dp_size=w)
    for sample in reader:          # endless: epoch after epoch
        ...
    state = reader.state_dict()    # JSON-able; load_state_dict(state) on a new reader resumes

Order: the rank's list of samples for an epoch is fixed by (seed, epoch, dp_rank, dp_size)
alone. `workers` decode threads/processes take the next keys from that list and a mapper that
keeps order puts the results back in list order, so the stream is the same for any number of
workers; which worker decodes which key is whichever is free (it does not matter). The state is
(epoch, position = entries of the list consumed, including skipped ones): a restart with another
worker count continues at the next entry, and nothing decoded is ever pickled or saved.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Iterator, Literal

import numpy as np

from dataio.budget import TokenBudget
from dataio.decode import EndsWithItsParent, MediaConfig, VideoDecodePool, decode_frame_sequence, decode_image, \
    decode_video_bytes, VIDEO_DECODER
from dataio.errors import MediaError
from dataio.index import Index, check_index_path, check_shard_specs, open_dataset
from dataio.shards import TAR_ERROR_KIND, MemberReader
from dataio.storage import ReadAhead, RemotePolicy, RemoteReads, check_url, is_remote
from dataio.resplit import decode_indices
from dataio.split import check_split, rank_order
from dataio.workers import ordered_thread_map, shutdown_nodes

STATE_VERSION = 1


def check_metric_name(name: str, what: str) -> None:
    """ValueError unless `name` can name metrics (data/<name>/..., eval/<name>/...)."""
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", name or ""):
        raise ValueError(f"{what} needs a name of letters, digits, '_', '.' or '-' (it names its metrics), "
                         f"got {name!r}")


@dataclass
class BlendSource:
    """One dataset of a blend (`data.blend`, dataio/blend.py): its shards and its share."""

    name: str = ""  # names its metrics (data/<name>/...), lineage lines and quarantined samples
    shards: list[str] = field(default_factory=list)  # tar files, directories or globs
    index: str | None = None  # parquet index; default: index.parquet beside the shards, else built
    weight: float = 1.0  # its share of the draws: weight / the sum of the blend's weights

    RANGES = {"weight": "> 0"}

    def validate(self) -> None:
        check_metric_name(self.name, "a blend source")
        for spec in [*self.shards, *([self.index] if self.index else [])]:
            check_url(str(spec), f"data.blend[{self.name}]")
        if not self.shards and not self.index:
            raise ValueError(f"blend source {self.name!r}: give its shards (or an index)")
        if not self.weight > 0:
            raise ValueError(f"blend source {self.name!r}: weight must be > 0, got {self.weight}")


@dataclass
class DataConfig:
    shards: list[str] = field(default_factory=list)  # tar files, directories or globs
    index: str | None = None  # parquet index; default: index.parquet beside the shards, else built
    # several datasets drawn in fixed shares instead of `shards` (dataio/blend.py): a list of
    # {name, shards, weight}; every other data setting applies to each of them
    blend: list[BlendSource] = field(default_factory=list)
    seed: int = 0  # seeds the slice shuffle and per-rank shuffle buffer (with epoch, dp_rank)
    shuffle: bool = True  # false: every rank reads its range in index order (no slice or buffer shuffle)
    slice_size: int = 64  # consecutive samples kept together when shuffling the global order
    shuffle_buffer: int = 256  # per-rank shuffle buffer (sample indices, not decoded samples)
    workers: int = 2  # parallel decoders; 0 decodes in the calling thread
    worker_kind: Literal["thread", "process"] = "thread"  # thread: `ordered_thread_map`; process: torchdata ParallelMapper
    # Samples decoded ahead of the consumer: at most 2 * workers + prefetch in flight (threads);
    # for process workers prefetch > 0 adds a torchdata Prefetcher stage.
    prefetch: int = 0
    media: MediaConfig = field(default_factory=MediaConfig)  # image/video decoding and Qwen2-VL resizing
    video_isolation: Literal["process", "none"] = "process"  # process: decord runs in killable children; none: in the worker
    decode_timeout_s: float = 60.0  # per video, when video_isolation == "process"
    video_decoder: str = VIDEO_DECODER  # module:function run in the video children
    quarantine_log: str | None = None  # JSONL file: one line per bad sample per run (key, shard, reason; docs/data.md)
    max_open_shards: int = 16  # shard files kept open per decoder (least recently used closed); >= 1
    # tokens per sample (prompt + media + the response limit): a video sample over it gets fewer
    # frames (uniform over the clip) so that it fits; one that cannot (or an image sample over
    # it) is skipped as over_token_budget (dataio/budget.py). 0: off
    max_sample_tokens: int = 0
    # ranged reads of shards at s3://, gs:// or http(s):// URLs in flight ahead of the decoders, per
    # reader (local shards ignore this and the next three; docs/data.md, "Shards in object storage")
    read_ahead: int = 16
    # a ranged read also brings the sample's neighbours in its shard that this reader reads soon
    # (within slice_size + 4 * shuffle_buffer samples) while the bytes read and not yet handed to
    # the decoders stay within this many MB per reader; 0: one ranged read per sample
    read_merge_mb: float = 64.0
    read_timeout_s: float = 30.0  # one attempt at one ranged read of a remote shard
    read_attempts: int = 5  # tries of a remote read (timeouts, 5xx, resets) before its sample is skipped
    # a local folder keeping remote samples' bytes for later epochs (shared by a node's readers); "": none
    read_cache_dir: str = ""
    read_cache_gb: float = 8.0  # the size limit of read_cache_dir: least recently used entries go first

    # allowed values, checked when yatt-mm loads a config (yatt_mm/config.py); validate() checks
    # them again for a DataReader built without that loader
    RANGES = {"seed": ">= 0", "slice_size": ">= 1", "shuffle_buffer": ">= 1", "workers": ">= 0", "prefetch": ">= 0",
              "decode_timeout_s": "> 0", "max_open_shards": ">= 1", "max_sample_tokens": ">= 0",
              "read_ahead": ">= 1", "read_merge_mb": ">= 0", "read_timeout_s": "> 0", "read_attempts": ">= 1", "read_cache_gb": "> 0"}

    def validate(self) -> None:
        if self.worker_kind not in ("thread", "process"):
            raise ValueError(f"data.worker_kind must be 'thread' or 'process', got {self.worker_kind!r}")
        if self.video_isolation not in ("process", "none"):
            raise ValueError(f"data.video_isolation must be 'process' or 'none', got {self.video_isolation!r}")
        for name in ("workers", "prefetch"):
            if getattr(self, name) < 0:
                raise ValueError(f"data.{name} must be >= 0, got {getattr(self, name)}")
        for name in ("slice_size", "shuffle_buffer", "max_open_shards", "read_ahead", "read_attempts"):
            if getattr(self, name) < 1:
                raise ValueError(f"data.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("max_sample_tokens", "read_merge_mb"):
            if getattr(self, name) < 0:
                raise ValueError(f"data.{name} must be >= 0, got {getattr(self, name)}")
        for name in ("decode_timeout_s", "read_timeout_s", "read_cache_gb"):
            if getattr(self, name) <= 0:
                raise ValueError(f"data.{name} must be > 0, got {getattr(self, name)}")
        for i, spec in enumerate(self.shards):  # credentials in a URL would be saved with the config
            check_url(str(spec), f"data.shards[{i}]")
        if self.index:
            check_url(str(self.index), "data.index")
        if self.blend:
            if self.shards or self.index:
                raise ValueError("data.blend lists the datasets to draw from; data.shards and data.index must then "
                                 f"be empty, got shards={self.shards!r} index={self.index!r}")
            for source in self.blend:
                source.validate()
            names = [s.name for s in self.blend]
            if len(set(names)) != len(names):
                raise ValueError(f"data.blend: source names must differ, got {names}")
        elif not self.shards and not self.index:
            raise ValueError("data.shards is empty and data.index is not set: give shard paths or an index")
        self.media.validate()

    def check_inputs(self, prefix: str = "data") -> None:
        """FileNotFoundError naming the setting unless every dataset's shards (or index) are
        there (`dataio.index.check_shard_specs`): what a launcher checks before any rank starts."""
        if self.index:
            check_index_path(self.index, f"{prefix}.index")
        elif self.shards:
            check_shard_specs(self.shards, f"{prefix}.shards")
        for i, source in enumerate(self.blend):
            if source.index:
                check_index_path(source.index, f"{prefix}.blend[{i}].index")
            else:
                check_shard_specs(source.shards, f"{prefix}.blend[{i}].shards")

    def remote_policy(self) -> RemotePolicy:
        return RemotePolicy(timeout_s=self.read_timeout_s, attempts=self.read_attempts, window=self.read_ahead,
                            cache_dir=os.path.expanduser(self.read_cache_dir) if self.read_cache_dir else "",
                            cache_bytes=int(self.read_cache_gb * 2**30))

    def all_shards(self) -> list[str]:
        """The shards of every dataset it reads (a blend's, in its order)."""
        return list(self.shards) + [p for s in self.blend for p in s.shards]


@dataclass
class Sample:
    key: str
    shard: str
    index: int  # position in the dataset's global sample list
    prompt: str | None
    answer: str | None
    metadata: dict[str, Any]
    images: list  # PIL RGB images at their Qwen2-VL size
    videos: list  # uint8 numpy arrays [T, H, W, 3] at their Qwen2-VL size
    ignored: list[str] = field(default_factory=list)  # extensions of members not decoded (never unpickled)
    frames_dropped: int = 0  # video frames left out to fit data.max_sample_tokens
    epoch: int = 0  # the reader's epoch it was read in
    source: str = ""  # the blend's source it came from (data.blend); "" outside a blend


@dataclass
class Skip:
    key: str
    shard: str
    index: int
    reason: str
    detail: str = ""


def _parse_json(data: bytes) -> dict:
    try:
        obj = json.loads(data.decode("utf-8"))
    except Exception as e:
        raise MediaError("corrupt_json", f"{type(e).__name__}: {e}"[:200]) from None
    if not isinstance(obj, dict):
        raise MediaError("corrupt_json", f"top level is {type(obj).__name__}, not an object")
    return obj


class SampleDecoder:
    """Global sample index -> Sample or Skip. Picklable (for process workers): each process
    opens its own files and its own video children."""

    def __init__(self, index: Index, cfg: DataConfig, budget: TokenBudget | None = None):
        self.index = index
        self.cfg = cfg
        self.budget = budget
        self.media = cfg.media
        self.files = MemberReader(cfg.max_open_shards)
        self.remote = RemoteReads(cfg.remote_policy())  # shards at URLs; counts its retries
        self._pool: VideoDecodePool | None = None
        self._pool_pid = None

    def __getstate__(self):
        return {"index": self.index, "cfg": self.cfg, "budget": self.budget}

    def __setstate__(self, state):
        self.__init__(state["index"], state["cfg"], state.get("budget"))

    def _video(self, data: bytes, window, expected) -> np.ndarray:
        if self.cfg.video_isolation == "none":
            return decode_video_bytes(data, self.media, window, expected)
        if self._pool is None or self._pool_pid != os.getpid():
            self._pool = VideoDecodePool(max(1, self.cfg.workers) if self.cfg.worker_kind == "thread" else 1,
                                         self.cfg.decode_timeout_s, self.cfg.video_decoder)
            self._pool_pid = os.getpid()
        return self._pool.decode(data, self.media, window, expected)

    def close(self) -> None:
        if self._pool is not None and self._pool_pid == os.getpid():
            self._pool.close()
            self._pool = None
        self.files.close()

    def span(self, i: int) -> tuple[str, int, int] | None:
        """(url, start, end) of the bytes sample i's readable members take in a remote shard: one
        ranged read for the whole sample (the tar headers between its members included); None
        for a local shard or a sample that reads nothing (a tar error, no media)."""
        shard = self.index.shard_of(i)
        if not is_remote(shard):
            return None
        members = self.index.members(i)
        kinds = {k for _, k, _, _ in members}
        if TAR_ERROR_KIND in kinds or "truncated" in kinds or not kinds & {"image", "video", "frame"}:
            return None
        read = [(off, size) for _, k, off, size in members if k != "unknown"]
        return shard, min(off for off, _ in read), max(off + size for off, size in read)

    def __call__(self, item: int | tuple) -> Sample | Skip:
        """`item`: a sample index, or (index, what `ReadAhead` fetched for it)."""
        i, fetched = item if isinstance(item, tuple) else (item, None)
        idx = self.index
        shard, key = idx.shard_of(i), idx.sample_key[i]
        try:
            return self._decode(i, shard, key, fetched)
        except MediaError as e:
            return Skip(key, shard, i, e.reason, e.detail)
        except Exception as e:  # never let one sample end the stream
            return Skip(key, shard, i, "decode_error", f"{type(e).__name__}: {e}"[:300])

    def _decode(self, i: int, shard: str, key: str, fetched=None) -> Sample:
        members = self.index.members(i)
        kinds = [k for _, k, _, _ in members]
        if TAR_ERROR_KIND in kinds:
            j = int(self.index.member_start[i])
            raise MediaError("corrupt_tar", self.index.member_error[j] or "")
        if "truncated" in kinds:
            raise MediaError("truncated_tar", "a member's data runs past the end of the shard")
        # members of extensions we do not decode (features, a tool's own files, pickles) are
        # left unread and counted; the sample is what the known ones make of it
        ignored = [ext.rsplit(".", 1)[-1] for ext, k, _, _ in members if k == "unknown"]
        media = [m for m in members if m[1] in ("image", "video", "frame")]
        if not media:
            raise MediaError("missing_media", "no image, video or frame member")

        def read(offset: int, size: int) -> bytes:
            if isinstance(fetched, tuple):  # the sample's span, read ahead in one request
                start, data = fetched
                return data[offset - start:offset - start + size]
            try:
                if isinstance(fetched, OSError):
                    raise fetched
                if is_remote(shard):  # not read ahead (a decoder called on its own): member by member
                    return self.remote.read(shard, offset, offset + size)
                return self.files.read(shard, offset, size)
            except OSError as e:
                if is_remote(shard):  # after its retries, or a 403/404: final for this sample
                    raise MediaError("remote_read_error", f"{type(e).__name__}: {e}"[:300]) from None
                raise MediaError("read_error", f"{type(e).__name__}: {e}"[:200]) from None
            except EOFError as e:
                raise MediaError("read_error", f"{type(e).__name__}: {e}"[:200]) from None

        meta: dict[str, Any] = {}
        prompt = answer = None
        for ext, kind, off, size in members:
            if kind == "json":
                obj = _parse_json(read(off, size))
                prompt = obj.get("prompt", obj.get("question", prompt))
                answer = obj.get("answer", answer)
                m = obj.get("metadata", {})
                meta.update(m if isinstance(m, dict) else {"metadata": m})
                meta.update({k: v for k, v in obj.items() if k not in ("prompt", "question", "answer", "metadata")})
            elif kind in ("txt", "cls"):
                try:
                    text = read(off, size).decode("utf-8").strip()
                except UnicodeDecodeError as e:
                    raise MediaError("corrupt_text", str(e)[:200]) from None
                if kind == "txt" and prompt is None:
                    prompt = text
                elif kind == "cls" and answer is None:
                    answer = text
        window = (meta.get("start_s"), meta.get("end_s"))
        images, videos = [], []
        for ext, kind, off, size in media:
            if kind == "image":
                images.append(decode_image(read(off, size), self.media))
            elif kind == "video":
                videos.append(self._video(read(off, size), window, meta.get("frames")))
        frames = sorted((ext, off, size) for ext, kind, off, size in media if kind == "frame")
        if frames:
            datas = [read(off, size) for _, off, size in frames]
            videos.append(decode_frame_sequence(datas, self.media, meta.get("fps"), window))
        prompt = None if prompt is None else str(prompt)
        dropped = 0
        if self.budget is not None:  # fewer frames to fit, or MediaError("over_token_budget"): skipped
            videos, dropped = self.budget.fit(prompt, images, videos)
        return Sample(key, shard, i, prompt, None if answer is None else str(answer), meta, images, videos, ignored,
                      dropped)


class DataReader:
    """One DP rank's endless, resumable stream of decoded samples."""

    def __init__(self, cfg: DataConfig, dp_rank: int = 0, dp_size: int = 1, index: Index | None = None,
                 budget: TokenBudget | None = None, source: str = ""):
        """`budget`: how data.max_sample_tokens counts (the model's media sizes, the response
        limit, the tokenizer); by default from `cfg` alone (data.media.factor, 2 frames a
        temporal group, no response, the prompt's bytes). `source`: the blend's name for this
        dataset (dataio/blend.py), stamped on its samples and quarantine lines."""
        cfg.validate()
        if cfg.blend:
            raise ValueError("data.blend is set: read it with dataio.blend.open_reader (a BlendedReader)")
        check_split(dp_rank, dp_size)
        self.cfg = cfg
        self.source = source
        self._where = f"data.blend[{source}]: " if source else ""  # names a blend's source in errors
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.index = index if index is not None else open_dataset(cfg.shards, cfg.index)
        if len(self.index) == 0:
            raise ValueError(f"{self._where or 'data.shards: '}the dataset {cfg.shards or cfg.index!r} has no samples")
        if budget is None and cfg.max_sample_tokens:
            budget = TokenBudget(cfg.max_sample_tokens, factor=cfg.media.side)
        self.budget = budget
        self.decoder = SampleDecoder(self.index, cfg, budget)
        self.epoch = 0
        self.position = 0  # entries of this epoch's rank order consumed (samples and skips)
        # after a resume at another DP size: the rest of each unfinished epoch, re-split
        # (dataio/resplit.py), read before the normal epochs; each {"epoch", "todo"}
        self.pending: list[dict] = []
        self.skips: Counter[str] = Counter()
        self.ignored_members: Counter[str] = Counter()  # by extension, in samples that were decoded
        self.samples_yielded = 0
        self.budget_fitted = 0  # samples given fewer video frames to fit data.max_sample_tokens
        self.frames_dropped = 0  # the frames they left out
        self.remote_retries_before = 0  # ranged reads retried by earlier runs (restored state)
        self._order_cache: tuple[int, np.ndarray] | None = None
        self._quarantined: set[tuple[str, str]] | None = None  # (shard, key) with a line in the log; read lazily
        self._log_needs_newline = False  # the log ends in a line a kill cut short
        self._first_epoch: np.ndarray | None = None  # sorted indices this rank reads in epoch 0 (its own samples)

    # ---------------------------------------------------------------- order
    def order(self, epoch: int | None = None) -> np.ndarray:
        """Global sample indices this rank reads in `epoch`, in order (a pending segment's while
        the reader is in one)."""
        epoch = self.epoch if epoch is None else epoch
        segment = next((s for s in self.pending if s["epoch"] == epoch), None)
        tag = (epoch, segment["todo"] if segment else None)
        if self._order_cache is None or self._order_cache[0] != tag:
            c = self.cfg
            order = decode_indices(segment["todo"]) if segment else rank_order(
                len(self.index), self.dp_rank, self.dp_size, c.seed, epoch, c.slice_size, c.shuffle_buffer, c.shuffle)
            self._order_cache = (tag, order)
        return self._order_cache[1]

    def keys(self, epoch: int | None = None) -> list[str]:
        return [self.index.sample_key[i] for i in self.order(epoch).tolist()]

    @property
    def remote_retries(self) -> int:
        """Ranged reads of remote shards retried (timeouts, 5xx, resets), this run and before."""
        return self.remote_retries_before + self.decoder.remote.retries

    # ---------------------------------------------------------------- iteration
    def _results(self, todo: list[int]) -> Iterator[Sample | Skip]:
        if not any(is_remote(s) for s in self.index.shards):
            yield from self._decoded(todo)  # local shards: the decoders pread them, as ever
            return
        # remote shards: each sample's bytes in one ranged request (merged with its neighbours'),
        # a window of them in flight ahead of the decoders, which get (index, bytes) instead of an index
        c = self.cfg
        ahead = ReadAhead(self.decoder.remote, todo, self.decoder.span, c.read_ahead,
                          merge_bytes=int(c.read_merge_mb * 2**20), reach=c.slice_size + 4 * c.shuffle_buffer)
        try:
            yield from self._decoded(ahead)
        finally:
            ahead.close()

    def _decoded(self, todo) -> Iterator[Sample | Skip]:
        c = self.cfg
        if c.workers == 0:
            for item in todo:
                yield self.decoder(item)
            return
        if c.worker_kind == "thread":
            yield from ordered_thread_map(self.decoder, todo, c.workers, 2 * c.workers + c.prefetch,
                                          join_timeout_s=c.decode_timeout_s + 10)
            return
        from torchdata.nodes import IterableWrapper, Loader, ParallelMapper, Prefetcher

        node = ParallelMapper(IterableWrapper(todo), map_fn=EndsWithItsParent(self.decoder), num_workers=c.workers,
                              in_order=True, method=c.worker_kind)  # workers end with this process, however it ends
        if c.prefetch:
            node = Prefetcher(node, prefetch_factor=c.prefetch)
        loader = Loader(node)
        it = iter(loader)
        try:
            yield from it
        finally:
            shutdown_nodes(node)  # stop the worker threads/processes now, not at garbage collection

    def iter_epoch(self) -> Iterator[Sample]:
        """The rest of the current epoch; at its end the reader moves to the next epoch."""
        order = self.order()
        todo = order[self.position:].tolist()
        epoch = self.epoch
        for res in self._results(todo):
            if self.epoch != epoch:  # load_state_dict() was called mid-iteration
                return
            self.position += 1
            if isinstance(res, Skip):
                self._record_skip(res)
                continue
            self.samples_yielded += 1
            res.epoch, res.source = epoch, self.source
            self.ignored_members.update(res.ignored)
            if res.frames_dropped:
                self.budget_fitted += 1
                self.frames_dropped += res.frames_dropped
            yield res
        if self.epoch == epoch and self.position >= len(order):
            if self.pending:  # a re-split epoch ends: the next one, or a normal epoch after the last
                self.pending.pop(0)
            self.epoch = self.pending[0]["epoch"] if self.pending else epoch + 1
            self.position = 0

    def __iter__(self) -> Iterator[Sample]:
        """Endless: epoch after epoch. Raises if a whole epoch yields nothing (all skipped or
        this rank has no samples), rather than spinning forever."""
        while True:
            # a resumed reader may start at the epoch's very end, or in a short re-split remainder
            got, whole_epoch = False, self.position == 0 and not self.pending
            for s in self.iter_epoch():
                got = True
                yield s
            if not got and whole_epoch:
                raise RuntimeError(
                    f"{self._where or 'data: '}rank {self.dp_rank}/{self.dp_size} got no usable sample in epoch {self.epoch - 1} "
                    f"({len(self.order(self.epoch - 1))} in its range, skips {dict(self.skips)}); "
                    "see data.quarantine_log")

    def _record_skip(self, s: Skip) -> None:
        self.skips[s.reason] += 1
        self._quarantine(s.key, s.shard, s.index, s.reason, s.detail, self.epoch)

    def quarantine(self, sample: Sample, reason: str, detail: str = "") -> None:
        """Log a sample its consumer cannot use (RL: no question or no answer) as the reader logs
        its own skips; the consumer counts it."""
        self._quarantine(sample.key, sample.shard, sample.index, reason, detail, sample.epoch)

    def _quarantine(self, key: str, shard: str, index: int, reason: str, detail: str, epoch: int) -> None:
        """One line per bad sample per run, however many epochs skip it again (they count it).

        The log is its own record of what it holds: a reader reads it once, so a resumed run
        (or a reader made again, as the held-out sets are at each launch) adds no second line
        for a sample it already lists. Across DP ranks: each epoch deals the samples out anew,
        so a bad sample comes to another rank in a later epoch; only the rank that read it in
        the first epoch (epoch 0: each sample goes to exactly one rank) writes its line. A
        failure that first shows in a later epoch (a timeout, a read error) is written when it
        happens on that rank."""
        path = self.cfg.quarantine_log
        if not path:
            return
        if self._quarantined is None:
            self._quarantined = self._read_quarantined(path)
        if (shard, key) in self._quarantined or (epoch > 0 and not self._read_first_epoch(index)):
            return
        self._quarantined.add((shard, key))
        rec = {"time": time.time(), "reason": reason, "shard": shard, "key": key, "index": index, "detail": detail,
               "epoch": epoch, "dp_rank": self.dp_rank}
        if self.source:
            rec["source"] = self.source
        line = json.dumps(rec) + "\n"
        if self._log_needs_newline:  # end the torn line first, so this one stays whole
            line, self._log_needs_newline = "\n" + line, False
        with open(path, "a") as f:
            f.write(line)

    def _read_quarantined(self, path: str) -> set[tuple[str, str]]:
        """(shard, key) of every line the log holds (none when it is new); a torn last line (a
        kill mid-write) names nothing and is closed by the next write."""
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        try:
            with open(path, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            return set()
        self._log_needs_newline = bool(data) and not data.endswith(b"\n")
        seen = set()
        for line in data.splitlines():
            try:
                rec = json.loads(line)
                seen.add((rec["shard"], rec["key"]))
            except (ValueError, KeyError, TypeError):
                continue
        return seen

    def _read_first_epoch(self, index: int) -> bool:
        """Whether this rank read sample `index` in epoch 0 (then its line is this rank's to write)."""
        if self.dp_size == 1:
            return True
        if self._first_epoch is None:  # not through order(): that would drop the current epoch's cached order
            c = self.cfg
            self._first_epoch = np.sort(rank_order(len(self.index), self.dp_rank, self.dp_size, c.seed, 0, c.slice_size,
                                                   c.shuffle_buffer, c.shuffle))
        at = int(np.searchsorted(self._first_epoch, index))
        return at < len(self._first_epoch) and int(self._first_epoch[at]) == index

    def close(self) -> None:
        self.decoder.close()

    # ---------------------------------------------------------------- state
    def state_dict(self) -> dict:
        c = self.cfg
        return {
            "version": STATE_VERSION,
            "dataset": self.index.fingerprint(),
            "num_samples": len(self.index),
            "dp_rank": self.dp_rank,
            "dp_size": self.dp_size,
            "seed": c.seed,
            "shuffle": c.shuffle,
            "slice_size": c.slice_size,
            "shuffle_buffer": c.shuffle_buffer,
            "epoch": self.epoch,
            "position": self.position,
            "pending": list(self.pending),
            "skips": dict(self.skips),
            "ignored_members": dict(self.ignored_members),
            "samples_yielded": self.samples_yielded,
            "budget_fitted": self.budget_fitted,
            "frames_dropped": self.frames_dropped,
            "remote_retries": self.remote_retries,
        }

    def load_state_dict(self, state: dict) -> None:
        if state.get("kind") == "blend":
            raise ValueError("data state was saved by a blend of datasets (data.blend): resume with the same data.blend")
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"data state version {state.get('version')} is not {STATE_VERSION}")
        c = self.cfg
        mine = {"dataset": self.index.fingerprint(), "num_samples": len(self.index), "dp_rank": self.dp_rank,
                "dp_size": self.dp_size, "seed": c.seed, "shuffle": c.shuffle, "slice_size": c.slice_size,
                "shuffle_buffer": c.shuffle_buffer}
        for k, v in mine.items():
            if state[k] != v:
                raise ValueError(f"{self._where}data state was saved with {k}={state[k]!r} but this reader has {k}={v!r}: "
                                 f"resume with the same {k} (only `workers` and decode settings may change)")
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])
        self.pending = list(state.get("pending", []))
        self._order_cache = None
        self.skips = Counter(state.get("skips", {}))
        self.ignored_members = Counter(state.get("ignored_members", {}))
        self.samples_yielded = int(state.get("samples_yielded", 0))
        self.budget_fitted = int(state.get("budget_fitted", 0))
        self.frames_dropped = int(state.get("frames_dropped", 0))
        self.remote_retries_before = int(state.get("remote_retries", 0)) - self.decoder.remote.retries


def rank_keys(shards, dp_rank: int, dp_size: int, seed: int = 0, epoch: int = 0, slice_size: int = 64,
              shuffle_buffer: int = 256, shuffle: bool = True, index: str | None = None) -> list[str]:
    """The keys rank `dp_rank` reads in `epoch`, in order (no decoding)."""
    check_split(dp_rank, dp_size)
    idx = open_dataset(shards, index)
    order = rank_order(len(idx), dp_rank, dp_size, seed, epoch, slice_size, shuffle_buffer, shuffle)
    return [idx.sample_key[i] for i in order.tolist()]


def progress(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)
