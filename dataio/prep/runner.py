"""The prep run: inputs -> ordered results from workers -> shards, journal, index, stats.

Workers (local processes here, Ray tasks in `ray_runner`) turn items into encoded samples in
any order; results are consumed in sorted input order and written by this process alone, so
which clip lands in which shard depends only on (inputs, options), never on worker timing."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import sys
import time
from collections import Counter, deque
from dataclasses import asdict, replace
from typing import Iterator

from dataio.prep.destination import Destination
from dataio.prep.inputs import IMAGE_SUFFIXES, VIDEO_SUFFIXES, Item, expand_inputs
from dataio.prep.state import STATE_DIR, RunState
from dataio.prep.work import PrepOptions, WorkResult, process
from dataio.prep.writer import ShardWriter, remove_temp_shards

FAILURE_COLUMNS = ("path", "reason", "detail")


def local_results(todo: list[tuple[int, Item]], opts: PrepOptions, workers: int) -> Iterator[WorkResult]:
    """`process` over `todo` on `workers` processes (0: in this process), yielded in input order,
    at most 2 x workers items in flight (memory stays bounded whatever the corpus size)."""
    if workers == 0:
        for i, item in todo:
            yield process(i, item, opts)
        return
    # forkserver: workers fork from a clean server process (never from this one, which may hold
    # threads) that has the codec libraries imported already: ~0.3 s a worker instead of ~0.8 s
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["dataio.prep.work", "dataio.prep.frames", "dataio.prep.encode", "av", "PIL.Image"])
    pool = ctx.Pool(workers, initializer=_ignore_sigint)
    try:
        pending: deque = deque()
        it = iter(todo)
        for i, item in it:
            pending.append(pool.apply_async(process, (i, item, opts)))
            if len(pending) >= 2 * workers:
                break
        while pending:
            res = pending.popleft().get()
            nxt = next(it, None)
            if nxt is not None:
                pending.append(pool.apply_async(process, (nxt[0], nxt[1], opts)))
            yield res
        pool.close()
    finally:
        pool.terminate()
        pool.join()


def _ignore_sigint() -> None:
    # Ctrl-C reaches the whole process group; the parent handles it (drops the shard in flight,
    # terminates the pool), the workers should not each print a traceback
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)


class _Progress:
    def __init__(self, total: int, initial: int, enabled: bool, kind: str):
        self.t0 = time.time()
        self.samples = 0
        self.failed = 0
        self.unit = "clips" if kind == "video" else "images"
        self.bar = None
        if enabled:
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=initial, unit="video" if kind == "video" else "img",
                            desc=f"prep {kind}", file=sys.stderr, dynamic_ncols=True, smoothing=0.1)

    def update(self, res: WorkResult, written: int) -> None:
        self.samples += written
        self.failed += not res.ok
        if self.bar is not None:
            rate = self.samples / max(1e-9, time.time() - self.t0)
            self.bar.set_postfix_str(f"{self.samples} {self.unit}, {rate:.1f} {self.unit}/s, {self.failed} failed",
                                     refresh=False)
            self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def write_outputs(dest: Destination, state: RunState, started: float, seconds: Counter, opts: PrepOptions,
                  n_items: int, resumed: bool) -> dict:
    """index.parquet over the journaled shards, failures.parquet, stats.json; returns the stats."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from dataio import storage
    from dataio.index import INDEX_NAME, build_index, write_table

    out = dest.local
    shards = state.shards
    if shards and dest.remote:  # from the parts written with each shard: no shard is read back
        write_table(dest.index_table(shards), storage.join(dest.out, INDEX_NAME))
    elif shards:
        build_index([os.path.join(os.path.abspath(out), s) for s in shards], os.path.join(out, INDEX_NAME))
    fails = state.failures()
    table = pa.table({c: pa.array([f[c] for f in fails], pa.string()) for c in FAILURE_COLUMNS})
    tmp = os.path.join(out, "failures.parquet.tmp")
    pq.write_table(table, tmp)
    os.replace(tmp, os.path.join(out, "failures.parquet"))
    dest.publish("failures.parquet")
    tot = state.totals()
    work = {k: round(v, 3) for k, v in sorted(seconds.items())}
    busy = sum(seconds[k] for k in ("probe", "decode", "encode", "write"))
    stats = {
        "kind": opts.kind,
        "inputs": n_items,
        "items_ok": tot["items_ok"],
        "items_failed": len(fails),
        "failures_by_reason": dict(sorted(Counter(f["reason"] for f in fails).items())),
        "samples": tot["samples"],
        "shards": len(shards),
        "bytes": tot["bytes"],
        "options": {k: v for k, v in asdict(opts).items() if k != "base_dir"},
        # this invocation only (a resumed run reports the part it did)
        "resumed": resumed,
        "run_seconds": round(time.time() - started, 3),
        "worker_seconds": work,
        "time_share": {k: round(seconds[k] / busy, 4) for k in ("probe", "decode", "encode", "write")} if busy else {},
    }
    tmp = os.path.join(out, "stats.json.tmp")
    with open(tmp, "w") as f:
        json.dump(stats, f, indent=1, sort_keys=True)
    os.replace(tmp, os.path.join(out, "stats.json"))
    dest.publish("stats.json")
    return stats


