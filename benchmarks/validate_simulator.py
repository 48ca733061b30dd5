"""Does `yatt-mm simulate` predict what bench_placement measured? Each kept run is replayed
under the other placement with this machine's CPU profile (configs/profiles/cpu_2core.yaml,
measured by `python -m yatt_mm.simulate.calibrate`, outside the RL loop), and the prediction is
compared with the median the other placement's own runs measured: full colocation predicted
from the partial runs' timelines, partial colocation (at the splits those runs used) from the
full runs' timelines. The first step of each run is left out, as bench_placement does.

Run after benchmarks/bench_placement.py (which keeps its runs under runs/bench-placement; in a
smoke run, BENCH_SMOKE=1, both use the smoke output folder instead of runs/).
Writes runs/bench-placement/simulator_validation.png (the committed figure in benchmarks/results/
changes only when someone copies a new one over it). Last line: JSON with the measured and
predicted medians and the errors.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from yatt_mm.simulate.predict import predict  # noqa: E402
from yatt_mm.simulate.profile import load_profile  # noqa: E402
from yatt_mm.simulate.trace import read_run  # noqa: E402
from _common import output_root, shown  # noqa: E402

RUNS = output_root() / "bench-placement"
FIGURE = RUNS / "simulator_validation.png"  # beside the runs; benchmarks/results/ holds the committed one


def uncontended(step, units: int) -> bool:
    """Whether the rollout side got the CPU its cores give it while generating (80% of it); in
    the steps that fail this, other tenants of the machine took the rest, which no placement
    model of this machine accounts for."""
    wave = step.waves[0]
    expected = min(1.0, units - wave.judge_units) if wave.placement == "partial" else 1.0
    return (wave.rollout_cpu or 0.0) / max(wave.wave.generation_seconds, 1e-9) >= 0.8 * expected


def validate(profile_path: str = str(ROOT / "configs" / "profiles" / "cpu_2core.yaml"),
             contended: bool = True) -> dict | None:
    """The kept runs replayed under the other placement; measured vs predicted medians (with
    `contended` False: only the steps no other tenant slowed, None when a placement has none)."""
    cal = load_profile(profile_path).calibration
    traces = {}
    for run in sorted(RUNS.glob("*-*")):
        trace = read_run(run)
        trace.steps = [s for s in trace.steps[1:] if contended or uncontended(s, trace.units)]  # first: start-up
        traces.setdefault(trace.placement, []).append(trace)
    traces = {p: [t for t in ts if t.steps] for p, ts in traces.items()}
    if set(p for p, ts in traces.items() if ts) != {"full", "partial"}:
        if not contended:  # every step of a placement slowed by other tenants: nothing to compare
            return None
        sys.exit(f"need runs of both placements under {RUNS}: run benchmarks/bench_placement.py first")
    # partial colocation is compared at the split most of its steps ran with (the dynamic split
    # may have tried others), full colocation over every step
    splits = [s.waves[0].judge_units for t in traces["partial"] for s in t.steps]
    split = max(sorted(set(splits)), key=splits.count)
    for t in traces["partial"]:
        t.steps = [s for s in t.steps if s.waves[0].judge_units == split]
    traces["partial"] = [t for t in traces["partial"] if t.steps]
    measured = {p: statistics.median(s.rollout_reward_seconds for t in ts for s in t.steps) for p, ts in traces.items()}
    predicted = {
        "full": statistics.median(x for t in traces["partial"] for x in predict(t, "full", cal).rollout_reward_seconds),
        "partial": statistics.median(x for t in traces["full"]
                                     for x in predict(t, "partial", cal, split).rollout_reward_seconds),
    }
    same = {p: statistics.median(x for t in ts for x in predict(t, p, cal, split if p == "partial" else None)
                                 .rollout_reward_seconds) for p, ts in traces.items()}
    error = {p: predicted[p] / measured[p] - 1 for p in measured}
    for p in ("full", "partial"):
        other = "partial" if p == "full" else "full"
        print(f"{p}: measured {measured[p]:.2f} s/step; predicted from the {other} runs {predicted[p]:.2f} s "
              f"({error[p]:+.0%}); replayed from its own runs {same[p]:.2f} s")
    result = {"measured_full": round(measured["full"], 3), "predicted_full_from_partial": round(predicted["full"], 3),
              "error_full": round(error["full"], 3), "measured_partial": round(measured["partial"], 3),
              "predicted_partial_from_full": round(predicted["partial"], 3), "error_partial": round(error["partial"], 3),
              "judge_cores": split, "within_15pct": all(abs(e) <= 0.15 for e in error.values()),
              "measured_ratio": round(measured["partial"] / measured["full"], 3),
              "predicted_ratio": round(predicted["partial"] / predicted["full"], 3),
              "steps": {p: sum(len(t.steps) for t in ts) for p, ts in traces.items()},
              "profile": str(Path(profile_path).relative_to(ROOT)) if Path(profile_path).is_relative_to(ROOT)
              else profile_path, "figure": shown(FIGURE)}
    return result


def main(*args: str) -> None:
    result = validate(*args)
    # None where other tenants slowed every step of a placement (a loaded machine, or a smoke
    # run's single step): the figure then shows every step only
    quiet = validate(*args, contended=False)
    split = result["judge_cores"]
    bars = [("full, every step", result["measured_full"], result["predicted_full_from_partial"]),
            (f"partial ({split:g} judge cores),\nevery step", result["measured_partial"],
             result["predicted_partial_from_full"])]
    if quiet is not None:
        bars += [("full, steps no other\ntenant slowed", quiet["measured_full"], quiet["predicted_full_from_partial"]),
                 (f"partial ({quiet['judge_cores']:g} judge cores),\nsteps no other tenant slowed",
                  quiet["measured_partial"], quiet["predicted_partial_from_full"])]
    _figure(bars)
    result["uncontended_steps_only"] = None if quiet is None else {
        k: quiet[k] for k in ("measured_full", "predicted_full_from_partial", "error_full", "measured_partial",
                              "predicted_partial_from_full", "error_partial", "steps", "measured_ratio")}
    print(json.dumps(result))


def _figure(bars: list[tuple[str, float, float]]) -> None:
    """bars: (label, measured, predicted)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 3.6))
    xs = range(len(bars))
    ax.bar([i - 0.18 for i in xs], [m for _, m, _ in bars], 0.36, label="measured (its own runs)", color="#4c72b0")
    ax.bar([i + 0.18 for i in xs], [p for _, _, p in bars], 0.36, label="predicted from the other placement's runs",
           color="#dd8452")
    for i, (_, m, p) in enumerate(bars):
        ax.text(i + 0.18, p, f"{p / m - 1:+.0%}", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(list(xs), [label for label, _, _ in bars], fontsize=8)
    ax.set_ylabel("rollout + reward, s/step (median)")
    ax.set_title("yatt-mm simulate vs bench_placement (2-core CPU)", fontsize=9)
    ax.legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    FIGURE.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(FIGURE, dpi=110)


if __name__ == "__main__":
    main(*sys.argv[1:])
