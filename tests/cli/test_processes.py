"""What a run starts ends with it: the supervisor (yatt_mm/processes.py) with real processes."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from yatt_mm import processes

ROOT = Path(__file__).resolve().parents[2]

# A command that starts a process of its own which ignores SIGTERM (as a stuck EngineCore would)
# and prints its pid once it does, then waits: what the supervisor must end whole.
STUBBORN = [sys.executable, "-c", "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', "
            "'import os, signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print(os.getpid(), flush=True); "
            "time.sleep(600)']); time.sleep(600)"]


def _gone(pids: list[int], within: float) -> list[int]:
    """Those of `pids` still running after `within` seconds (zombies count as gone)."""
    import psutil

    deadline = time.monotonic() + within
    while True:
        alive = []
        for pid in pids:
            try:
                if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                    alive.append(pid)
            except psutil.NoSuchProcess:
                pass
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.05)


def test_a_supervised_group_ends_when_its_owner_is_killed_9():
    """The owner (a rank) starts a supervised command and is killed -9: the supervisor sees it go
    (a pidfd), SIGTERMs its group and SIGKILLs what ignores that after the grace (here 1 s)."""
    owner = subprocess.Popen([sys.executable, "-c", (
        f"import sys, time; sys.path.insert(0, {str(ROOT)!r}); from yatt_mm import processes; "
        f"p = processes.start_supervised({STUBBORN!r}, grace_s=1); print(p.pid, flush=True); time.sleep(600)")],
        stdout=subprocess.PIPE, text=True)
    try:
        supervisor = int(owner.stdout.readline())
        grandchild = int(owner.stdout.readline())
        group = processes.group_members(supervisor)
        assert len(group) == 3 and grandchild in group and group[0] == supervisor  # supervisor, command, its child
        owner.kill()
        owner.wait()
        assert _gone(group, within=10) == []
    finally:
        owner.kill()
        for pid in processes.group_members(supervisor):
            os.kill(pid, signal.SIGKILL)


def test_the_group_ends_when_its_command_dies_and_end_group_ends_what_a_dead_supervisor_left():
    """A crashed command (a judge server's API process) leaves no child behind (its EngineCore),
    and the supervisor exits with the command's status; `end_group` (JudgeServer.stop) ends the
    group also when the supervisor itself was killed -9 (a fault nothing in yatt-mm causes: a
    stand-in for the OOM killer)."""
    proc = processes.start_supervised(STUBBORN, grace_s=1, stdout=subprocess.PIPE, text=True)
    grandchild = int(proc.stdout.readline())
    command = next(p for p in processes.group_members(proc.pid) if p not in (proc.pid, grandchild))
    os.kill(command, signal.SIGKILL)
    assert proc.wait(timeout=15) == 128 + signal.SIGKILL and _gone([grandchild], within=5) == []

    proc = processes.start_supervised(STUBBORN, grace_s=1, stdout=subprocess.PIPE, text=True)
    grandchild = int(proc.stdout.readline())
    group = processes.group_members(proc.pid)
    try:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        assert _gone([grandchild], within=0.5) == [grandchild]  # nobody else ends it
        start = time.monotonic()
        processes.end_group(proc, timeout=2)
        assert _gone(group, within=1) == [] and time.monotonic() - start < 8
    finally:
        processes.signal_group(proc.pid, signal.SIGKILL)