def run_prep(inputs: list[str], out: str, opts: PrepOptions, workers: int = 2, engine: str = "local",
             progress: bool = True, overwrite: bool = False, ray_address: str | None = None,
             input_format: str = "auto", media_root: str = "") -> dict:
    """Run (or resume) a prep job; returns the stats dict. Raises SystemExit when no input
    produced a sample."""
    started = time.time()
    opts.check()
    if workers < 0:
        raise ValueError(f"--workers must be >= 0, got {workers}")
    if engine not in ("local", "ray"):
        raise ValueError(f"--engine must be 'local' or 'ray', got {engine!r}")
    dest = Destination(out)
    dest.check_writable()
    items = expand_inputs(inputs, VIDEO_SUFFIXES if opts.kind == "video" else IMAGE_SUFFIXES, opts.kind,
                          staging=os.path.join(dest.local, STATE_DIR, "media"), fmt=input_format,
                          media_root=os.path.abspath(os.path.expanduser(media_root)) if media_root else "")
    if not items:
        raise SystemExit(f"prep {opts.kind}: no {'videos' if opts.kind == 'video' else 'images'} found in {inputs}")
    base = os.path.commonpath([os.path.dirname(it.path) for it in items])
    opts = replace(opts, base_dir=base)
    os.makedirs(dest.local, exist_ok=True)
    state = RunState.open(dest, opts.fingerprint_dict(), items, overwrite)
    remove_temp_shards(dest.local)
    seconds: Counter = Counter()
    resumed = bool(state.lines)
    if not state.done:
        i0, j0 = state.next_position
        if resumed and progress:
            print(f"prep: resuming {dest.shown()} at input {i0}/{len(items)} ({len(state.shards)} shards done)",
                  file=sys.stderr)
        todo = list(enumerate(items))[i0:]
        if engine == "ray":
            from dataio.prep.ray_runner import ray_results

            results = ray_results(todo, opts, workers, ray_address)
        else:
            results = local_results(todo, opts, workers)
        _write(results, state, opts, dest, len(items), (i0, j0), seconds, progress)
    stats = write_outputs(dest, state, started, seconds, opts, len(items), resumed)
    if stats["samples"] == 0:
        reasons = ", ".join(f"{k} {v}" for k, v in stats["failures_by_reason"].items())
        raise SystemExit(f"prep {opts.kind}: none of the {len(items)} inputs produced a sample ({reasons}); "
                         f"see {dest.shown('failures.parquet')}")
    return stats


def _write(results: Iterator[WorkResult], state: RunState, opts: PrepOptions, dest: Destination, n_items: int,
           start: tuple[int, int], seconds: Counter, progress: bool) -> None:
    bar = _Progress(n_items, start[0], progress, opts.kind)
    shard: ShardWriter | None = None
    pending = {"items_ok": 0, "failures": [], "samples": 0, "bytes": 0}

    def commit(nxt: tuple[int, int], done: bool) -> None:
        nonlocal shard, pending
        line = {"next": list(nxt), "done": done, **pending}
        if shard is not None:
            t = time.perf_counter()
            dest.publish_shard(shard.commit())  # a URL --out: uploaded whole before it is journaled
            seconds["write"] += time.perf_counter() - t
            line.update(shard=os.path.basename(shard.path))
            shard = None
        state.append(line)
        pending = {"items_ok": 0, "failures": [], "samples": 0, "bytes": 0}

    try:
        for res in results:
            for k, v in res.seconds.items():
                seconds[k] += v
            written = 0
            if not res.ok:
                pending["failures"].append({"path": res.path, "reason": res.reason, "detail": res.detail})
            else:
                skip = start[1] if res.index == start[0] else 0  # clips written before an interruption
                for c in range(skip, len(res.samples)):
                    members = res.samples[c].members
                    if shard is not None and not shard.fits(members):
                        commit((res.index, c), False)
                    t = time.perf_counter()
                    if shard is None:
                        shard = ShardWriter(dest.local, state.next_shard_number(), opts.shard_size, opts.max_samples_per_shard)
                    shard.add(members)
                    seconds["write"] += time.perf_counter() - t
                    pending["samples"] += 1
                    pending["bytes"] += ShardWriter.sample_bytes(members)
                    written += 1
                pending["items_ok"] += 1
            bar.update(res, written)
        commit((n_items, 0), True)
    except BaseException:
        if shard is not None:
            shard.abort()  # the shard in flight is lost; everything journaled stays
        raise
    finally:
        bar.close()
        close = getattr(results, "close", None)
        if close:
            close()
