"""Every process dataio starts to read ends with the process that reads (a rank), however that one
ends: kill -9 of the reader while a video decode child is stuck in C (dataio/decode.py's
VideoDecodePool), and while torchdata's process workers wait for items (data.worker_kind:
process). Each test: a reader in a process of its own, its children collected by PID, the reader
killed -9, the children checked gone."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

HERE = Path(__file__).resolve().parent
PATHS = [str(HERE), str(HERE.parent), str(HERE.parents[1])]  # this module, the tests' helpers, the repository


def _announce_then_hang(data, cfg, window, expected):
    """A video decoder that creates the file whose path is the 'video' bytes, then spins in C
    with the GIL held (a catastrophically backtracking regex): the stand-in for decord's
    get_batch deadlock (dmlc/decord#373), which no signal handler of the child's could end."""
    open(data.decode(), "w").close()
    re.match(r"(a+)+$", "a" * 64 + "b")


def _kill_and_check(reader: subprocess.Popen, children: list[psutil.Process], within: float) -> None:
    try:
        assert children
        reader.kill()
        reader.wait()
        assert not psutil.wait_procs(children, timeout=within)[1]
    finally:
        reader.kill()
        for c in children:
            try:
                c.send_signal(signal.SIGKILL)
            except psutil.Error:
                pass


def test_a_decode_child_stuck_in_c_dies_with_the_process_that_reads(tmp_path):
    """The kernel ends the child (its parent-death signal, requested by the child first thing),
    which would otherwise spin for hours: no closed pipe reaches it while it is stuck. 2-3 s."""
    started = tmp_path / "hanging"
    reader = subprocess.Popen([sys.executable, "-c", (
        f"import sys, threading; sys.path[:0] = {PATHS!r}; "
        "from dataio.decode import MediaConfig, VideoDecodePool; "
        "pool = VideoDecodePool(1, timeout_s=600, decoder='test_worker_processes:_announce_then_hang'); "
        f"threading.Thread(target=pool.decode, args=({str(started).encode()!r}, MediaConfig()), daemon=True).start(); "
        "threading.Event().wait()")])
    deadline = time.monotonic() + 60
    while not started.exists():
        assert reader.poll() is None and time.monotonic() < deadline, "the decode child never started decoding"
        time.sleep(0.05)
    children = [c for c in psutil.Process(reader.pid).children(recursive=True) if "spawn_main" in " ".join(c.cmdline())]
    assert len(children) == 1
    _kill_and_check(reader, children, within=10)


def test_torchdatas_process_workers_end_with_the_process_that_reads(tmp_path):
    """data.worker_kind=process: torchdata's workers poll their queue until told to stop, which a
    killed reader never does; each watches its parent (dataio.decode.EndsWithItsParent). 5-10 s."""
    from dataio.synth import write_shards

    write_shards(str(tmp_path / "train"), images=40, videos=0, samples_per_shard=10, seed=1, tasks=["colour"])
    reader = subprocess.Popen([sys.executable, "-c", (
        f"import sys, time; sys.path[:0] = {PATHS!r}; "
        "from dataio.reader import DataConfig, DataReader; "
        f"r = DataReader(DataConfig(shards=[{str(tmp_path / 'train')!r}], workers=2, worker_kind='process')); "
        # half the epoch read: both workers past their first item (a worker that never got one is
        # not watched, EndsWithItsParent says why), also when one of them starts late
        "it = iter(r.iter_epoch()); [next(it) for _ in range(20)]; print('reading', flush=True); time.sleep(600)")],
        stdout=subprocess.PIPE, text=True)
    assert reader.stdout.readline().strip() == "reading"
    time.sleep(0.5)
    _kill_and_check(reader, psutil.Process(reader.pid).children(recursive=True), within=10)
