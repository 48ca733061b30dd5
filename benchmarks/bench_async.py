"""Asynchronous RL on this machine: the demo at run.max_staleness 1 against 0, seconds per step
and the held-out reward after the same number of samples.

The demo's workload as a user runs it (configs/tiny_demo.yaml's defaults: 2 ranks, 8 prompts x 8
responses per DP group, rule reward + the tiny GenRM judge, dynamic sampling), the demo's data
and cached warm starts (benchmarks/_rl.py), `--steps` steps each, held-out eval once at the end
(eval/reward_mean: greedy answers to the demo's 32 held-out prompts) half-way and at the end, so
both have trained on the same number of samples. Staleness 1 runs `run.placement=disaggregated run.max_staleness=1`
(yatt_mm/rl/rollout_ahead.py: each controller's rollout of step n+1, its vLLM engines in a worker
process of their own, beside step n's training). Paired rounds: each round runs both, in alternating order, with the round's seeds
(sampling, data order), and its ratio is async / sync; the figure is the median of the rounds' ratios.

Seconds per step: from one step's training to the next's (the start of rank 0's "train" phase in
the timeline), the same clock for both modes; the steady state leaves out the first two steps
(start-up, the first rollout ahead), the half-way one and the last (their evals). Each side's
seconds per step (the controller's generation, the trainer's logprobs and update), overlapped
against synchronous, says what the overlap cost each. The simulator's prediction
(`yatt-mm simulate RUN --staleness 1`, yatt_mm/simulate/staleness.py) is made from each
synchronous run's own timeline and compared with the same round's measured ratio.

The runs' directories (timelines, metrics) are kept under runs/bench-async/{sync,async}-ROUND for
`yatt-mm simulate`; tracked files are left as they were.
The bound: the cores' busy share during the steady steps (/proc/stat). The same work overlapped
cannot take less than the busy share of the synchronous seconds, so on a machine whose
synchronous step keeps its cores busy (this one: 2 cores, 2 ranks) no staleness reaches a ratio
below `step_time_ratio_bound`; on GPUs the rollout's devices idle while the trainer's train.

Last line: JSON with step_time_ratio (target <= 0.75), step_time_ratio_bound (the cores' busy
share of the synchronous steps) and cpu_busy_async, the seconds per step of both, the held-out
rewards and their difference (with the spread of the synchronous runs' rewards across seeds),
and predicted_step_time_ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import ROOT, full_or_smoke, output_root, shown  # noqa: E402
from _rl import demo_rl_records  # noqa: E402

sys.path.insert(0, str(ROOT))
from yatt_mm.simulate.staleness import GENERATION, TRAINING, predict_here, read_phases  # noqa: E402

MODES = {"sync": [], "async": ["run.placement=disaggregated", "run.max_staleness=1"]}
SKIP_FIRST = 2  # start-up, and the first step of a rollout ahead (it generates its own samples)
KEEP = output_root() / "bench-async"  # the runs' timelines and metrics, for `yatt-mm simulate`
# the fewest steps a run may have: a steady state of two steps beside the mid-run eval; a smoke
# run's one steady step (step 3 to 4 of 4) is enough to compute every figure once
MIN_STEPS = full_or_smoke(SKIP_FIRST + 4, SKIP_FIRST + 2)


def read_timeline(run_dir: Path, rank: int) -> list[dict]:
    return [json.loads(line) for line in (run_dir / f"timeline_rank{rank}.jsonl").read_text().splitlines()
            if line.endswith("}")]


def train_starts(run_dir: Path) -> list[float]:
    """When each step's training began on rank 0: one step's seconds is the gap to the next."""
    starts = {s["step"]: s["start"] for s in read_timeline(run_dir, 0)
              if s["phase"] == "train" and s.get("kind") != "request"}
    return [starts[n] for n in sorted(starts)]


def side_seconds(run_dir: Path, steps: set[int]) -> dict[str, float]:
    """Median seconds per step and rank of each side (the controller's generation, the trainer's
    logprobs and update) over `steps`: how much each slowed when the two overlapped."""
    sums: dict[str, list[float]] = {"generation": [], "training": []}
    for path in sorted(run_dir.glob("timeline_rank*.jsonl")):
        spans = read_timeline(run_dir, int(path.stem.removeprefix("timeline_rank")))
        for side, names in (("generation", GENERATION), ("training", TRAINING)):
            names = names + tuple(f"switch:{n}" for n in names)
            for n in steps:
                sums[side].append(sum(s["end"] - s["start"] for s in spans if s["step"] == n
                                      and s.get("kind") != "request" and s["phase"] in names))
    return {side: statistics.median(v) for side, v in sums.items()}


class CoreLoad:
    """The machine's cores' busy share over time (/proc/stat, sampled every `every` seconds in a
    thread): how much of the cores a run's steps left idle, which is all an overlap can fill."""

    def __init__(self, every: float = 0.1):
        self.samples: list[tuple[float, int, int]] = []  # (time, busy ticks, all ticks)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, args=(every,), daemon=True)

    def _sample(self, every: float) -> None:
        while not self._stop.is_set():
            with open("/proc/stat") as f:
                ticks = [int(x) for x in f.readline().split()[1:9]]
            idle = ticks[3] + ticks[4]  # idle, iowait
            self.samples.append((time.time(), sum(ticks) - idle, sum(ticks)))
            self._stop.wait(every)

    def __enter__(self) -> "CoreLoad":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def busy(self, start: float, end: float) -> float:
        """The busy share from the last sample at or before `start` to the first at or after `end`
        (a step shorter than the sampling interval still gets the samples around it)."""
        before = [s for s in self.samples if s[0] <= start] or self.samples[:1]
        after = [s for s in self.samples if s[0] >= end] or self.samples[-1:]
        if not before or not after or after[0][0] <= before[-1][0]:
            return float("nan")
        first, last = before[-1], after[0]
        return (last[1] - first[1]) / max(last[2] - first[2], 1)


