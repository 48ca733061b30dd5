"""Multi-turn RL with a tool, end to end: 2 ranks under torchrun, the tiny policy warm-started to
call `zoom` and answer from the enlarged crop, real vLLM engines in worker processes (placement
disaggregated: the conversations, tool images included, cross a process boundary), the trainer
scoring every turn's tokens with the tool replies' images in the sequence."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from dataio.synth import write_shards

ROOT = Path(__file__).resolve().parents[2]


def _tools_run(tmp_path, policy, *overrides):
    """A 2-step run of configs/tiny_tools.yaml on 2 ranks; its step metrics after checking, per
    step, what any tool-using run must show."""
    for name, n, seed in (("train", 16, 3), ("eval", 4, 4)):
        write_shards(str(tmp_path / name), images=n, videos=0, samples_per_shard=8, seed=seed, tasks=["colour"])
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "yatt_mm.cli", "rl", "--nproc", "2", "--config", "configs/tiny_tools.yaml",
           f"run.run_dir={run_dir}", f"data.shards=[{tmp_path / 'train'}]", f"eval.shards=[{tmp_path / 'eval'}]",
           f"policy.model={policy}", "run.steps=2", "eval.every=2", "eval.num_prompts=2",
           "rollout.prompts_per_step=2", "dynamic_sampling.max_waves=1", "data.workers=0", *overrides]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-5000:])
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [s for s in steps if "rollout/reward_mean" in s]
    assert len(steps) == 2
    for m in steps:
        # most responses called the tool once and answered after its reply
        assert 1.5 < m["rollout/turns_mean"] <= 3 and m["rollout/tool_calls_mean"] > 0.5, m
        assert 0 <= m["rollout/tool_error_rate"] < 0.5
        # every sampled token of every turn, after the tool's image and text, scored by the
        # trainer as vLLM scored it (fp32 on CPU): a reply token counted as sampled, an image
        # placeholder expanded to another length, or the reply's image missing would be far off
        assert m["train/logprob_diff_vs_rollout"] < 1e-4, m
        assert m["rollout/reward_mean"] > 0.3  # the answers after the zoom are mostly right
    assert "eval/reward_mean" in steps[-1]  # eval answered through the tool too
    return run_dir, steps


def test_a_tool_using_policy_trains_on_whole_conversations_scored_as_vllm_scored_them(tmp_path, warm_tools_policy):
    run_dir, steps = _tools_run(tmp_path, warm_tools_policy, "run.placement=disaggregated")
    # `yatt-mm eval` of the final policy: the run's last eval again (its conversations, greedy,
    # in another process layout), and each answer's whole conversation in answers.jsonl
    out = tmp_path / "eval"
    proc = subprocess.run([sys.executable, "-m", "yatt_mm.cli", "eval", "--config", str(run_dir / "config.yaml"),
                           "--model", str(run_dir / "final"), "--dp-size", "2", "--out", str(out)],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-5000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1])["eval/reward_mean"] == steps[-1]["eval/reward_mean"]
    lines = [json.loads(line) for line in (out / "answers.jsonl").read_text().splitlines()]
    conversations = [c for line in lines for c in line["conversations"]]
    assert len(conversations) == 4 and sum("<tool_response>" in c for c in conversations) >= 2
    assert all(c.endswith(a + "<|im_end|>") for line in lines for c, a in zip(line["conversations"], line["answers"]))


@pytest.mark.slow  # the warm start (~30 s once) and a 2-step run
def test_a_tool_using_qwen3vl_policy_trains_on_whole_conversations(tmp_path):
    """The same on Qwen3-VL (its 32-pixel patches and merge, its chat template, its positions),
    with the engine in the rank's own process (full colocation)."""
    from yatt_mm.demo.warmstart import warm_start

    data = tmp_path / "warm-data"
    write_shards(str(data), images=64, videos=0, samples_per_shard=16, seed=6, tasks=["colour"])
    _tools_run(tmp_path, warm_start("qwen3vl_tools", data, quiet=True))
