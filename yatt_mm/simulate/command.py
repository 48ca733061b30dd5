"""`yatt-mm simulate RUN_DIR`: a run replayed under full and partial colocation.

With `--staleness K`: the run (synchronous) predicted at run.max_staleness K instead
(yatt_mm/simulate/staleness.py), here or on a GPU profile. Otherwise:
without a profile, or with a CPU profile (its calibration), the run's own steps are replayed on
the machine it ran on (yatt_mm/simulate/predict.py); with a GPU profile, the run's length mix
is scaled to a cluster of `--gpus` GPUs (yatt_mm/simulate/cluster.py). Prints, per placement,
the rollout+reward and step seconds, each role's idle share and utilisation, draws the
simulated timelines as a PNG, and ends with one JSON line.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from yatt_mm.simulate.cluster import ClusterResult, ClusterWorkload, best_partial, simulate_cluster
from yatt_mm.simulate.draw import draw_timelines
from yatt_mm.simulate.predict import PlacementResult, best_split, predict
from yatt_mm.simulate.profile import DeviceProfile, load_profile
from yatt_mm.simulate.staleness import generation_cpu_share, predict_cluster, predict_here, read_phases
from yatt_mm.simulate.trace import RunTrace, read_run


def run_simulate(run_dir: str, placement: str = "both", profile_path: str | None = None, gpus: int = 0,
                 rank: int | None = None, out: str | None = None, workload: ClusterWorkload | None = None,
                 staleness: int | None = None, rollout_gpus: int = 0) -> int:
    profile = load_profile(profile_path) if profile_path else None
    if staleness is not None:  # asynchronous RL predicted from this synchronous run
        summary = _staleness(run_dir, staleness, profile, gpus, rank, workload or ClusterWorkload(), rollout_gpus)
        print(json.dumps(summary))
        return 0
    trace = read_run(run_dir, rank)
    png = Path(out) if out else Path(run_dir) / f"simulated_{'cluster' if profile and profile.kind == 'gpu' else 'here'}.png"
    if profile is not None and profile.kind == "gpu":
        summary = _cluster(trace, profile, gpus or profile.devices_per_node, placement, workload or ClusterWorkload(), png)
    else:
        summary = _here(trace, profile, placement, png)
    print(f"timelines: {png}")
    print(json.dumps(summary))
    return 0


def _placements(placement: str) -> list[str]:
    if placement not in ("full", "partial", "both"):
        raise ValueError(f"--placement must be full, partial or both, got {placement!r}")
    return ["full", "partial"] if placement == "both" else [placement]


def _here(trace: RunTrace, profile: DeviceProfile | None, placement: str, png: Path) -> dict:
    cal = profile.calibration if profile is not None else None
    measured = statistics.median(s.rollout_reward_seconds for s in trace.steps)
    print(f"{trace.run_dir}: {len(trace.steps)} steps under {trace.placement} colocation on {trace.units} "
          f"{trace.kind} cores, rollout+reward measured {measured:.2f} s/step (median)")
    if cal is None:
        print("no CPU profile: the replay assumes a streamed response costs the judge server what batched "
              "in-process judging costs, and generation runs as fast beside it (pass --profile "
              "configs/profiles/cpu_2core.yaml for this machine's measured factors)")
    results: list[PlacementResult] = []
    for p in _placements(placement):
        results.append(predict(trace, "full", cal) if p == "full" else best_split(trace, cal))
    print(f"{'placement':<10} {'judges':>8} {'rollout+reward s':>17} {'step s':>8} {'idle rollout':>13} "
          f"{'idle judges':>12} {'util rollout':>13} {'util judges':>12}")
    summary = {"run_dir": str(trace.run_dir), "measured_placement": trace.placement,
               "measured_rollout_reward_seconds": round(measured, 3), "units": trace.units}
    for r in results:
        (idle_r, idle_j), (util_r, util_j) = r.idle_share(), r.utilisation()
        rr, step = statistics.median(r.rollout_reward_seconds), statistics.median(r.step_seconds)
        judges = f"{r.judge_units:g} cores" if r.placement == "partial" else "all"
        print(f"{r.placement:<10} {judges:>8} {rr:>17.2f} {step:>8.2f} {idle_r:>13.0%} {idle_j:>12.0%} "
              f"{util_r:>13.0%} {util_j:>12.0%}")
        summary[r.placement] = {"rollout_reward_seconds": round(rr, 3), "step_seconds": round(step, 3),
                                "judge_units": r.judge_units, "idle_rollout": round(idle_r, 3),
                                "idle_judges": round(idle_j, 3), "utilisation_rollout": round(util_r, 3),
                                "utilisation_judges": round(util_j, 3)}
    if len(results) == 2:
        summary["ratio"] = round(summary["partial"]["rollout_reward_seconds"]
                                 / summary["full"]["rollout_reward_seconds"], 3)
    rows = []
    middle = len(trace.steps) // 2
    for r in results:
        waves_per_step = max(1, len(r.waves) // len(trace.steps))
        base, replay = r.waves[middle * waves_per_step]
        lanes = {"rollout": [(0.0, replay.generation_seconds)], "judges": list(replay.judging)}
        if r.placement == "full" and replay.judging:
            lanes["switch"] = [(replay.generation_seconds, replay.judging[0][0])]
        rows.append((f"{r.placement} colocation" + (f", judges on {r.judge_units:g} cores" if r.placement == "partial"
                                                     else ""), lanes))
    draw_timelines(rows, png, f"simulated step {trace.steps[middle].step + 1} of {trace.run_dir.name}")
    return summary


def _cluster(trace: RunTrace, profile: DeviceProfile, gpus: int, placement: str, work: ClusterWorkload,
             png: Path) -> dict:
    work.validate()
    lengths = _length_mix(trace, profile, gpus, work)
    results: list[ClusterResult] = []
    for p in _placements(placement):
        results.append(simulate_cluster(lengths, work, profile, gpus, "full") if p == "full"
                       else best_partial(lengths, work, profile, gpus))
    print(f"{'placement':<10} {'judge GPUs':>11} {'rollout+reward s':>17} {'step s':>8} {'generation s':>13} "
          f"{'switch s':>9} {'idle rollout':>13} {'idle judges':>12} {'util rollout':>13} {'util judges':>12}")
    summary = {"run_dir": str(trace.run_dir), "profile": profile.name, "gpus": gpus,
               "workload": work.__dict__}
    for r in results:
        print(f"{r.placement:<10} {r.judge_gpus:>11} {r.seconds:>17.1f} {r.seconds + r.train_seconds:>8.1f} "
              f"{r.generation_seconds:>13.1f} "
              f"{r.switch_seconds:>9.1f} {r.rollout_idle:>13.0%} {r.judge_idle:>12.0%} {r.rollout_utilisation:>13.0%} "
              f"{r.judge_utilisation:>12.0%}")
        summary[r.placement] = {"rollout_reward_seconds": round(r.seconds, 2), "judge_gpus": r.judge_gpus,
                                "step_seconds": round(r.seconds + r.train_seconds, 2),
                                "generation_seconds": round(r.generation_seconds, 2),
                                "switch_seconds": round(r.switch_seconds, 2),
                                "idle_rollout": round(r.rollout_idle, 3), "idle_judges": round(r.judge_idle, 3),
                                "utilisation_rollout": round(r.rollout_utilisation, 3),
                                "utilisation_judges": round(r.judge_utilisation, 3)}
    if len(results) == 2:
        full, partial = results
        summary["ratio"] = round(partial.seconds / full.seconds, 3)
        winner = "partial" if partial.seconds < full.seconds else "full"
        print(f"{winner} colocation wins: partial/full rollout+reward {summary['ratio']:.2f} "
              f"(partial takes {abs(1 - summary['ratio']):.0%} {'less' if winner == 'partial' else 'more'} time)")
    rows = [(f"{r.placement} colocation, judges on {r.judge_gpus} of {gpus} GPUs",
             {"rollout": r.rollout_busy, "judges": r.judge_busy}) for r in results]
    draw_timelines(rows, png, f"simulated step on {gpus} x {profile.name}")
    return summary


def _length_mix(trace: RunTrace, profile: DeviceProfile, gpus: int, work: ClusterWorkload) -> list[float]:
    """The run's response lengths as shares of its max_tokens: what the cluster model scales."""
    max_tokens = trace.config.get("rollout", {}).get("sampling", {}).get("max_tokens") or max(
        t for s in trace.steps for w in s.waves for t in w.wave.sample_tokens)
    lengths = [t / max_tokens for s in trace.steps for w in s.waves for t in w.wave.sample_tokens]
    tail = sum(x >= 1 for x in lengths) / len(lengths)
    print(f"{trace.run_dir}: {len(lengths)} responses, median {statistics.median(lengths):.0%} of max_tokens, "
          f"{tail:.0%} at max_tokens; scaled to {work.policy_params_b:g}B policy, {work.judge_params_b:g}B judge, "
          f"max_tokens {work.max_tokens}, {work.responses_per_step} responses a step on {gpus} x {profile.name}")
    return lengths