def run(mode: str, steps: int, seed: int) -> dict:
    seen: dict = {}
    every = steps // 2  # held-out eval half-way (the demo nearly saturates by the end) and at the end
    # gap i: from step i's training to step i+1's; left out: the first ones and the one holding the mid eval
    counted = [i for i in range(steps - 1) if i >= SKIP_FIRST and i != every - 1]

    def inspect(run_dir: Path) -> None:
        shutil.copytree(run_dir, KEEP / f"{mode}-{seed}", ignore=shutil.ignore_patterns("checkpoints", "tb"))
        seen["starts"] = train_starts(run_dir)
        seen["sides"] = side_seconds(run_dir, set(counted))
        if mode == "sync":
            seen["prediction"] = predict_here(read_phases(run_dir), 1)

    # the round's seed: vLLM's sampling and the data order (run.seed alone seeds Megatron's init, which the
    # warm start overwrites: two rounds were equal to the bit)
    seeds = [f"run.seed={seed}", f"rollout.engine.seed={seed}", f"data.seed={seed}"]
    with CoreLoad() as load:
        records = demo_rl_records(steps, *MODES[mode], f"eval.every={every}", *seeds, inspect=inspect)
    starts = seen["starts"]
    gaps = [starts[i + 1] - starts[i] for i in counted]
    busy = statistics.median(load.busy(starts[i], starts[i + 1]) for i in counted)
    evals = [r["eval/reward_mean"] for r in records if "eval/reward_mean" in r]
    stale = [r["rollout/staleness_mean"] for r in records if "rollout/staleness_mean" in r]
    return {"seconds": statistics.median(gaps), "gaps": gaps, "busy": busy, "eval_mid": evals[-2], "eval": evals[-1],
            "sides": seen["sides"], "staleness_mean": statistics.mean(stale) if stale else 0.0,
            "dropped": sum(r.get("rollout/stale_dropped", 0.0) for r in records),
            "prediction": seen.get("prediction")}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=full_or_smoke(3, 1), help="paired rounds (each: one run of each mode)")
    p.add_argument("--steps", type=int, default=full_or_smoke(8, MIN_STEPS),
                   help="RL steps per run (the held-out eval after the last)")
    args = p.parse_args(argv)
    if args.rounds < 1 or args.steps < MIN_STEPS:
        p.error(f"--rounds must be >= 1 and --steps >= {MIN_STEPS} (a steady state beside the mid-run eval)")
    rounds = []
    shutil.rmtree(KEEP, ignore_errors=True)
    for r in range(args.rounds):
        order = list(MODES) if r % 2 == 0 else list(reversed(MODES))
        result = {mode: run(mode, args.steps, seed=r) for mode in order}
        sync, ahead = result["sync"], result["async"]
        pred = sync["prediction"]
        rounds.append({"ratio": ahead["seconds"] / sync["seconds"], "sync": sync, "async": ahead,
                       "predicted_ratio": pred.ratio, "bound": pred.bound})
        print(f"round {r + 1}/{args.rounds} (seed {r}, {' then '.join(order)}): sync {sync['seconds']:.2f} s/step "
              f"({' '.join(f'{g:.2f}' for g in sync['gaps'])}), staleness 1 {ahead['seconds']:.2f} s/step "
              f"({' '.join(f'{g:.2f}' for g in ahead['gaps'])}): ratio {rounds[-1]['ratio']:.3f}, predicted "
              f"{pred.ratio:.3f} ({pred.bound}-bound); held-out reward {sync['eval_mid']:.3f} vs "
              f"{ahead['eval_mid']:.3f} half-way, {sync['eval']:.3f} vs {ahead['eval']:.3f} at the end; "
              f"overlapped, generation took "
              f"{ahead['sides']['generation'] / sync['sides']['generation']:.2f}x and training "
              f"{ahead['sides']['training'] / sync['sides']['training']:.2f}x their synchronous seconds, "
              f"staleness mean {ahead['staleness_mean']:.2f}; the cores were {sync['busy']:.0%} busy in the "
              f"synchronous steps, {ahead['busy']:.0%} in the overlapped ones", flush=True)
    ratio = statistics.median(x["ratio"] for x in rounds)
    rewards = {m: [x[m]["eval"] for x in rounds] for m in MODES}
    mid = {m: [x[m]["eval_mid"] for x in rounds] for m in MODES}
    out = {
        "step_time_ratio": round(ratio, 3), "target": 0.75, "met": ratio <= 0.75,
        "sync_step_seconds": round(statistics.median(x["sync"]["seconds"] for x in rounds), 3),
        "async_step_seconds": round(statistics.median(x["async"]["seconds"] for x in rounds), 3),
        "round_ratios": [round(x["ratio"], 3) for x in rounds],
        "eval_reward_sync": round(statistics.mean(rewards["sync"]), 4),
        "eval_reward_async": round(statistics.mean(rewards["async"]), 4),
        "eval_reward_diff": round(statistics.mean(a - s for s, a in zip(rewards["sync"], rewards["async"])), 4),
        # the noise the difference is read against: the synchronous runs' spread across seeds
        "eval_reward_sync_stdev": round(statistics.stdev(rewards["sync"]), 4) if len(rounds) > 1 else None,
        "eval_rewards": {m: [round(v, 4) for v in vs] for m, vs in rewards.items()},
        f"eval_reward_step{args.steps // 2}": {m: [round(v, 4) for v in vs] for m, vs in mid.items()},
        # each side's seconds per step when overlapped, over the synchronous run's (medians of rounds)
        "overlap_slowdown": {side: round(statistics.median(x["async"]["sides"][side] / x["sync"]["sides"][side]
                                                           for x in rounds), 3)
                             for side in ("generation", "training")},
        # the cores' busy share in the steady steps (median of rounds): what the synchronous steps left
        # idle is all an overlap can fill, so with the same work no staleness gets a ratio below it here
        "cpu_busy_sync": round(statistics.median(x["sync"]["busy"] for x in rounds), 3),
        "cpu_busy_async": round(statistics.median(x["async"]["busy"] for x in rounds), 3),
        "step_time_ratio_bound": round(statistics.median(x["sync"]["busy"] for x in rounds), 3),
        # the cores' busy seconds per step, overlapped over synchronous: above 1, the overlap costs the
        # cores more work than it saves waiting (two sides time-sliced on the same cores)
        "core_seconds_ratio": round(statistics.median(x["async"]["busy"] * x["async"]["seconds"]
                                                      / (x["sync"]["busy"] * x["sync"]["seconds"]) for x in rounds), 3),
        "predicted_step_time_ratio": round(statistics.median(x["predicted_ratio"] for x in rounds), 3),
        "predicted_round_ratios": [round(x["predicted_ratio"], 3) for x in rounds],
        "predicted_bound": max(sorted({x["bound"] for x in rounds}), key=[x["bound"] for x in rounds].count),
        "staleness_mean": round(statistics.mean(x["async"]["staleness_mean"] for x in rounds), 3),
        "stale_dropped": sum(x["async"]["dropped"] for x in rounds),
        "rounds": args.rounds, "steps": args.steps,
        "load_average_end": round(os.getloadavg()[0], 2), "runs_kept": shown(KEEP),
    }
    print(f"staleness 1 / 0 seconds per step: {ratio:.3f} (median of {args.rounds} rounds; target <= 0.75: "
          f"{'met' if out['met'] else 'not met'}; no overlap gets below {out['step_time_ratio_bound']:.2f} on this "
          f"machine, the cores' busy share in the synchronous steps); simulator predicted {out['predicted_step_time_ratio']:.3f}; "
          f"held-out reward {out['eval_reward_sync']:.3f} (sync) vs {out['eval_reward_async']:.3f} (staleness 1)")
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
