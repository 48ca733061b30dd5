"""`yatt-mm simulate`'s parts: what a run's timeline holds (written by the real controller with a
real vLLM engine and judge), the replay under either placement, the CPU calibration, device
profiles, and the cluster model's behaviour on long-tailed and uniform length mixes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from PIL import Image

from yatt_mm.config import ConfigError
from yatt_mm.simulate.cluster import ClusterWorkload, best_partial, fit_tp, simulate_cluster
from yatt_mm.simulate.predict import alone, beside, best_split, predict
from yatt_mm.simulate.profile import CpuCalibration, load_profile
from yatt_mm.simulate.replay import Wave
from yatt_mm.simulate.trace import TraceError, WaveTrace, read_run

ROOT = Path(__file__).resolve().parents[2]
H100 = ROOT / "configs" / "profiles" / "h100_sxm_node.yaml"


@pytest.fixture(scope="module")
def full_run(tmp_path_factory, rollout_engine):
    """Two controller steps under full colocation on the session's vLLM engine, judged by an
    in-process judge on the same engine, written to a run directory's timeline."""
    from transformers import AutoProcessor

    from yatt_mm.engines.engine import SamplingConfig
    from yatt_mm.metrics import Timeline
    from yatt_mm.reward.genrm import InProcessJudge, JudgeConfig
    from yatt_mm.reward.judges import Judges
    from yatt_mm.reward.rewarder import RewardConfig, Rewarder
    from yatt_mm.rl.algorithms import AlgorithmConfig
    from yatt_mm.rl.controller import Controller
    from yatt_mm.rl.dynamic_sampling import DynamicSampler, DynamicSamplingConfig
    from yatt_mm.rl.placement import PhaseRunner, full_colocation
    from yatt_mm.rl.samples import Prompt, SampleBuilder
    from yatt_mm.rl.split import SplitConfig
    from yatt_mm.rl.split_runner import SplitRunner

    run_dir = tmp_path_factory.mktemp("sim") / "run"
    run_dir.mkdir()
    timeline = Timeline(0, run_dir / "timeline_rank0.jsonl")
    judges = Judges([("genrm", InProcessJudge(JudgeConfig(votes=1, max_tokens=2), engine=rollout_engine), 0.5)])
    phases = PhaseRunner(full_colocation(), {}, timeline)
    phases.split = SplitRunner(SplitConfig(), "full", judges, timeline)

    from yatt_mm.rl.sources import PromptSource

    class Source(PromptSource):
        def take(self, n):
            return [Prompt(f"p{i}", "What colour is it?", "red", images=[Image.new("RGB", (56, 56), "red")])
                    for i in range(n)]

    processor = AutoProcessor.from_pretrained(rollout_engine.cfg.model)
    ctrl = Controller(Source(), rollout_engine, Rewarder(RewardConfig(), judges),
                      DynamicSampler(DynamicSamplingConfig(enabled=False)), SamplingConfig(n=3, max_tokens=6),
                      SampleBuilder(processor, rollout_engine.prompt_text), AlgorithmConfig(), phases)
    for step in range(2):
        ctrl.step(step, 2)
    (run_dir / "config.yaml").write_text("rollout:\n  sampling:\n    max_tokens: 6\n")
    return run_dir


def test_a_run_is_read_back_sample_by_sample(full_run):
    trace = read_run(full_run)
    assert trace.placement == "full" and trace.kind == "cpu" and len(trace.steps) == 2
    for step in trace.steps:
        (wave,) = step.waves
        w = wave.wave
        assert w.responses == 6 and w.sample_ends == sorted(w.sample_ends)  # 2 prompts x 3 samples
        assert 0 < w.sample_ends[0] and w.sample_ends[-1] <= w.generation_seconds + 1e-6
        assert w.judge_seconds_per_response > 0 and wave.rollout_cpu > 0 and wave.judge_cpu > 0
        assert w.sample_tokens and max(w.sample_tokens) <= 6
        assert step.rollout_reward_seconds >= w.generation_seconds


def test_replaying_a_run_under_its_own_placement_adds_up_and_partial_never_loses_alone(full_run):
    trace = read_run(full_run)
    full = predict(trace, "full", None)
    for step, seconds in zip(trace.steps, full.rollout_reward_seconds):
        w = step.waves[0].wave
        assert seconds == pytest.approx(w.generation_seconds + step.switch_seconds
                                        + w.judge_seconds_per_response * w.responses)
    # with nothing slower beside each other, judging while generating can only save time
    partial = predict(trace, "partial", None, judge_units=1.0)
    assert all(p <= f + 1e-9 for p, f in zip(partial.rollout_reward_seconds, full.rollout_reward_seconds))
    assert sum(partial.rollout_reward_seconds) < sum(full.rollout_reward_seconds)
    idle_rollout, idle_judges = partial.idle_share()
    assert 0 <= idle_rollout < 1 and 0 <= idle_judges < 1


