"""Shared by the benchmarks' smoke test and its session fixture: the benchmarks, what their last
lines promise, one smoke run and the check of its last line."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = ROOT / "benchmarks"
SMOKE_TIMEOUT_S = 900  # one benchmark's smoke run; the slowest take a few minutes on a loaded machine


def benchmark_scripts() -> list[str]:
    """Every benchmark: the scripts in benchmarks/ that are not shared helpers (_common.py, _rl.py)."""
    return sorted(p.name for p in BENCHMARKS.glob("*.py") if not p.name.startswith("_"))


def last_lines() -> dict:
    """benchmarks/_common.py's LAST_LINES (what each benchmark's last line promises)."""
    spec = importlib.util.spec_from_file_location("benchmarks_common", BENCHMARKS / "_common.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up while being made
    spec.loader.exec_module(module)
    return module.LAST_LINES


@dataclass
class SmokeRun:
    script: str
    returncode: int | None  # None: killed at its time limit
    stdout: str
    stderr: str
    seconds: float
    ended_s: float = 0.0  # when it ended, in seconds from the first smoke run's start


# the process groups of the smoke runs under way (`end_smoke_runs` ends them)
_running: set[int] = set()


def smoke_run(script: str, env: dict[str, str]) -> SmokeRun:
    """One benchmark in smoke mode, in a process group of its own: at its time limit, or if the
    test session ends first, the whole group goes (torchrun ranks, engine servers, workers)."""
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, str(BENCHMARKS / script)], cwd=ROOT, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    _running.add(proc.pid)
    try:
        stdout, stderr = proc.communicate(timeout=SMOKE_TIMEOUT_S)
        returncode = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        returncode = None
    finally:
        _running.discard(proc.pid)
        _kill_group(proc.pid)  # whatever it left running
    return SmokeRun(script, returncode, stdout, stderr, time.perf_counter() - start)


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def end_smoke_runs() -> None:
    """Kill every smoke run still under way (the session ends before they do)."""
    for pid in list(_running):
        _kill_group(pid)


def session_dist(config) -> str:
    """How pytest-xdist hands the session's tests out (its --dist: "loadfile" as the Makefile's), or
    "no" without it; in a worker too, whose own --dist reads "no" (tests/conftest.py passes the
    session's down)."""
    return getattr(config, "workerinput", {}).get("session_dist") or config.getoption("dist", "no")


def smoke_chains(scripts: list[str], after: dict[str, str | None]) -> list[list[str]]:
    """`scripts`, and the benchmarks whose output they read (`after`), as chains to run one after
    another: each benchmark in the chain of the first one it (indirectly) reads, after what it
    reads; chains of several runs first (bench_placement's, the longest run of all)."""
    def reads(script: str) -> list[str]:  # what it reads, nearest first
        out = []
        while after.get(script):
            script = after[script]
            out.append(script)
        return out

    needed = {s for script in scripts for s in (script, *reads(script))}
    chains: dict[str, list[str]] = {}
    for script in sorted(needed, key=lambda s: (len(reads(s)), s)):  # what a benchmark reads comes first
        chains.setdefault((reads(script) or [script])[-1], []).append(script)
    return sorted(chains.values(), key=len, reverse=True)


# What several smoke runs read, made once before the first starts, by the benchmarks' own helper
# in a smoke run's environment: the demo's shards under the smoke folder, the demo's policy warm
# start on them, the tiny policy and judge (cached); so that no benchmark's time includes them
SHARED_INPUTS = """
import sys
sys.path.insert(0, "benchmarks")
from _rl import demo_data
from models.tiny import tiny_model_dir
from yatt_mm.demo.warmstart import warm_start

warm_start("policy", demo_data() / "train", quiet=True)
for kind in ("policy", "judge"):
    tiny_model_dir(kind)
"""


def last_line_problems(stdout: str, promise) -> list[str]:
    """What is wrong with a run's last line against its promise (a LastLine); empty when nothing."""
    lines = [line for line in stdout.splitlines() if line.strip()]
    if not lines:
        return ["printed nothing"]
    try:
        result = json.loads(lines[-1])
    except ValueError:
        return [f"the last line is not JSON: {lines[-1][:200]!r}"]
    if not isinstance(result, dict):
        return [f"the last line is not a JSON object: {lines[-1][:200]!r}"]
    installed = {m: importlib.util.find_spec(m) is not None for m in promise.numbers_if_installed}
    numbers = [*promise.numbers, *(k for m, keys in promise.numbers_if_installed.items() if installed[m] for k in keys)]
    nulls = [k for m, keys in promise.numbers_if_installed.items() if not installed[m] for k in keys]
    problems = [f"missing key {k!r}" for k in (*numbers, *promise.others, *nulls) if k not in result]
    for k in numbers:
        v = result.get(k)
        if k in result and (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)):
            problems.append(f"{k!r} is {v!r}, not a finite number")
    problems += [f"{k!r} is {result[k]!r}: null where its module is not installed" for k in nulls
                 if k in result and result[k] is not None]
    return problems
