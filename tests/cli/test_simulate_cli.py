"""`yatt-mm simulate` as a user runs it: on a run directory (its timeline in the format the RL
loop writes), here and on a GPU cluster profile; and what it says about bad input."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _partial_run(run_dir: Path, steps: int = 3) -> Path:
    """A partial-colocation run's timeline: per step one wave of 16 samples finishing over
    1 s, each judged for 50 ms from its hand-over, then training."""
    run_dir.mkdir(parents=True)
    spans = [{"rank": 0, "step": -1, "phase": "devices", "start": 0.0, "end": 0.0, "kind": "request",
              "device": "cpu", "units": 2, "threads": 1, "rollout_threads": 1, "judge_threads": 1,
              "placement": "partial"}]
    t = 100.0
    for step in range(steps):
        start, end = t, t + 1.0
        spans.append({"rank": 0, "step": step, "phase": "rollout_reward", "start": start, "end": end + 0.3})
        spans.append({"rank": 0, "step": step, "phase": "generate", "start": start, "end": end, "kind": "request",
                      "prompts": 2, "samples": 16, "cpu": 0.95})
        for k in range(16):
            done = start + (k + 1) / 16
            spans.append({"rank": 0, "step": step, "phase": "generated", "start": start, "end": done,
                          "kind": "request", "prompt": k // 8, "sample": k % 8, "tokens": 4 if k % 8 else 48})
            spans.append({"rank": 0, "step": step, "phase": "judge", "start": done, "end": done + 0.05,
                          "kind": "request", "prompt": k // 8, "sample": k % 8, "judge": "genrm", "handed": done})
        spans.append({"rank": 0, "step": step, "phase": "judging", "start": start, "end": end + 0.3,
                      "kind": "request", "cpu": 0.7, "responses": 16})
        spans.append({"rank": 0, "step": step, "phase": "split", "start": end + 0.3, "end": end + 0.3,
                      "kind": "request", "units": 2, "judge": 1.0, "next": 1.0, "reason": "kept"})
        spans.append({"rank": 0, "step": step, "phase": "train", "start": end + 0.3, "end": end + 1.3})
        t = end + 2.0
    (run_dir / "timeline_rank0.jsonl").write_text("".join(json.dumps(s) + "\n" for s in spans))
    (run_dir / "config.yaml").write_text("rollout:\n  sampling:\n    max_tokens: 48\n")
    return run_dir


def _simulate(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "yatt_mm.cli", "simulate", *args], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)


def test_simulate_replays_a_run_here_with_a_table_a_png_and_json(tmp_path):
    run = _partial_run(tmp_path / "run")
    proc = _simulate(str(run))
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert any(ln.startswith("full ") for ln in lines) and any(ln.startswith("partial ") for ln in lines)
    summary = json.loads(lines[-1])
    print("simulate summary:", summary)
    assert summary["measured_placement"] == "partial" and summary["units"] == 2
    # the measured partial wave replays as measured (1.0 s of generation, the last judged 50 ms later)
    assert abs(summary["partial"]["rollout_reward_seconds"] - 1.05) < 1e-6  # measured equal (the JSON's ms)
    # under full colocation the same work is generation, then the 16 responses' judging
    assert abs(summary["full"]["rollout_reward_seconds"] - (1.0 + 16 * 0.05 * 16 / 16)) < 1e-6  # measured equal
    assert summary["ratio"] < 1 and 0 < summary["partial"]["utilisation_rollout"] <= 1
    assert (run / "simulated_here.png").stat().st_size > 10_000


def test_simulate_scales_a_run_to_a_gpu_cluster_and_names_the_winner(tmp_path):
    run = _partial_run(tmp_path / "run")
    proc = _simulate(str(run), "--profile", str(ROOT / "configs/profiles/h200_sxm_node.yaml"), "--gpus", "16",
                     "--judge-b", "7", "--png", str(tmp_path / "cluster.png"))
    assert proc.returncode == 0, proc.stderr
    assert "colocation wins" in proc.stdout and "on 16 x H200 SXM node" in proc.stdout
    summary = json.loads(proc.stdout.splitlines()[-1])
    assert summary["gpus"] == 16 and 0 < summary["partial"]["judge_gpus"] < 16 and summary["full"]["judge_gpus"] == 16
    assert (tmp_path / "cluster.png").is_file()


def test_simulate_says_what_to_fix(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    proc = _simulate(str(empty))
    assert proc.returncode == 2 and "no timeline_rank*.jsonl" in proc.stderr and "Traceback" not in proc.stderr
    run = _partial_run(tmp_path / "run")
    proc = _simulate(str(run), "--profile", str(tmp_path / "nope.yaml"))
    assert proc.returncode == 2 and "configs/profiles/" in proc.stderr