def _staleness(run_dir: str, k: int, profile: DeviceProfile | None, gpus: int, rank: int | None,
               work: ClusterWorkload, rollout_gpus: int) -> dict:
    """`--staleness K`: the step time of this synchronous run with each controller generating up
    to K versions ahead (yatt_mm/simulate/staleness.py), here or on a GPU profile."""
    if k < 1:
        raise ValueError(f"--staleness must be >= 1 (the synchronous run is staleness 0), got {k}")
    if profile is not None and profile.kind == "gpu":
        gpus = gpus or profile.devices_per_node
        lengths = _length_mix(read_run(run_dir, rank), profile, gpus, work)
        c = predict_cluster(lengths, work, profile, gpus, rollout_gpus)
        print(f"synchronous, colocated on {gpus} GPUs: {c.sync_seconds:.1f} s/step ("
              + ", ".join(f"{name} {v:.1f}" for name, v in c.sync_parts.items()) + ")")
        print(f"staleness {k}, rollout on {c.rollout_gpus} GPUs and training on {gpus - c.rollout_gpus}: "
              f"{c.async_seconds:.1f} s/step (" + ", ".join(f"{n} {v:.1f}" for n, v in c.async_parts.items())
              + f"), {c.bound}-bound")
        print(f"step_time_ratio {c.ratio:.2f}")
        return {"run_dir": run_dir, "staleness": k, "profile": profile.name, "gpus": gpus,
                "rollout_gpus": c.rollout_gpus, "sync_step_seconds": round(c.sync_seconds, 2),
                "predicted_step_seconds": round(c.async_seconds, 2), "step_time_ratio": round(c.ratio, 3),
                "bound": c.bound, "sync_parts": {n: round(v, 2) for n, v in c.sync_parts.items()},
                "async_parts": {n: round(v, 2) for n, v in c.async_parts.items()}, "workload": work.__dict__}
    run = read_phases(run_dir)
    r = predict_here(run, k)
    print(f"{run_dir}: {len(run.steps)} synchronous steps on {run.units} {run.kind} cores, "
          f"{len({g for s in run.steps for g in s.generation})} DP groups")
    print(f"{'step':>4} {'generation s':>13} {'training s':>11} {'pause s':>8} {'measured s':>11} "
          f"{'staleness ' + str(k) + ' s':>13}  held back by")
    for s, p, c in zip(run.steps, r.predicted, r.critical):
        print(f"{s.step + 1:>4} {s.slowest_generation:>13.2f} {s.training:>11.2f} {s.pause:>8.2f} {s.seconds:>11.2f} "
              f"{p:>13.2f}  {c}")
    print(f"steady state (steps {r.steady_from + 1}-{r.steady_to}, means): measured {r.measured_seconds:.2f} s, "
          f"predicted at staleness {k} {r.predicted_seconds:.2f} s: step_time_ratio {r.ratio:.2f}, {r.bound}-bound")
    share = generation_cpu_share(run)
    if share is not None and share < 0.8:
        print(f"generation got {share:.2f} of a core (median): if other jobs shared this machine during the run, "
              "the CPU they took looks idle here and the prediction is optimistic")
    return {"run_dir": run_dir, "staleness": k, "units": run.units, "steady_steps": [r.steady_from + 1, r.steady_to],
            "generation_cpu_share": round(share, 3) if share is not None else None,
            "measured_step_seconds": round(r.measured_seconds, 3),
            "predicted_step_seconds": round(r.predicted_seconds, 3), "step_time_ratio": round(r.ratio, 3),
            "bound": r.bound}
