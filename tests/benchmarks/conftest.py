"""The benchmarks' smoke runs (BENCH_SMOKE=1), each launched once a session, one at a time, in
one smoke output folder (temporary), after the inputs they share are made."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable

import pytest
from benchmark_smoke import ROOT, SHARED_INPUTS, SmokeRun, last_lines, smoke_run

_seconds: dict[str, float] = {}


@pytest.fixture(scope="session")
def smoke_env(tmp_path_factory) -> dict[str, str]:
    """The environment of a smoke run, with the inputs several benchmarks read already made."""
    env = {**os.environ, "BENCH_SMOKE": "1", "BENCH_SMOKE_DIR": str(tmp_path_factory.mktemp("bench-smoke"))}
    start = time.perf_counter()
    shared = subprocess.run([sys.executable, "-c", SHARED_INPUTS], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=600)
    assert shared.returncode == 0, shared.stderr[-3000:]
    _seconds["shared inputs"] = time.perf_counter() - start
    return env


@pytest.fixture(scope="session")
def smoke_runs(smoke_env) -> Callable[[str], SmokeRun]:
    """`run(script)`: its smoke run, launched once a session; the benchmark whose output it reads
    (LastLine.after) launched before it if it has not been yet."""
    runs: dict[str, SmokeRun] = {}
    promises = last_lines()

    def run(script: str) -> SmokeRun:
        after = getattr(promises.get(script), "after", None)
        if after is not None:
            run(after)
        if script not in runs:
            runs[script] = smoke_run(script, smoke_env)
            _seconds[script] = runs[script].seconds
        return runs[script]

    return run


def pytest_terminal_summary(terminalreporter):
    if _seconds:
        slowest_first = sorted(_seconds.items(), key=lambda item: -item[1])
        parts = ", ".join(f"{script.removesuffix('.py')} {seconds:.0f} s" for script, seconds in slowest_first)
        terminalreporter.write_line(f"benchmark smoke runs, {sum(_seconds.values()):.0f} s in all: {parts}")
