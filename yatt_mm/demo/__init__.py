"""`yatt-mm demo` (the README's first command): RL of the tiny Qwen2-VL on this CPU.

1. synthetic colour-question shards (train and held-out), made once;
2. the warm starts, cached (yatt_mm/demo/warmstart.py): the policy's 12 SFT steps teach the answer
   format and leave held-out accuracy near 0.45; the judge's SFT teaches it to grade a
   response against the reference answer;
3. `yatt-mm rl --config configs/tiny_demo.yaml` on 2 ranks: GRPO with dynamic sampling, the
   exact-match rule and the tiny GenRM judge as rewards, greedy eval on held-out prompts every
   few steps;
4. the reward curve and the phase timeline as PNGs, and a summary.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

DATA = Path("runs/demo-data")
CONFIG = "configs/tiny_demo.yaml"


def make_data() -> None:
    from dataio.synth import write_shards

    for split, n, seed, task in (("train", 512, 1, "colour"), ("eval", 64, 2, "colour"),
                                 ("grounding", 512, 3, "grounding"), ("grounding-eval", 64, 4, "grounding")):
        out = DATA / split
        if not any(out.glob("*.tar")):
            write_shards(str(out), images=n, videos=0, samples_per_shard=128, seed=seed, tasks=[task])
            print(f"[demo] wrote {n} synthetic {task} questions to {out}", flush=True)


def demo_run_dir(run_dir: str | None, overrides: list[str] | None) -> Path:
    """Where the demo's run goes: a `run.run_dir=` override (the RL run takes the last one, so the
    demo's plots and summary must read it too), else --run-dir, else runs/tiny-demo-TIME."""
    given = [o.split("=", 1)[1] for o in overrides or [] if o.startswith("run.run_dir=")]
    return Path(given[-1] if given else run_dir or f"runs/tiny-demo-{time.strftime('%Y%m%d-%H%M%S')}")


def run_demo(run_dir: str | None = None, nproc: int = 2, overrides: list[str] | None = None,
             verbose: bool = False) -> int:
    from yatt_mm.launch import launch_command
    from yatt_mm.plot import plot_run

    start = time.time()
    run = demo_run_dir(run_dir, overrides)
    print(f"[demo] RL of a tiny Qwen2-VL on CPU; everything goes to {run}", flush=True)
    make_data()
    # the launcher builds the warm starts before the ranks start (they find them cached): the
    # policy's about 10-30 s the first time, the judge's about 4-7 min
    rc = launch_command("rl", ["--config", CONFIG, "--nproc", str(nproc), f"run.run_dir={run}",
                               *(["--verbose"] if verbose else []), *(overrides or [])])
    if rc != 0:
        print(f"[demo] the RL run failed (exit code {rc}); see the output above and the library logs in "
              f"{run / 'logs'}", flush=True)
        return rc
    for png in plot_run(run):
        print(f"[demo] wrote {png}", flush=True)
    evals = [(r["step"], r["eval/reward_mean"]) for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
             if "eval/reward_mean" in r]
    if evals:
        (s0, first), (s1, last) = evals[0], evals[-1]
        change = f" -> {last:.3f} at step {s1}" if len(evals) > 1 else ""  # a short run evaluates once
        print(f"[demo] held-out exact-match reward: {first:.3f} at step {s0}{change} "
              f"({time.time() - start:.0f}s in all)", flush=True)
    return 0
