"""The benchmarks' smoke runs (BENCH_SMOKE=1), each launched once a session, two at a time, in
one smoke output folder (temporary), after the inputs they share are made."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import pytest
from benchmark_smoke import (ROOT, SHARED_INPUTS, SmokeRun, end_smoke_runs, last_lines, session_dist, smoke_chains,
                             smoke_run)

SMOKES_AT_ONCE = 2  # smoke runs under way at once (docs/development.md: what it saves on two cores)

_shared_seconds: list[float] = []  # making the inputs the smoke runs share
_done: list[SmokeRun] = []  # the session's smoke runs, for its summary line


@pytest.fixture(scope="session")
def smoke_env(tmp_path_factory) -> dict[str, str]:
    """The environment of a smoke run, with the inputs several benchmarks read already made."""
    env = {**os.environ, "BENCH_SMOKE": "1", "BENCH_SMOKE_DIR": str(tmp_path_factory.mktemp("bench-smoke"))}
    start = time.perf_counter()
    shared = subprocess.run([sys.executable, "-c", SHARED_INPUTS], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=600)
    assert shared.returncode == 0, shared.stderr[-3000:]
    _shared_seconds.append(time.perf_counter() - start)
    return env


@pytest.fixture(scope="session")
def smoke_runs(request, smoke_env) -> Callable[[str], SmokeRun]:
    """`run(script)`: its smoke run, two at a time: a smoke run is mostly one process's imports and
    engine starts, so a second one uses the core the first leaves idle. A benchmark runs after the
    one whose output it reads (LastLine.after), in the same chain. All the session's selected smoke
    runs start with the first test that asks, where this process runs them all (no pytest-xdist,
    or `--dist loadfile` as the Makefile's); else each test's run starts when it asks."""
    whole_file_here = session_dist(request.config) in ("no", "each", "loadfile", "loadscope")
    scripts = [item.callspec.params["script"] for item in request.session.items
               if whole_file_here and "smoke_runs" in getattr(item, "fixturenames", ()) and hasattr(item, "callspec")]
    after = {script: promise.after for script, promise in last_lines().items()}
    futures: dict[str, Future] = {}
    pool = ThreadPoolExecutor(max_workers=SMOKES_AT_ONCE, thread_name_prefix="smoke")
    started = time.perf_counter()

    def run_chain(chain: list[str]) -> None:
        for script in chain:
            try:
                result = smoke_run(script, smoke_env)
            except BaseException as error:  # noqa: BLE001 - handed to the test that asks for it
                futures[script].set_exception(error)
                continue
            result.ended_s = time.perf_counter() - started
            _done.append(result)
            futures[script].set_result(result)

    def start(scripts: list[str]) -> None:
        for chain in smoke_chains(scripts, after):
            chain = [script for script in chain if script not in futures]  # what ran here already stays
            for script in chain:
                futures[script] = Future()
            pool.submit(run_chain, chain)

    start(scripts)

    def run(script: str) -> SmokeRun:
        if script not in futures:  # the tests of this process were not known at the start
            start([script])  # with what it reads, unless that ran here already
        return futures[script].result()

    yield run
    end_smoke_runs()
    pool.shutdown(wait=True, cancel_futures=True)


def pytest_sessionfinish(session):
    """The smoke runs' line for the session's summary (tests/conftest.py prints it, from a
    pytest-xdist worker too)."""
    if _done:
        seconds = {run.script.removesuffix(".py"): run.seconds for run in _done}
        seconds["shared inputs"] = _shared_seconds[0] if _shared_seconds else 0.0
        parts = ", ".join(f"{name} {s:.0f} s" for name, s in sorted(seconds.items(), key=lambda item: -item[1]))
        session.config.summary_lines.append(
            f"benchmark smoke runs, {sum(seconds.values()):.0f} s in all, {max(r.ended_s for r in _done):.0f} s from "
            f"the first start to the last end ({SMOKES_AT_ONCE} at a time): {parts}")
