"""Shared, expensive fixtures: built once per test session. The tests mirror the package
layout (tests/dataio, tests/models, ...); the helpers they share (dataio_helpers.py,
prep_media.py, subproc.py, and the torchrun workers in dist/) stay here, importable from every
folder."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

# A hermetic cache: tiny models, warm starts and decompressed shards are built by this session
# (and inherited by every child it starts), never read from a user's ~/.cache/yatt-mm, so a test
# run costs what a new machine pays and a bad entry from an earlier run cannot leak in.
# YATT_MM_TEST_CACHE names a folder to use instead (.ci/run passes one fresh folder to both of its
# pytest runs, so the slow run does not rebuild what the first one built). The workers of a
# pytest-xdist run (make test-slow) inherit the session's folder through it: one cache for all.
_own_cache = not os.environ.get("YATT_MM_TEST_CACHE")
if _own_cache:
    os.environ["YATT_MM_TEST_CACHE"] = tempfile.mkdtemp(prefix="yatt-mm-test-cache-")
os.environ["YATT_MM_CACHE"] = os.environ["YATT_MM_TEST_CACHE"]
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # the Ray prep test: no usage report
# gcsfs' experimental bucket-layout probe asks Google's gRPC control plane, which the local GCS
# server of the gs:// test does not speak (each probe waits out a 60 s timeout): off, as it is for
# a user of such a server (docs/data.md)
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")

# The launcher's CPU defaults for its ranks (yatt_mm/launch.py: an idle OpenMP thread sleeps at once
# instead of spinning first) for this process and every child it starts too: three test files at a
# time share two cores, and a thread spinning for work holds a core that another test's process
# needs. Set before torch loads libgomp, which reads it once (docs/development.md).
from yatt_mm.launch import CPU_RANK_ENV_DEFAULTS  # noqa: E402 - imports no torch

for _name, _value in CPU_RANK_ENV_DEFAULTS.items():
    os.environ.setdefault(_name, _value)

import models  # noqa: E402,F401 - installs the CPU runtime hooks before any test imports torchvision

_cache_seconds: dict[str, float] = {}


def _timed(what: str, build):
    start = time.perf_counter()
    try:
        return build()
    finally:
        _cache_seconds[what] = time.perf_counter() - start


def pytest_addoption(parser):
    parser.addoption("--cpu-log", metavar="FILE", default=None,
                     help="write each test's CPU seconds (its process and the children it waited for) to FILE as "
                          "JSON lines, and print the ten costliest (tests/cpu_log.py)")


def pytest_configure(config):
    config.summary_lines = []  # what the session's last lines say (the test cache's cost, the smoke runs')
    log = config.getoption("cpu_log")
    if log and not hasattr(config, "workerinput"):  # the session's process, not a pytest-xdist worker
        Path(log).write_text("")  # the workers append


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    log = item.config.getoption("cpu_log")
    if not log:
        yield
        return
    from cpu_log import logged

    with logged(log, item.nodeid):
        yield


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session):
    if _cache_seconds:
        parts = ", ".join(f"{k} {v:.0f} s" for k, v in _cache_seconds.items())
        session.config.summary_lines.append(f"test cache {os.environ['YATT_MM_CACHE']}: built {parts}")
    worker_output = getattr(session.config, "workeroutput", None)
    if worker_output is not None:  # a pytest-xdist worker: no terminal of its own; its lines go to the controller
        worker_output["summary_lines"] = session.config.summary_lines


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):  # pytest-xdist's controller, starting a worker (whose --dist reads "no")
    node.workerinput["session_dist"] = node.config.getoption("dist")  # benchmark_smoke.session_dist reads it


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):  # pytest-xdist's controller: a worker finished
    node.config.summary_lines += getattr(node, "workeroutput", {}).get("summary_lines", [])


def pytest_terminal_summary(terminalreporter):
    for line in terminalreporter.config.summary_lines:
        terminalreporter.write_line(line)
    log = terminalreporter.config.getoption("cpu_log")
    if log and Path(log).is_file():
        from cpu_log import summary

        for line in summary(log):
            terminalreporter.write_line(line)


def pytest_unconfigure(config):
    if _own_cache:
        shutil.rmtree(os.environ["YATT_MM_CACHE"], ignore_errors=True)


@pytest.fixture
def two_cores():
    """For the device-split tests: skipped on a one-core machine, but under CI (CI set) such a
    machine is a failure, so that CI never passes with them silently skipped."""
    cores = len(os.sched_getaffinity(0))
    if cores < 2:
        message = f"the device split needs two cores; this process may use {cores}"
        pytest.fail(message) if os.environ.get("CI") else pytest.skip(message)


@pytest.fixture(scope="session")
def demo_shards(tmp_path_factory) -> list[str]:
    """Overrides pointing a tiny config's train and eval shards at a few real shards: the
    launcher refuses shards that do not exist before anything starts, and a clean checkout has no
    runs/demo-data (`yatt-mm demo --data-only` makes it)."""
    from dataio.synth import write_shards

    out = tmp_path_factory.mktemp("demo-shards")
    write_shards(str(out), images=8, videos=0, samples_per_shard=8, seed=1, tasks=["colour"])
    return [f"data.shards=[{out}]", f"eval.shards=[{out}]"]


@pytest.fixture(scope="session")
def tiny_policy():
    from models.tiny import tiny_model_dir

    return _timed("tiny policy", lambda: tiny_model_dir("policy", seed=0))


@pytest.fixture(scope="session")
def rollout_engine(tiny_policy):
    """One in-process vLLM engine for the whole session (about 3-5 s to start on CPU)."""
    from yatt_mm.engines.engine import EngineConfig, RolloutEngine

    return RolloutEngine(EngineConfig(model=str(tiny_policy)))


@pytest.fixture(scope="session")
def warm_tools_policy(tmp_path_factory):
    """The tiny policy warm-started to call the `zoom` tool, then answer from the zoomed image
    (about 15 s once, then cached): multi-turn rollouts with a real tool call in most responses."""
    from dataio.synth import write_shards
    from yatt_mm.demo.warmstart import warm_start

    data = tmp_path_factory.mktemp("warm-tools-data") / "train"
    write_shards(str(data), images=64, videos=0, samples_per_shard=16, seed=6, tasks=["colour"])
    return _timed("warm tools policy", lambda: warm_start("tools", data, quiet=True))


@pytest.fixture(scope="session")
def tools_engine(warm_tools_policy):
    """An in-process engine of the tool-calling policy with `zoom` (session scope, as every
    in-process engine: vLLM's teardown of one takes down state the others share)."""
    from yatt_mm.engines.engine import EngineConfig, RolloutEngine
    from yatt_mm.engines.tools import ToolsConfig

    return RolloutEngine(EngineConfig(model=str(warm_tools_policy), tools=ToolsConfig(names=["zoom"], max_turns=3)))


@pytest.fixture(scope="session")
def warm_policy(tmp_path_factory):
    """The tiny policy after its short SFT warm start (about 15 s once, then cached): its groups
    get different rewards, so RL tests have real advantages, gradients and weight changes."""
    from dataio.synth import write_shards
    from yatt_mm.demo.warmstart import warm_start

    data = tmp_path_factory.mktemp("warm-data") / "train"
    write_shards(str(data), images=64, videos=0, samples_per_shard=16, seed=6, tasks=["colour"])
    return _timed("warm policy", lambda: warm_start("policy", data, quiet=True))


@pytest.fixture(scope="session")
def s3_store(tmp_path_factory):
    """moto's S3 server on 127.0.0.1, with authentication on (tests/s3_store.py), for the whole
    session: about 2 s to start."""
    from s3_store import S3Store

    store = _timed("S3 server", lambda: S3Store.start(log=tmp_path_factory.mktemp("s3-server") / "moto.log"))
    yield store
    store.stop()


@pytest.fixture(scope="session")
def s3_dataset(s3_store, tmp_path_factory):
    """A small dataset (images and frame sequences, 3 shards) on local disk and the same shards
    in the S3 server: (local directory, its s3:// URL)."""
    from dataio.synth import write_shards

    local = tmp_path_factory.mktemp("s3-dataset") / "ds"
    write_shards(str(local), images=20, videos=0, frame_sequences=4, samples_per_shard=8, seed=2)
    return local, s3_store.upload_dir(local, "train", "ds", "*.tar")
