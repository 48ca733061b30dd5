"""Partial vs full colocation on this machine: rollout + reward seconds per RL step.

One DP group (one rank), the demo's warm-started policy and its GenRM judge (2 votes), longer
answers than the demo (`max_tokens` 48: the warm policy mostly answers in a few tokens, some
answers run to the limit: a long tail), the engine batching at most 16 sequences at once (with
64 responses a step, prompts finish in turn, as under a GPU's batch limit). Full colocation:
rollout, then the in-process judge on the whole batch. Partial colocation: the judge as a vLLM
server process beside the rollout engine, each prompt's responses sent to it the moment they
finish. Runs alternate (full, partial, full, ...); the first step of each run is left out
(start-up). Overlap: `placement/judge_overlap`, the share of judging time that ran while the
engine was still generating, from the request timeline.

Last line: JSON with rollout_reward_seconds_full, rollout_reward_seconds_partial, ratio
(partial / full, medians over steps) and overlap.
"""

from __future__ import annotations

import json
import shutil
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _rl import ROOT, demo_rl_records  # noqa: E402

COMMON = ["rollout.sampling.max_tokens=48", "rollout.engine.max_num_seqs=16", "dynamic_sampling.max_waves=1",
          "run.check_sync=false"]
JUDGE = "{name: genrm, model: 'warmstart:judge', votes: 2, max_tokens: 6%s}"
SETTINGS = {
    "full": COMMON + ["run.placement=full", f"reward.judges=[{{judge: {JUDGE % ''}, weight: 0.5}}]"],
    "partial": COMMON + ["run.placement=partial", f"reward.judges=[{{judge: {JUDGE % ', backend: server'}, weight: 0.5}}]"],
}
KEEP = ROOT / "runs" / "bench-placement"  # the runs' timelines, for `yatt-mm simulate`


def rollout_reward_seconds(record: dict) -> float:
    return sum(record.get(k, 0.0) for k in ("time/rollout", "time/reward", "time/rollout_reward",
                                            "time/switch:rollout", "time/switch:reward", "time/switch:rollout_reward"))


def main(rounds: int = 2, steps: int = 4) -> None:
    seconds = {mode: [] for mode in SETTINGS}
    overlap, tokens = [], []
    shutil.rmtree(KEEP, ignore_errors=True)
    for r in range(rounds):
        for mode, settings in SETTINGS.items():
            keep = KEEP / f"{mode}-{r}"
            records = demo_rl_records(steps, *settings, nproc=1,
                                      inspect=lambda run: shutil.copytree(run, keep, ignore=shutil.ignore_patterns(
                                          "checkpoints", "tb")))
            steps_done = [x for x in records if "rollout/reward_mean" in x][1:]
            seconds[mode] += [rollout_reward_seconds(x) for x in steps_done]
            overlap += [x["placement/judge_overlap"] for x in steps_done if "placement/judge_overlap" in x]
            tokens += [x.get("rollout/response_length", 0.0) for x in steps_done]
            print(f"round {r} {mode}: " + " ".join(f"{s:.2f}" for s in seconds[mode][-len(steps_done):]) + " s",
                  flush=True)
    full, partial = statistics.median(seconds["full"]), statistics.median(seconds["partial"])
    result = {"rollout_reward_seconds_full": round(full, 3), "rollout_reward_seconds_partial": round(partial, 3),
              "ratio": round(partial / full, 3), "overlap": round(statistics.median(overlap), 3) if overlap else 0.0,
              "steps_each": len(seconds["full"]), "runs_kept": str(KEEP.relative_to(ROOT))}
    print(f"rollout + reward per step: full {full:.2f} s, partial {partial:.2f} s, ratio {partial / full:.2f} "
          f"(paper: <= 0.84); judging overlapped generation {result['overlap']:.0%}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
