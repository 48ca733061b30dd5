"""A run leaves nothing behind when one of its ranks is killed -9, and a one-node run listens on
loopback only: one 2-rank launch under partial colocation, whose first rank starts the node's
vLLM judge server (a supervisor, the API process and its EngineCore: yatt_mm/processes.py).
While the run lives, every process of it is collected by PID and every listening socket it has
opened is checked; then that rank is killed -9, and 30 s later none of those processes may run,
nor any of their temporary files remain.
Without the supervisor the server's processes outlived the run (and a rerun started a second
server beside them); without the loopback rendezvous torchrun's store listened on every
interface."""

import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import psutil
import pytest

from dataio.synth import write_shards
from test_rl import ROOT, UNTRAINED_JUDGE, _rank_process, _steps_logged, _tiny_rl, _wait_for

LOOPBACK = ("127.0.0.1", "::1")


def _alive(procs: list[psutil.Process]) -> list[str]:
    """Those of `procs` still running (a zombie has ended: only its exit status is left)."""
    out = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(f"{p.pid} {' '.join(p.cmdline())[:150]}")
        except psutil.NoSuchProcess:
            continue
    return out


@pytest.mark.slow  # one 2-rank launch with a judge server: 100-160 s on 2 busy cores
def test_kill_9_of_the_judge_servers_rank_leaves_no_process_of_the_run_and_it_listened_on_loopback_only(
        tmp_path, tiny_policy):
    write_shards(str(tmp_path / "train"), images=16, videos=0, samples_per_shard=8, seed=7, tasks=["colour"])
    run_dir = tmp_path / "run"
    server_judge = UNTRAINED_JUDGE.replace("votes: 2", "backend: server, votes: 2")
    cmd = _tiny_rl(run_dir, tmp_path / "train", "run.steps=200", "eval.every=0", "run.save_final=false",
                   "run.placement=partial", server_judge)
    out = open(tmp_path / "run.out", "w")
    # the run's TMPDIR, short enough for the launcher's folder and vLLM's socket names in it: what
    # the run's processes leave there must go with them
    scratch = Path(tempfile.mkdtemp(prefix="yatt-kill-"))
    launcher = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, "TMPDIR": str(scratch)})
    run: list[psutil.Process] = []
    try:
        _wait_for(lambda: _steps_logged(run_dir) >= 1, launcher, "step 1 (the judge server up and judging)")
        run = psutil.Process(launcher.pid).children(recursive=True)
        owner = _rank_process(launcher, 0)  # the node's first controller starts its judge server
        server = owner.children(recursive=True)
        commands = [" ".join(p.cmdline()) for p in server]
        assert any("yatt_mm/processes.py" in c for c in commands), commands  # the supervisor
        assert any("vllm.entrypoints.openai.api_server" in c for c in commands), commands
        assert len(server) >= 3, commands  # supervisor, API process, EngineCore (and vLLM's helpers)

        listening = sorted({(p.pid, c.laddr.ip, c.laddr.port) for p in run for c in p.net_connections("inet")
                            if c.status == psutil.CONN_LISTEN})
        print("listening sockets of the run (pid, address, port):", listening)
        assert any(pid == owner.ppid() for pid, _, _ in listening)  # torchrun's rendezvous store, among them
        assert any(pid in {p.pid for p in server} for pid, _, _ in listening)  # the judge server's port
        assert all(ip in LOOPBACK for _, ip, _ in listening), listening

        killed = time.monotonic()
        os.kill(owner.pid, signal.SIGKILL)
        assert launcher.wait(timeout=60) != 0  # torchrun stops the other rank and reports the failure
        while _alive(run) and time.monotonic() < killed + 30:
            time.sleep(0.5)
        assert not _alive(run), f"alive 30 s after kill -9 of rank 0: {_alive(run)}"
        # nor any temporary file of theirs (torchrun's log folder, vLLM's IPC sockets): the ranks
        # wrote them in the launcher's folder, removed once torchrun ended. torch's compile cache
        # (torchinductor_USER) is a cache, meant to outlive runs
        left = [p.name for p in scratch.iterdir() if not p.name.startswith("torchinductor_")]
        assert not left, sorted(str(p) for p in scratch.rglob("*"))[:20]
        print(f"every process of the run ({len(run)}) ended {time.monotonic() - killed:.1f} s after the kill")
    finally:
        launcher.kill()
        for p in run:  # a failed check must not leave the run to the next test
            try:
                p.kill()
            except psutil.Error:
                pass
        out.close()
        shutil.rmtree(scratch, ignore_errors=True)