def test_the_calibration_carries_waves_between_placements():
    cal = CpuCalibration(rollout_speed={0.5: 0.5, 1.0: 0.8, 1.5: 0.9}, judge_cost={0.5: 4.0, 1.0: 2.0, 1.5: 1.5})
    measured = WaveTrace(Wave(1.0, [0.5, 1.0], 0.2), "partial", 1.0, 1.2)
    base = alone(measured, cal)  # alone on every core: generation 0.8x the time, judging half the cost
    assert base.generation_seconds == pytest.approx(0.8) and base.sample_ends == pytest.approx([0.4, 0.8])
    assert base.judge_seconds_per_response == pytest.approx(0.1)
    back = beside(base, 1.0, cal)
    assert back.generation_seconds == pytest.approx(1.0) and back.judge_seconds_per_response == pytest.approx(0.2)
    # between measured points the table is read linearly
    assert beside(base, 1.25, cal).judge_seconds_per_response == pytest.approx(0.1 * 1.75)


def test_best_split_searches_only_with_a_calibration(full_run):
    trace = read_run(full_run)
    cal = CpuCalibration(rollout_speed={0.5: 1.0, 1.0: 1.0, 1.5: 0.5}, judge_cost={0.5: 1.0, 1.0: 1.0, 1.5: 1.0})
    # generation loses nothing until the judges take 1.5 cores: the split chosen keeps it, and no
    # other split replays faster (1.5 cores of judges halves generation's speed: strictly slower)
    best = best_split(trace, cal)
    seconds = {j: sum(predict(trace, "partial", cal, j).rollout_reward_seconds) for j in (0.5, 1.0, 1.5)}
    assert best.judge_units in (0.5, 1.0) and sum(best.rollout_reward_seconds) == min(seconds.values())
    assert seconds[1.5] > min(seconds[0.5], seconds[1.0])
    assert best_split(trace, None).judge_units == trace.units / 2


def test_bad_run_dirs_and_profiles_are_refused_naming_the_fix(tmp_path, full_run):
    with pytest.raises(TraceError, match="not a directory"):
        read_run(tmp_path / "nothing")
    with pytest.raises(TraceError, match="no timeline_rank"):
        read_run(tmp_path)
    old = tmp_path / "old"
    old.mkdir()
    lines = [ln for ln in (full_run / "timeline_rank0.jsonl").read_text().splitlines() if '"devices"' not in ln]
    (old / "timeline_rank0.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(TraceError, match="rerun it with this version"):
        read_run(old)
    with pytest.raises(ConfigError, match="shipped ones are configs/profiles/"):
        load_profile(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\nkind: gpu\nmemory_gb: 80\nbf16_tflops: 989\nhost_link_gbs: 64\n")
    with pytest.raises(ConfigError, match="memory_bandwidth_tbs > 0"):
        load_profile(bad)
    bad.write_text("name: x\nkind: cpu\ndevices_per_node: 2\n")
    with pytest.raises(ConfigError, match="python -m yatt_mm.simulate.calibrate"):
        load_profile(bad)
    bad.write_text("name: x\nkind: gpu\nmemory_bandwith_tbs: 3\n")
    with pytest.raises(ConfigError, match="did you mean 'memory_bandwidth_tbs'"):
        load_profile(bad)


def _long_tail(n: int = 200) -> list[float]:
    """Most responses short, one in ten at max_tokens."""
    return [1.0 if i % 10 == 0 else 0.05 + 0.1 * (i % 7) / 7 for i in range(n)]


def test_the_cluster_model_sees_a_long_tail_waste_the_rollout_gpus_and_partial_fill_them():
    h100 = load_profile(H100)
    assert fit_tp(7e9, h100) == 1 and fit_tp(32e9, h100) == 2 and fit_tp(72e9, h100) == 4
    work = ClusterWorkload(policy_params_b=7, judge_params_b=7, max_tokens=8192, responses_per_step=4096,
                           judge_tokens=64)
    uniform = [0.5] * 200
    tail_full = simulate_cluster(_long_tail(), work, h100, 64, "full")
    flat_full = simulate_cluster(uniform, work, h100, 64, "full")
    assert tail_full.rollout_utilisation < flat_full.rollout_utilisation  # the tail's few sequences per step
    tail_ratio = best_partial(_long_tail(), work, h100, 64).seconds / tail_full.seconds
    flat_ratio = best_partial(uniform, work, h100, 64).seconds / flat_full.seconds
    assert tail_ratio < flat_ratio  # judging beside the tail pays where judging after a flat batch cannot
    assert tail_full.switch_seconds > best_partial(_long_tail(), work, h100, 64).switch_seconds
    with pytest.raises(ValueError, match="multiple of the judge's TP"):
        simulate_cluster(uniform, ClusterWorkload(judge_params_b=32), h100, 8, "partial", judge_per_node=3)


def test_the_shipped_profiles_load():
    for path in sorted((ROOT / "configs" / "profiles").glob("*.yaml")):
        profile = load_profile(path)
        assert profile.name and profile.source, path
        if profile.kind == "cpu":
            assert profile.calibration.rollout_speed and profile.calibration.judge_cost
    assert json.loads(json.dumps(ClusterWorkload().__dict__))["votes"] == 2
