"""Asynchronous RL end to end (run.max_staleness=1, placement disaggregated): 2 ranks, the warm
policy, real vLLM engines (each controller's in an engine worker process), real shards. One
launch pair checks everything: the rollout of each step ran while the previous one trained, samples trained one policy version behind (never more)
with the loss corrected by vLLM's behaviour logprobs, and after kill -9 of a rank with a rollout
in flight, the engine workers die with the ranks, and the resumed run regenerates it: the weights continue bit for bit and every sample of
the epoch is drawn exactly once."""

import json
import re
import subprocess

import psutil
import pytest

from dataio.synth import write_shards
from test_rl import ROOT, _consumed, _kill_rank_and_wait, _steps, _steps_logged, _tiny_rl, _wait_for


def _overlaps(run_dir) -> int:
    """On rank 0: how many steps' training ran while the next step's samples were generating."""
    spans = [json.loads(ln) for ln in (run_dir / "timeline_rank0.jsonl").read_text().splitlines() if ln.endswith("}")]
    generate = [s for s in spans if s["phase"] == "generate"]
    train = [s for s in spans if s["phase"] == "train"]
    return sum(any(g["step"] == t["step"] + 1 and g["start"] < t["end"] and g["end"] > t["start"] for g in generate)
               for t in train)


def _engine_workers(launcher: subprocess.Popen) -> list:
    """The engine workers (yatt_mm/engines/worker.py) the launcher's ranks started, with their
    supervisors (yatt_mm/processes.py: one each, whose command line names the worker too)."""
    return [p for p in psutil.Process(launcher.pid).children(recursive=True)
            if "yatt_mm.engines.worker" in " ".join(p.cmdline())]


def _assert_every_epoch_drawn_whole(run_dir, keys: int) -> None:
    """The lineage reads as one run that skipped nothing: each controller drew its share of the
    data (disjoint, together all `keys`) once per epoch, every epoch but its last in progress
    whole (a prompt drawn ahead and lost at a crash leaves a hole in its epoch; one drawn
    again, a duplicate)."""
    shares = []
    for pairs in _consumed(run_dir).values():
        assert len(pairs) == len(set(pairs))
        epochs = sorted({epoch for epoch, _ in pairs})
        assert len(epochs) >= 3, epochs
        share = {key for epoch, key in pairs if epoch == 0}
        for epoch in epochs[1:-1]:
            assert {key for e, key in pairs if e == epoch} == share, epoch
        shares.append(share)
    assert len(shares) == 2 and not (shares[0] & shares[1]) and len(shares[0] | shares[1]) == keys


@pytest.mark.slow  # a 6-step launch killed -9 and its rerun (~70 s)
def test_staleness_1_trains_one_version_behind_overlapped_and_resumes_exactly_after_kill_9(tmp_path, warm_policy):
    write_shards(str(tmp_path / "train"), images=16, videos=0, samples_per_shard=8, seed=7, tasks=["colour"])
    run_dir = tmp_path / "run"
    cmd = _tiny_rl(run_dir, tmp_path / "train", "run.steps=6", "run.max_staleness=1", "run.placement=disaggregated",
                   "run.checkpoint_every=2", "run.save_final=false", "eval.every=0", "reward.judges=[]",
                   policy=warm_policy)
    ckpt = run_dir / "checkpoints" / "step_2"
    out = open(tmp_path / "first.out", "w")
    launcher = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    try:
        # written while step 3 trains, its successor's rollout running ahead: kill a rank then
        # (and step 2 logged: the checkpoint's markers can land while step 2's probe still runs)
        _wait_for(lambda: all((ckpt / f"done_rank{r}").is_file() for r in range(2)) and _steps_logged(run_dir) >= 2,
                  launcher, "step 2's checkpoint")
        workers = _engine_workers(launcher)
        assert len(workers) == 4  # each controller's engine in a process of its own, and its supervisor
        _kill_rank_and_wait(launcher, rank=1)
        # the workers died with their ranks (rank 1 killed, rank 0 stopped by torchrun): no engine left behind
        psutil.wait_procs(workers, timeout=30)
        assert not [w for w in workers if w.is_running() and w.status() != psutil.STATUS_ZOMBIE]
    finally:
        launcher.kill()
        out.close()
    first = _steps(run_dir, torn_end=True)
    assert 2 <= len(first) < 6, (tmp_path / "first.out").read_text()[-3000:]

    rerun = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert rerun.returncode == 0, (rerun.stdout[-3000:], rerun.stderr[-5000:])
    assert "placement disaggregated" in rerun.stdout
    resumed = int(re.search(r"resumed from \S+step_(\d+) \(step \d+;", rerun.stdout).group(1))  # 2, or 4 if it got there
    steps = _steps(run_dir)
    assert [r["step"] for r in steps] == [1, 2, 3, 4, 5, 6] and steps[:resumed] == first[:resumed]
    assert steps[resumed]["train/weights_checksum_before"] == first[resumed - 1]["train/weights_checksum_after"]
    for prev, cur in zip(steps, steps[1:]):
        assert cur["train/weights_checksum_before"] == prev["train/weights_checksum_after"]
    print("staleness mean per step:", [r["rollout/staleness_mean"] for r in steps], "resumed after step", resumed,
          "dropped:", [r["rollout/stale_dropped"] for r in steps],
          "mismatch KL:", [r["rollout/mismatch_kl"] for r in steps], "IS weight:", [r["train/is_weight"] for r in steps])
    # the first step of a launch samples with the weights it trains; every other one trained the
    # samples its predecessor's weights drew, while that predecessor trained; none older than 1
    fresh = {0, resumed}
    for i, r in enumerate(steps):
        assert r["rollout/staleness_max"] <= 1 and r["train/weights_checksum_after"] != r["train/weights_checksum_before"]
        assert r["sync/probe_logprob_diff"] < 4e-6  # each sync reached the engine between two rollouts
        if i in fresh:
            assert r["rollout/staleness_mean"] < 1
        else:  # the behaviour policy is the previous weights: vLLM's logprobs differ, and weight the loss
            assert r["rollout/staleness_mean"] == r["rollout/staleness_max"] == 1
            assert r["rollout/mismatch_kl"] > 1e-3 and abs(r["train/is_weight"] - 1) > 1e-3, r  # measured 0.02-0.36
    assert steps[0]["rollout/staleness_max"] == 0 and steps[0]["rollout/mismatch_kl"] < 1e-5
    # dynamic sampling's surplus, one version old at its next step, is two at the one after: dropped
    assert sum(r["rollout/stale_dropped"] for r in steps) > 0
    assert _overlaps(run_dir) >= 3  # 5 steps have a successor, two launches; measured 4
    # nothing generated ahead was counted as consumed before it trained: the in-flight rollout at
    # the kill was drawn again from the checkpoint's data position, and no sample twice
    _assert_every_epoch_drawn_whole(run_dir, keys=16)
