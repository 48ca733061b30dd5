"""The report: one entry per stage, rewritten whole to $OUT/gpu_check.json as each stage ends."""

from __future__ import annotations

import json
import os
import time
import traceback
from pathlib import Path

import torch

from gpu_stages.common import free


# the family stages' tiny models (models/tiny.py kinds)
TINY_KIND = {"qwen3vl": "qwen3vl", "qwen3vl_moe": "qwen3vlmoe", "qwen35": "qwen35", "qwen35_moe": "qwen35moe"}
STAGES = ("comm", "build", "parity", "rl", "memory", "offload", "checkpoint", "lora", *TINY_KIND, "speed")
# the stages each stage needs: without them it is skipped, and --only runs them too
NEEDS = {"parity": ("build",), "rl": ("comm", "build"), "memory": ("rl",), "offload": ("rl",), "checkpoint": ("rl",),
         "lora": ("rl",),
         **{kind: ("comm",) for kind in TINY_KIND}, "speed": ("rl",)}
FAULT_ENV = "YATT_MM_GPU_CHECK_FAIL"


class TimeUp(BaseException):
    """SIGTERM (gpu_check.sh's `timeout`): not an Exception, so no library's handler swallows it."""


def on_sigterm(signum, frame):
    raise TimeUp()


class Report:
    """The report: run facts and one entry per stage, rewritten whole to `path` after every change."""

    def __init__(self, path: Path, facts: dict, selected: set[str]):
        self.path = path
        self.selected = selected
        self.data: dict = {**facts, "ok": False, "stages": {s: {"status": "pending"} for s in STAGES}}
        self.write()

    def write(self) -> None:
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(self.data, indent=1, default=str))
        os.replace(tmp, self.path)  # atomic: a reader or a kill never sees half a file

    def status(self, name: str) -> str:
        return self.data["stages"][name]["status"]

    def ran(self, name: str) -> bool:
        return self.status(name) in ("ok", "failed")

    def run(self, name: str, fn):
        """Run stage `name` (fn() -> figures, optionally with "checks": {check: bool}); record
        ok / failed (a check did not hold) / error (raised) / skipped (not selected, or a stage
        it NEEDS did not run). Returns fn's figures or None."""
        if name not in self.selected:
            return self._end(name, {"status": "skipped", "reason": "not in --only"})
        missing = [n for n in NEEDS.get(name, ()) if not self.ran(n)]
        if missing:
            return self._end(name, {"status": "skipped", "reason": f"needs {', '.join(missing)}, which did not run"})
        self.data["stages"][name] = {"status": "running"}
        self.write()
        print(f"== {name}", flush=True)
        start = time.perf_counter()
        try:
            if os.environ.get(FAULT_ENV) == name:
                raise RuntimeError(f"fault injected by {FAULT_ENV}={name} (tests/cli/test_gpu_check.py only)")
            figures = fn() or {}
        except TimeUp:
            self._end(name, {"status": "error", "error": "stopped by the time limit (SIGTERM) during this stage",
                             "seconds": time.perf_counter() - start})
            for other in STAGES:
                if self.status(other) == "pending":
                    self.data["stages"][other] = {"status": "skipped", "reason": "time limit"}
            self.write()
            raise
        except Exception as e:  # noqa: BLE001 - recorded, and the other stages still run
            traceback.print_exc()
            self._end(name, {"status": "error", "error": f"{type(e).__name__}: {e}"[:2000],
                             "where": traceback.format_exc().strip().splitlines()[-3:],
                             "seconds": time.perf_counter() - start})
            del e  # its frames hold the stage's models: free them for the stages after
            free(torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu"))
            return None
        checks = figures.get("checks", {})
        status = "ok" if all(checks.values()) else "failed"
        self._end(name, {"status": status, **figures, "seconds": round(time.perf_counter() - start, 2)})
        return figures

    def _end(self, name: str, entry: dict) -> None:
        self.data["stages"][name] = entry
        self.write()
        shown = {k: v for k, v in entry.items() if k not in ("where",)}
        print(f"   {name}: {json.dumps(shown, default=str)[:1500]}", flush=True)
        return None

    def finish(self) -> dict:
        self.data["ok"] = all(self.status(s) == "ok" for s in STAGES if s in self.selected)
        self.data["plan_vs_measured"] = plan_vs_measured(self.data["stages"])
        self.write()
        return self.data


def with_needs(names: set[str]) -> set[str]:
    unknown = names - set(STAGES)
    if unknown:
        raise SystemExit(f"gpu_check: --only: unknown stage(s) {sorted(unknown)}; stages: {', '.join(STAGES)}")
    out, todo = set(), list(names)
    while todo:
        name = todo.pop()
        if name not in out:
            out.add(name)
            todo.extend(NEEDS.get(name, ()))
    return out


def plan_vs_measured(stages: dict) -> dict:
    """Every {"plan", "measured"} pair the stages recorded, as "stage.figure": [plan, measured]."""
    out = {}
    for stage, entry in stages.items():
        for key, value in entry.items():
            if isinstance(value, dict) and {"plan", "measured"} <= value.keys():
                out[f"{stage}.{key}"] = [value["plan"], value["measured"]]
    # (the plan's CUDA_CONTEXT_GIB is what stays outside the allocator after training, compared in
    # memory.outside_allocator_gib; comm's context + NCCL right after start is a part of it)
    return out


def print_plan_vs_measured(pairs: dict) -> None:
    if pairs:
        print(f"{'plan vs measured':<34}{'plan':>10}{'measured':>10}")
        for key, (p, m) in pairs.items():
            print(f"  {key:<32}{p:>10.3f}{m:>10.3f}")
