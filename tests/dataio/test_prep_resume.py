"""Interrupting `yatt-mm prep video` (kill -9, Ctrl-C) loses at most the shards in flight, never
shows a half-written shard to readers, leaves none of its worker processes running, and
rerunning the same command completes the job with every clip exactly once: the same bytes as a
run that was never interrupted."""

from __future__ import annotations

import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import psutil
import pytest

from prep_media import write_video

from dataio.index import expand_shards
from dataio.shards import scan_tar

ARGS = ["--workers", "1", "--max-clip-len", "1", "--fps", "8", "--max-samples-per-shard", "3", "--no-progress"]


@pytest.fixture(scope="module")
def many_videos(tmp_path_factory):
    """40 videos (copies of 4 sources under distinct names: distinct keys), 4 clips each."""
    root = tmp_path_factory.mktemp("many")
    srcs = [write_video(str(root / f"src{i}.mp4"), "libx264", 25, 4.0, w=128, h=96) for i in range(4)]
    for n in range(40):
        shutil.copy(srcs[n % 4], root / f"v{n:03d}.mp4")
    for s in srcs:
        os.unlink(s)
    return str(root)


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "yatt_mm.cli", "prep", "video", *args]


def journal_shards(out: str) -> int:
    try:
        with open(os.path.join(out, ".prep", "journal.jsonl")) as f:
            return sum(1 for line in f if '"shard"' in line)
    except FileNotFoundError:
        return 0


def run_until_shards(cmd: list[str], out: str, shards: int, sig: int) -> subprocess.Popen:
    # A job a non-interactive shell starts in the background ignores SIGINT, and every process
    # it starts inherits that (CI launched with `cmd &` does): prep then never sees the Ctrl-C
    # sent here. The child starts with the default action, as from a terminal; an ignored
    # SIGINT stays ignored across exec, a default one lets Python install its handler.
    ignored = sig == signal.SIGINT and signal.getsignal(signal.SIGINT) == signal.SIG_IGN
    if ignored:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
    try:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    finally:
        if ignored:
            signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        while proc.poll() is None and journal_shards(out) < shards:
            time.sleep(0.005)
        if proc.poll() is not None:
            out_, err = proc.communicate(timeout=60)
            pytest.fail(f"prep finished before it could be interrupted (make the corpus bigger): {err.decode()[-500:]}")
        proc.children = psutil.Process(proc.pid).children(recursive=True)  # the forkserver, the pool's workers
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=60)
    finally:  # a failed or timed-out test leaves no prep running
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=60)
    proc.stderr_tail = err.decode()[-2000:]
    return proc


def assert_visible_shards_complete(out: str) -> int:
    """What a reader sees mid-run: only *.tar files, each one a complete tar."""
    n = 0
    for p in expand_shards([out]):
        scan = scan_tar(p)
        assert scan.error is None and all(m.kind != "truncated" for m in scan.members), p
        n += 1
    return n


def test_resume_after_kill_9(many_videos, tmp_path):
    ref = str(tmp_path / "ref")
    subprocess.run(cli(many_videos, "--out", ref, *ARGS), check=True, capture_output=True, timeout=300)
    ref_shards = sorted(os.path.basename(p) for p in glob.glob(os.path.join(ref, "*.tar")))
    assert len(ref_shards) == 54  # 40 videos x 4 clips, 3 per shard

    out = str(tmp_path / "out")
    proc = run_until_shards(cli(many_videos, "--out", out, *ARGS), out, 2, signal.SIGKILL)
    assert proc.returncode == -signal.SIGKILL
    # its worker processes end with it: none is left to hold memory or to write into OUT
    assert proc.children and not psutil.wait_procs(proc.children, timeout=10)[1]
    done_before = assert_visible_shards_complete(out)
    assert 2 <= done_before < len(ref_shards)
    assert not os.path.exists(os.path.join(out, "index.parquet"))  # written when the run completes

    r = subprocess.run(cli(many_videos, "--out", out, *ARGS), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "resumed" in r.stdout
    assert not glob.glob(os.path.join(out, "*.tmp"))
    got = sorted(os.path.basename(p) for p in glob.glob(os.path.join(out, "*.tar")))
    assert got == ref_shards
    for name in ref_shards + ["index.parquet", "failures.parquet"]:
        assert open(os.path.join(out, name), "rb").read() == open(os.path.join(ref, name), "rb").read(), name

    # every clip exactly once, read back by dataio
    from dataio.index import open_dataset

    idx = open_dataset([out])
    assert len(idx) == 160 and len(set(idx.sample_key)) == 160
    stats = json.load(open(os.path.join(out, "stats.json")))
    assert stats["samples"] == 160 and stats["items_ok"] == 40 and stats["resumed"]


def test_ctrl_c_exits_cleanly_and_resumes(many_videos, tmp_path):
    out = str(tmp_path / "out")
    proc = run_until_shards(cli(many_videos, "--out", out, *ARGS), out, 1, signal.SIGINT)
    assert proc.returncode == 130, (proc.returncode, journal_shards(out), proc.stderr_tail)
    assert not glob.glob(os.path.join(out, "*.tmp"))  # the shard in flight was removed
    assert assert_visible_shards_complete(out) >= 1
    r = subprocess.run(cli(many_videos, "--out", out, *ARGS), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    from dataio.index import open_dataset

    idx = open_dataset([out])
    assert len(idx) == 160 and len(set(idx.sample_key)) == 160
