"""Carrying out the device split on a rank: before each phase, each role gets the devices the
phase allots it (`Phase.devices`: "all", or "split" between rollout and judges), and after each
step the rank that owns the node's judge server decides the next split (yatt_mm/rl/split.py).

CPU: in a "split" phase every thread of the node's ranks may run on the rollout cores only and
every thread of the judge server's processes on the judge cores only, and this rank's torch
threads match its cores; in an "all" phase everything gets every core back, and under full
colocation the rollout and in-process judging phases run with their own thread counts
(`split.rollout_threads`, `split.judge_threads`). GPUs: the split is decided and logged, never
applied (see yatt_mm/rl/split.py).
"""

from __future__ import annotations

import math
import os
import time

from models import runtime
from yatt_mm.rl import cpu_pinning
from yatt_mm.rl.placement import Phase
from yatt_mm.rl.split import (Decision, Split, SplitConfig, calibrated_speeds, cpu_cores, decide, gpu_judge_devices,
                               initial_split)
from yatt_mm.simulate.replay import Wave, linear


class SplitRunner:
    def __init__(self, cfg: SplitConfig, placement: str, judges, timeline, teacher=None):
        self.cfg = cfg
        self.timeline = timeline
        # the judge servers this rank started, and a distillation teacher's server (it shares the
        # judges' side): this rank decides and applies its node's split
        served = [j for _, j, _ in judges.entries] + ([teacher] if teacher is not None else [])
        self.servers = [s.server for s in served if getattr(s, "server", None) is not None]
        self.owner = placement == "partial" and bool(self.servers)
        # the ranks of the node (their pids gathered when the server was shared), else this one
        self.rollout_pids = sorted({p for s in served for p in getattr(s, "node_pids", [])} or {os.getpid()})
        self.gpu = runtime.has_gpu()
        self.all_cores = cpu_pinning.usable_cores()
        self.cores = self.all_cores[: cfg.cores] if cfg.cores else self.all_cores
        if self.gpu:
            import torch

            units, notch = torch.cuda.device_count(), 1.0
        else:
            units, notch = len(self.cores), 0.5
        self.split: Split | None = initial_split(units, notch, cfg.judge_share) if units >= 2 * notch else None
        # how each side's speed follows its devices: measured (a CPU profile), else proportional
        self.speeds = calibrated_speeds(cfg.profile, units) if cfg.profile and not self.gpu else (linear, linear)
        self.start_threads = cpu_pinning.torch_threads()
        self.pinned = False
        self.decisions: list[Decision] = []
        now = time.time()  # what the devices were, for `yatt-mm simulate`
        timeline.record("devices", -1, now, now, device="gpu" if self.gpu else "cpu", units=units,
                        threads=self.start_threads, rollout_threads=cfg.rollout_threads or self.start_threads,
                        judge_threads=cfg.judge_threads or self.start_threads, placement=placement)
        if self.describe():
            print(self.describe(), flush=True)

    def describe(self) -> str:
        if not self.owner or self.split is None:
            return ""
        how = ("decided and logged, not applied on GPUs (moving judge servers between GPUs is not built)" if self.gpu
               else "threads pinned per side")
        return f"device split ({self.cfg.mode}): {self.split.describe()} at the start, {how}"

    def enter(self, phase: Phase) -> None:
        """Give the roles of `phase` their devices (a no-op where nothing changes)."""
        if self.gpu:
            return
        if phase.devices == "split" and self.owner and self.split is not None:
            rollout, judge = cpu_cores(self.split, self.cores)
            cpu_pinning.pin(self.rollout_pids, rollout)
            for server in self.servers:
                cpu_pinning.pin(cpu_pinning.session_pids(server.proc.pid), judge)
            # threads only for the cores the rollout side has to itself: a thread on the core it
            # shares with the judges would make every parallel kernel wait for it
            cpu_pinning.set_torch_threads(min(self.start_threads, max(1, math.floor(self.split.rollout))))
            self.pinned = True
            return
        if self.pinned:  # every core back, for training and the rest
            cpu_pinning.pin(self.rollout_pids, self.all_cores)
            for server in self.servers:
                cpu_pinning.pin(cpu_pinning.session_pids(server.proc.pid), self.all_cores)
            self.pinned = False
        roles = set(phase.levels())
        threads = (self.cfg.rollout_threads if roles == {"rollout"} else
                   self.cfg.judge_threads if roles == {"judge"} else 0) or self.start_threads
        if threads != cpu_pinning.torch_threads():
            cpu_pinning.set_torch_threads(threads)

    def decide(self, step: int, waves: list[Wave], measured_seconds: float) -> Decision | None:
        """After a step's rollout and judging: the split for the next step, logged in the
        timeline with its reason (only the rank that owns the node's judge server decides)."""
        if not self.owner or self.split is None:
            return None
        decision = decide(step, self.split, waves, measured_seconds, self.cfg, *self.speeds)
        now = time.time()
        detail = {"units": decision.split.units, "judge": decision.split.judge, "next": decision.next.judge,
                  "reason": decision.reason, "measured_seconds": decision.measured_seconds,
                  "predicted_seconds": decision.predicted_seconds}
        if self.gpu:
            detail["judge_devices"] = gpu_judge_devices(decision.next)
        self.timeline.record("split", step, now, now, **detail)
        self.decisions.append(decision)
        self.split = decision.next
        return decision
