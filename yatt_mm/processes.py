"""Every process a run starts ends when the process that started it ends, however that one ends
(kill -9 included), and its owner can end it whole.

Two tools, for two kinds of child:
- `die_with_parent`: a child that starts no processes of its own (torchrun under the launcher,
  the disaggregated placement's engine worker) asks the kernel for a signal when its parent dies
  (Linux `PR_SET_PDEATHSIG`), then checks that the parent is still there (it may have died before
  the request was made).
- `start_supervised`: a child that starts processes of its own (a vLLM judge server: its API
  process spawns an EngineCore; the warm start's SFT run) runs under a supervisor, this file run
  as a script. The supervisor leads a process group of its own, in which the command and
  everything it starts run; it ends that group when its parent dies (watched through a pidfd:
  `PR_SET_PDEATHSIG` is not inherited by grandchildren, and it fires when the *thread* that
  started a process ends, not the process), when the command ends by itself (a crashed API
  process would otherwise leave its EngineCore behind), or when its owner asks (`end_group`).
  It becomes the "child subreaper" of the command, so a grandchild orphaned by the command's
  death is re-parented to it rather than to init, and it waits until each has gone.

The supervisor imports only the standard library and starts with `python -I -S` (no site
packages, no project hooks): about 20 ms and 10 MB, beside a judge server of gigabytes.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
GRACE_S = 10.0  # what a command gets to end after SIGTERM (vLLM stops its EngineCore in 2-5 s) before SIGKILL


def _prctl(option: int, value: int) -> bool:
    """Linux prctl(2); False where there is none (another OS: the child then outlives a killed
    parent, as it would without this module)."""
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def die_with_parent(sig: int, parent: int) -> None:
    """Call in a child as early as possible: `sig` reaches this process when `parent` (the pid
    that started it) dies; exits at once if it is gone already. The parent must start the child
    from a thread that lives as long as the child should (the kernel signals when that thread
    ends): the main thread, in this project."""
    _prctl(PR_SET_PDEATHSIG, sig)
    if os.getppid() != parent:  # the parent died before the request: nobody would signal
        os._exit(1)


def supervised(cmd: list[str], grace_s: float = GRACE_S) -> list[str]:
    """The command line that runs `cmd` under a supervisor whose parent is the caller; start it
    with `start_new_session=True` (what `start_supervised` does), so that the supervisor leads
    the group it ends."""
    return [sys.executable, "-I", "-S", os.path.abspath(__file__), str(os.getpid()), str(grace_s), "--", *cmd]


def start_supervised(cmd: list[str], grace_s: float = GRACE_S, **popen_kwargs) -> subprocess.Popen:
    """`cmd` under a supervisor (see the module doc). The Popen is the supervisor's: its pid is
    the process group's (and session's) id; `end_group(proc)` ends it whole."""
    return subprocess.Popen(supervised(cmd, grace_s), start_new_session=True, **popen_kwargs)


def group_members(pgid: int) -> list[int]:
    """The pids of process group `pgid` (its leader first), from /proc (fields after the name:
    state, ppid, pgrp)."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[2]) == pgid:
                        pids.append(int(entry))
            except (OSError, IndexError, ValueError):
                continue
    return sorted(pids, key=lambda p: (p != pgid, p))


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # a member exists, owned by someone else (a pgid reused: not ours)
        return False
    return True


def signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def end_group(proc: subprocess.Popen, timeout: float = 20.0) -> None:
    """End the group `start_supervised` made, whether or not its supervisor or command still
    run: SIGTERM (through the supervisor while it lives, which gives its command GRACE_S before
    SIGKILL), then SIGKILL to every member left after `timeout`. Returns when the group is gone
    or `timeout` + 5 s have passed."""
    pgid = proc.pid
    if proc.poll() is None:
        proc.terminate()
    else:  # the supervisor is gone (killed -9, say): what it led may still run
        signal_group(pgid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while (proc.poll() is None or group_alive(pgid)) and time.monotonic() < deadline:
        time.sleep(0.1)
    signal_group(pgid, signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + 5.0  # SIGKILL is not instant; orphans are reaped by init
    while group_alive(pgid) and time.monotonic() < deadline:
        time.sleep(0.05)


# -- the supervisor: this file run as a script -------------------------------------------------


class _Ended(Exception):
    """SIGTERM or SIGHUP reached the supervisor: its owner ends the group."""


def _raise_ended(signum, frame) -> None:
    raise _Ended


def _pidfd(pid: int) -> int | None:
    """A descriptor that becomes readable when `pid` ends (Linux 5.3+), or None."""
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return None


def _reap() -> bool:
    """Collect every child that has ended (our command and the orphans we adopted as subreaper);
    False when none is left."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return False
        if pid == 0:
            return True


def _end_own_group(grace_s: float) -> None:
    """SIGTERM to every member of this group but this process, SIGKILL after `grace_s` to what is
    left, and wait until the group holds only this process."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    me = os.getpid()
    os.killpg(me, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and [p for p in group_members(me) if p != me]:
        _reap()
        time.sleep(0.05)
    for pid in group_members(me):
        if pid != me:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + 5.0
    while _reap() and time.monotonic() < deadline:
        time.sleep(0.05)


def _supervise(parent: int, grace_s: float, cmd: list[str]) -> int:
    import select

    signal.signal(signal.SIGTERM, _raise_ended)
    signal.signal(signal.SIGHUP, _raise_ended)
    _prctl(PR_SET_CHILD_SUBREAPER, 1)
    code = 128 + signal.SIGTERM
    try:
        parent_fd = _pidfd(parent)
        if os.getppid() != parent:  # the parent died before the watch began
            return code
        # the command gets SIGTERM should this supervisor be killed -9 (this process has one
        # thread, so a preexec_fn is safe here); the group's other members are ended by the owner
        me = os.getpid()
        child = subprocess.Popen(cmd, preexec_fn=lambda: die_with_parent(signal.SIGTERM, me))
        child_fd = _pidfd(child.pid)
        watched = [fd for fd in (parent_fd, child_fd) if fd is not None]
        while child.poll() is None and os.getppid() == parent:
            # wakes when either ends; without pidfds (an old kernel), a look every 0.2 s
            select.select(watched, [], [], None if len(watched) == 2 else 0.2)
        if child.returncode is not None:
            code = child.returncode if child.returncode >= 0 else 128 - child.returncode
    except _Ended:
        pass
    _end_own_group(grace_s)
    return code


if __name__ == "__main__":
    _parent, _grace, _sep, *_cmd = sys.argv[1:]
    sys.exit(_supervise(int(_parent), float(_grace), _cmd))
