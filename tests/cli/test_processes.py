"""What a run starts ends with it, and what it opens to the network is asked for: the supervisor
(yatt_mm/processes.py) with real processes, a judge server's port and address checks
(yatt_mm/engines/server.py, yatt_mm/loopback.py). The same on a live run, a rank killed -9 with
its judge server's processes checked by PID: tests/e2e/test_rl_scale.py's partial-colocation run; a judge
server whose API process alone is killed: tests/rl/test_split_live.py."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from yatt_mm import processes

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "configs" / "tiny_demo.yaml"

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


def test_a_judge_server_refuses_a_port_another_process_listens_on():
    """A rerun must never talk to a server an earlier run left behind: a port someone listens on
    is refused before vLLM starts, naming the process (here this test, holding the port)."""
    from yatt_mm.engines.server import JudgeServer
    from yatt_mm.loopback import listening_socket
    from yatt_mm.reward.genrm import JudgeConfig

    held = listening_socket("127.0.0.1")
    port = held.getsockname()[1]
    with held, pytest.raises(RuntimeError) as e:
        JudgeServer(JudgeConfig(name="genrm", model="/nowhere", backend="server", port=port)).start()
    assert f"port {port} on 127.0.0.1 is in use (pid {os.getpid()}:" in str(e.value)
    assert "set the judge's port to 0" in str(e.value)


def test_a_judge_server_off_loopback_needs_an_api_key_before_any_rank_starts(monkeypatch, capsys):
    from yatt_mm.cli import main
    from yatt_mm.config import load
    from yatt_mm.rl.config import RLConfig

    monkeypatch.delenv("YATT_MM_JUDGE_API_KEY", raising=False)
    server = ["reward.judges[0].judge.backend=server", "reward.judges[0].judge.host=0.0.0.0"]
    assert main(["rl", "--config", str(DEMO), "--nproc", "2", *server]) == 2
    err = capsys.readouterr().err
    assert "judge 'genrm': host 0.0.0.0 is not a loopback address" in err
    assert "put an API key in the environment variable YATT_MM_JUDGE_API_KEY" in err
    load(RLConfig, DEMO, server[:1])  # on loopback (the default host) no key is needed
    monkeypatch.setenv("MY_JUDGE_KEY", "not-logged")
    cfg = load(RLConfig, DEMO, [*server, "reward.judges[0].judge.api_key_env=MY_JUDGE_KEY"])
    assert cfg.reward.judges[0].judge.host == "0.0.0.0"
