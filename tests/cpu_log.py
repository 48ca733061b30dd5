"""Each test's CPU seconds, for measuring a change to the suite (docs/development.md: wall times
on a shared 2-core machine vary by a quarter between identical runs; CPU time much less).

`pytest --cpu-log FILE ...` appends one JSON line per test: its node id, the CPU seconds of the
process that ran it and of every child process it waited for (a launch's torchrun, ranks, engines
and servers, once they have ended and been reaped), and its wall seconds. Under pytest-xdist
each worker appends its own tests' lines to the same file."""

from __future__ import annotations

import json
import resource
import time
from contextlib import contextmanager
from pathlib import Path


def cpu_seconds() -> float:
    """User + system seconds of this process and of its reaped children so far."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


@contextmanager
def logged(path: str | Path, name: str):
    """Append `name`'s CPU and wall seconds over the block to `path` (one JSON line, written with
    one append: lines from several processes do not interleave)."""
    cpu, wall = cpu_seconds(), time.perf_counter()
    try:
        yield
    finally:
        line = json.dumps({"test": name, "cpu_s": round(cpu_seconds() - cpu, 2),
                           "wall_s": round(time.perf_counter() - wall, 2)})
        with open(path, "a") as f:
            f.write(line + "\n")


def summary(path: str | Path, top: int = 10) -> list[str]:
    """The file's tests, most CPU first (`top` of them), and the total, as lines to print."""
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    rows.sort(key=lambda r: -r["cpu_s"])
    lines = [f"{r['cpu_s']:8.1f} CPU-s {r['wall_s']:7.1f} s  {r['test']}" for r in rows[:top]]
    return lines + [f"{sum(r['cpu_s'] for r in rows):8.1f} CPU-s in {len(rows)} tests ({path})"]
