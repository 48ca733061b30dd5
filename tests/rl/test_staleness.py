"""`yatt-mm simulate --staleness K`: a synchronous run's timeline (in the format the RL loop writes,
every DP group's controller one file) replayed with rollout generating up to K versions ahead,
against hand computations; here (both sides on the same cores) and on a GPU profile."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from yatt_mm.cli import main as cli
from yatt_mm.simulate.cluster import ClusterWorkload, Model, fit_tp
from yatt_mm.simulate.profile import load_profile
from yatt_mm.simulate.staleness import pipeline, predict_cluster, predict_here, read_phases
from yatt_mm.simulate.trace import TraceError

ROOT = Path(__file__).resolve().parents[2]
H200 = ROOT / "configs" / "profiles" / "h200_sxm_node.yaml"


def _sync_run(run_dir: Path, generation: list[list[float]], train: float, pause: float, units: int = 2,
              cpu_share: float = 1.0, placement: str = "full", samples: int = 4) -> Path:
    """A synchronous run under full colocation: per step and DP group (a rank each) rollout then
    reward (half each) taking `generation[step][rank]` seconds at `cpu_share` cores, the groups
    that finish first waiting in the balance, then logprobs (a quarter of `train`) and the update,
    then sync and probe (`pause`), steps back to back."""
    run_dir.mkdir(parents=True)
    ranks = len(generation[0])
    spans = {r: [{"rank": r, "step": -1, "phase": "devices", "start": 0.0, "end": 0.0, "kind": "request",
                  "device": "cpu", "units": units, "threads": 1, "rollout_threads": 1, "judge_threads": 1,
                  "placement": placement}] for r in range(ranks)}
    t = 100.0
    for step, gens in enumerate(generation):
        slowest = max(gens)
        for r, g in enumerate(gens):
            out = spans[r]
            out.append({"rank": r, "step": step, "phase": "rollout", "start": t, "end": t + g / 2})
            out.append({"rank": r, "step": step, "phase": "generate", "start": t, "end": t + g / 2, "kind": "request",
                        "prompts": 1, "samples": samples, "cpu": g / 2 * cpu_share})
            for k in range(samples):
                done = t + g / 2 * (k + 1) / samples
                out.append({"rank": r, "step": step, "phase": "generated", "start": t, "end": done,
                            "kind": "request", "prompt": 0, "sample": k, "tokens": 2 + k})
            out.append({"rank": r, "step": step, "phase": "reward", "start": t + g / 2, "end": t + g})
            out.append({"rank": r, "step": step, "phase": "judge_batch", "start": t + g / 2, "end": t + g,
                        "kind": "request", "cpu": g / 2 * cpu_share, "responses": samples})
            # the balance: 0.01 s of its own, plus the wait for the slowest group
            out.append({"rank": r, "step": step, "phase": "balance", "start": t + g, "end": t + slowest + 0.01})
            b = t + slowest + 0.01
            out.append({"rank": r, "step": step, "phase": "logprobs", "start": b, "end": b + train / 4})
            out.append({"rank": r, "step": step, "phase": "train", "start": b + train / 4, "end": b + train})
            out.append({"rank": r, "step": step, "phase": "sync", "start": b + train, "end": b + train + pause / 2})
            out.append({"rank": r, "step": step, "phase": "probe", "start": b + train + pause / 2,
                        "end": b + train + pause})
        t += slowest + 0.01 + train + pause + 0.02  # 0.02 s outside any phase (metrics)
    for r, out in spans.items():
        (run_dir / f"timeline_rank{r}.jsonl").write_text("".join(json.dumps(s) + "\n" for s in out))
    (run_dir / "config.yaml").write_text("rollout:\n  sampling:\n    max_tokens: 8\n")
    return run_dir


def test_a_synchronous_run_is_read_per_dp_group_and_staleness_0_is_the_run_itself(tmp_path):
    run = read_phases(_sync_run(tmp_path / "run", [[1.0, 0.6], [0.4, 0.8], [0.9, 0.9]], train=1.2, pause=0.2))
    assert run.units == 2 and run.kind == "cpu" and len(run.steps) == 3
    first = run.steps[0]
    assert first.generation == pytest.approx({0: 1.0, 1: 0.6}) and first.slowest_generation == pytest.approx(1.0)
    assert first.generation_cpu == pytest.approx({0: 1.0, 1: 0.6})
    # training: logprobs + update, the balance's own 0.01 s (not the wait), the 0.02 s outside phases
    assert first.training == pytest.approx(1.2 + 0.01 + 0.02) and first.pause == pytest.approx(0.2)
    assert first.seconds == pytest.approx(1.0 + 0.01 + 1.2 + 0.2 + 0.02)
    same = predict_here(run, 0)
    assert same.predicted == pytest.approx(same.measured) and same.ratio == pytest.approx(1.0)


def test_ahead_by_one_the_step_is_the_longer_side_plus_the_copy(tmp_path):
    # wide cores (no CPU bound): generation 0.5 s, training 1 s -> train-bound at 1.0 + the copy
    run = read_phases(_sync_run(tmp_path / "train", [[0.5]] * 6, train=1.0, pause=0.2, units=64))
    r = predict_here(run, 1)
    assert r.predicted_seconds == pytest.approx(1.0 + 0.01 + 0.02 + 0.2) and r.bound == "train"
    assert r.measured_seconds == pytest.approx(0.5 + 0.01 + 1.0 + 0.2 + 0.02)
    # generation 2 s: rollout-bound at generation + the copy that pauses it
    run = read_phases(_sync_run(tmp_path / "rollout", [[2.0]] * 6, train=1.0, pause=0.2, units=64))
    r = predict_here(run, 1)
    assert r.predicted_seconds == pytest.approx(2.0 + 0.2) and r.bound == "rollout"
    assert r.ratio == pytest.approx(2.2 / (2.0 + 0.01 + 1.0 + 0.2 + 0.02))
    # the rollout runs one step ahead whatever k (rl/rollout_ahead.py): k = 2 predicts the same
    assert predict_here(run, 2).predicted == pytest.approx(r.predicted)
    # the first step generates its own samples first; the last has nothing to generate beside it
    assert r.predicted[0] == pytest.approx(2.0 + 2.2)
    assert r.predicted[-1] == pytest.approx(run.steps[-1].training + 0.2)


def test_on_shared_cores_the_cpu_both_sides_need_bounds_the_step(tmp_path):
    # two DP groups on two cores, each side using a whole core: overlapping gains nothing
    run = read_phases(_sync_run(tmp_path / "busy", [[1.0, 1.0]] * 5, train=1.0, pause=0.2))
    r = predict_here(run, 1)
    assert r.bound == "cpu" and r.predicted_seconds == pytest.approx(r.measured_seconds)  # (2 + 2 x 1.03) / 2 + 0.2
    # generation at a quarter of a core (waiting on its engine): the idle CPU is what the overlap gains
    run = read_phases(_sync_run(tmp_path / "idle", [[1.0, 1.0]] * 5, train=1.0, pause=0.2, cpu_share=0.25))
    r = predict_here(run, 1)
    assert r.bound == "cpu" and r.predicted_seconds == pytest.approx((2 * 0.25 + 2 * 1.03) / 2 + 0.2)
    # on four cores it is no longer the bound: the training side is
    run = read_phases(_sync_run(tmp_path / "wide", [[1.0, 1.0]] * 5, train=1.0, pause=0.2, cpu_share=0.25, units=4))
    r = predict_here(run, 1)
    assert r.bound == "train" and r.predicted_seconds == pytest.approx(1.03 + 0.2)


def test_the_slowest_group_still_sets_each_step():
    # two groups, each slow every other step: a step's training waits for both groups' samples,
    # generated beside it; its own 0.2 s of training hides under the 2 s of the slower group
    gens = [{0: 2.0, 1: 0.5}, {0: 0.5, 1: 2.0}] * 4
    sync, _ = pipeline(gens, [0.2] * 8, [0.0] * 8, ahead=False)
    ahead, critical = pipeline(gens, [0.2] * 8, [0.0] * 8, ahead=True)
    assert sync == pytest.approx([2.2] * 8)
    assert ahead == pytest.approx([4.0] + [2.0] * 6 + [0.2]) and critical[1:-1] == ["rollout"] * 6


def test_refused_input_names_the_fix(tmp_path, capsys):
    with pytest.raises(TraceError, match="no timeline_rank"):
        read_phases(tmp_path)
    partial = _sync_run(tmp_path / "partial", [[1.0]], train=1.0, pause=0.1, placement="partial")
    with pytest.raises(TraceError, match="run.placement=full, run.max_staleness=0"):
        read_phases(partial)
    run = _sync_run(tmp_path / "run", [[1.0]] * 3, train=1.0, pause=0.1)
    assert cli(["simulate", str(run), "--staleness", "0"]) == 2
    assert "--staleness must be >= 1" in capsys.readouterr().err
    assert cli(["simulate", str(run), "--staleness", "1", "--profile", str(H200), "--gpus", "16",
                "--rollout-gpus", "16"]) == 2
    assert "multiple of the policy's TP 1 below 16" in capsys.readouterr().err


def test_simulate_prints_the_prediction_here_and_on_a_gpu_profile(tmp_path, capsys):
    run = _sync_run(tmp_path / "run", [[2.0]] * 6, train=1.0, pause=0.2, units=64)
    assert cli(["simulate", str(run), "--staleness", "1"]) == 0
    out = capsys.readouterr().out
    summary = json.loads(out.splitlines()[-1])
    assert summary["bound"] == "rollout" and summary["step_time_ratio"] == pytest.approx(2.2 / 3.23, abs=1e-3)
    assert "held back by" in out and summary["generation_cpu_share"] == pytest.approx(1.0) and "of a core" not in out
    # generation at a quarter of a core: the CPU others may have taken looks idle, said so
    idle = _sync_run(tmp_path / "idle", [[2.0]] * 4, train=1.0, pause=0.2, cpu_share=0.25)
    assert cli(["simulate", str(idle), "--staleness", "1"]) == 0
    out = capsys.readouterr().out
    assert "generation got 0.25 of a core" in out and json.loads(out.splitlines()[-1])["generation_cpu_share"] == 0.25
    gpu = ["--profile", str(H200), "--gpus", "16", "--judge-b", "7"]
    assert cli(["simulate", str(run), "--staleness", "1", *gpu]) == 0
    summary = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert summary["gpus"] == 16 and 0 < summary["rollout_gpus"] < 16 and summary["bound"] in ("rollout", "train")
    parts = summary["async_parts"]
    assert summary["predicted_step_seconds"] == pytest.approx(max(parts["generation"], parts["training"])
                                                              + parts["copy"], abs=0.02)


def test_on_gpus_the_split_balances_the_sides_and_the_copy_is_the_weights_over_the_network():
    h200 = load_profile(H200)
    lengths = [1.0 if i % 10 == 0 else 0.1 for i in range(100)]  # a long tail
    work = ClusterWorkload(policy_params_b=7, judge_params_b=7, max_tokens=4096, responses_per_step=2048)
    best = predict_cluster(lengths, work, h200, 16)
    policy = Model(7e9, fit_tp(7e9, h200), h200)
    assert best.async_parts["copy"] == pytest.approx(policy.weight_bytes / (h200.network_gbs * 1e9))
    assert best.sync_seconds == pytest.approx(sum(best.sync_parts.values()))
    # no other split predicts a shorter step, and moving GPUs away from the bound side makes it worse
    others = [predict_cluster(lengths, work, h200, 16, r).async_seconds for r in range(1, 16)]
    assert best.async_seconds == pytest.approx(min(others))
    worse = predict_cluster(lengths, work, h200, 16, best.rollout_gpus + (-1 if best.bound == "rollout" else 1))
    assert worse.async_seconds > best.async_seconds
    # a trainer 4x as costly (a 4x larger policy judged by the same 7B judge) shifts GPUs to training
    big = predict_cluster(lengths, ClusterWorkload(policy_params_b=28, judge_params_b=7, max_tokens=4096,
                                                   responses_per_step=2048), h200, 16)
    assert big.rollout_gpus != best.rollout_gpus
