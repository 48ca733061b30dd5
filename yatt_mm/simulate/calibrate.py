"""Measure a CPU profile's calibration: how the rollout engine and a judge server run side by
side under partial colocation, relative to each alone on every core (full colocation).

    python -m yatt_mm.simulate.calibrate configs/profiles/cpu_2core.yaml --policy DIR --judge DIR [options]

Outside the RL loop, in one process: the rollout engine (in-process vLLM) and, for full
colocation, the in-process judge, then a judge server (a real vLLM server process). Each round
draws one batch of prompts and runs it alone (generation, then in-process judging of the whole
batch, at 1 and at 2 torch threads: full colocation takes each role's faster) and beside the
server at each split of the cores (this process pinned to the rollout
cores, the server's processes to the judge cores, every sample streamed to the server as it
finishes). Rounds interleave the settings; each figure is the median over rounds.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path


def _measure(args) -> dict:
    import models  # noqa: F401 - CPU runtime hooks first
    from dataio.reader import DataConfig, DataReader
    from yatt_mm.engines.engine import EngineConfig, RolloutEngine, SamplingConfig
    from yatt_mm.engines.server import JudgeServer
    from yatt_mm.reward.genrm import InProcessJudge, JudgeConfig, ServerJudge
    from yatt_mm.reward.judges import Judges
    from yatt_mm.reward.rewarder import RewardConfig, Rewarder
    from yatt_mm.rl import cpu_pinning
    from yatt_mm.rl.controller import measured_wave
    from yatt_mm.rl.sources import ParallelSource
    from yatt_mm.rl.split import Split, cpu_cores

    cores = cpu_pinning.usable_cores()
    cpu_pinning.set_torch_threads(args.threads)
    source = ParallelSource(DataReader(DataConfig(shards=[args.data], workers=0)))
    engine = RolloutEngine(EngineConfig(model=args.policy, max_num_seqs=args.max_num_seqs))
    sampling = SamplingConfig(n=args.n, max_tokens=args.max_tokens)
    judge_cfg = JudgeConfig(name="genrm", model=args.judge, votes=args.votes, max_tokens=args.judge_max_tokens,
                            threads=args.threads)
    in_process = Rewarder(RewardConfig(), Judges([("genrm", InProcessJudge(judge_cfg), 1.0)]))
    server = JudgeServer(JudgeConfig(**{**judge_cfg.__dict__, "backend": "server"})).start()
    served = Rewarder(RewardConfig(), Judges([("genrm", ServerJudge(judge_cfg, server.base_url, "genrm"), 1.0)]))
    splits = [k * 0.5 for k in range(1, 2 * len(cores))]
    alone_gen = {t: [] for t in (1, 2)}  # full colocation runs each role with its best thread count
    alone_cost = {t: [] for t in (1, 2)}
    beside_gen = {j: [] for j in splits}
    beside_cost = {j: [] for j in splits}
    try:
        for r in range(args.rounds):
            prompts = source.take(args.prompts)
            requests = [p.request() for p in prompts]
            cpu_pinning.pin([os.getpid()], cores)
            cpu_pinning.pin(cpu_pinning.session_pids(server.proc.pid), cores)
            for threads in (1, 2):
                cpu_pinning.set_torch_threads(threads)
                start = time.time()
                result = engine.generate(requests, sampling, on_sample=lambda *_: None)
                alone_gen[threads].append(time.time() - start)
                start = time.time()
                in_process.score(prompts, result.responses)
                alone_cost[threads].append((time.time() - start) / sum(len(g) for g in result.responses))
            cpu_pinning.set_torch_threads(args.threads)
            for j in splits:
                rollout, judge = cpu_cores(Split(len(cores), j, 0.5), cores)
                cpu_pinning.pin([os.getpid()], rollout)
                cpu_pinning.pin(cpu_pinning.session_pids(server.proc.pid), judge)
                done: dict = {}
                stream = served.stream(prompts)

                def sample_done(i, k, response, done=done, stream=stream):
                    done[(i, k)] = time.time()
                    stream.add_sample(i, k, response)

                start = time.time()
                engine.generate(requests, sampling, on_finished=stream.add, on_sample=sample_done)
                end = time.time()
                stream.results()
                wave = measured_wave(start, end, done, stream.judge_spans())
                beside_gen[j].append(wave.generation_seconds)
                beside_cost[j].append(wave.judge_seconds_per_response)
            print(f"round {r + 1}/{args.rounds}: alone gen {alone_gen[1][-1]:.2f}/{alone_gen[2][-1]:.2f} s (1/2 threads), "
                  f"judge {alone_cost[1][-1] * 1e3:.0f}/{alone_cost[2][-1] * 1e3:.0f} ms/resp; "
                  + "; ".join(f"judges {j:g}: gen {beside_gen[j][-1]:.2f} s, {beside_cost[j][-1] * 1e3:.0f} ms/resp"
                              for j in splits), flush=True)
    finally:
        cpu_pinning.pin([os.getpid()], cores)
        server.stop()
    gen = min(statistics.median(v) for v in alone_gen.values())
    cost = min(statistics.median(v) for v in alone_cost.values())
    return {"rollout_speed": {j: round(gen / statistics.median(beside_gen[j]), 3) for j in splits},
            "judge_cost": {j: round(statistics.median(beside_cost[j]) / cost, 3) for j in splits},
            "cores": len(cores)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m yatt_mm.simulate.calibrate", description=__doc__.split("\n\n")[0])
    p.add_argument("out", help="the profile YAML to write, e.g. configs/profiles/cpu_2core.yaml")
    p.add_argument("--policy", required=True, help="rollout model (HF dir)")
    p.add_argument("--judge", required=True, help="judge model (HF dir)")
    p.add_argument("--data", default="runs/demo-data/train", help="shards the prompts come from")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--n", type=int, default=8, help="responses per prompt")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--votes", type=int, default=2)
    p.add_argument("--judge-max-tokens", type=int, default=6)
    p.add_argument("--threads", type=int, default=1, help="torch threads of each side")
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args(argv)
    m = _measure(args)
    import yaml

    load = os.getloadavg()[0]
    profile = {
        "name": f"this {m['cores']}-core CPU machine (tiny Qwen2-VL policy and judge)",
        "kind": "cpu", "devices_per_node": m["cores"],
        "source": "measured by python -m yatt_mm.simulate.calibrate " + " ".join(sys.argv[1:] if argv is None else argv),
        "calibration": {"rollout_speed": m["rollout_speed"], "judge_cost": m["judge_cost"], "rounds": args.rounds,
                        "measured": f"{time.strftime('%Y-%m-%d %H:%M')}, load average {load:.1f} at the end"},
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(yaml.safe_dump(profile, sort_keys=False))
    print(f"wrote {args.out}: rollout_speed {m['rollout_speed']}, judge_cost {m['judge_cost']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
