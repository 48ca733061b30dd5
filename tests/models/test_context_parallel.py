"""Context parallelism (models/context.py): the zig-zag split, the layouts refused before any
rank starts, and CP 2 against CP 1 on a micro-batch with a long-ish video (slow: two launches)."""

import json
import sys
from pathlib import Path

import pytest
import torch

from models.context import chunk_index, padded_length
from models.tiny import tiny_model_dir
from models.trainer import TrainerConfig

from subproc import run_json

ROOT = Path(__file__).resolve().parents[2]


def test_zigzag_chunks_cover_the_padded_sequence_once_each():
    assert [padded_length(n, 2) for n in (1, 4, 5, 227)] == [4, 4, 8, 228]
    assert padded_length(227, 1) == 227  # CP 1: no padding, today's path
    assert chunk_index(8, 2, 0).tolist() == [0, 1, 6, 7] and chunk_index(8, 2, 1).tolist() == [2, 3, 4, 5]
    for cp in (2, 3, 4):
        length = padded_length(37, cp)
        parts = [chunk_index(length, cp, r) for r in range(cp)]
        assert sorted(torch.cat(parts).tolist()) == list(range(length))
        # load balance under causal attention: every rank's queries see as many keys
        assert len({int((p + 1).sum()) for p in parts}) == 1


def test_vision_frames_split_over_cp_ranks_in_contiguous_balanced_runs():
    """The vision tower's share of each CP rank (Qwen3-VL): whole frames, balanced by patches."""
    from models.context import ContextParallel

    bounds = lambda patches, size: ContextParallel(size=size).media_bounds(patches)  # noqa: E731
    assert bounds([64] * 8, 2) == [0, 4, 8] and bounds([64] * 9, 4) == [0, 3, 5, 7, 9]
    assert bounds([256, 64, 64, 64, 64], 2) == [0, 1, 5]  # a big image, then a video's frames
    assert bounds([16, 16, 16, 1000], 2) == [0, 3, 4]  # never an empty run
    assert bounds([64], 2) is None  # fewer frames than ranks: every rank runs them all


def test_context_parallel_layouts_are_refused_before_any_rank_starts(tiny_policy):
    TrainerConfig(context_parallel=2).check_world(2, "policy.trainer")
    TrainerConfig(tensor_parallel=2, context_parallel=2, pipeline_parallel=2).check_world(8, "policy.trainer")
    with pytest.raises(ValueError, match=r"policy\.trainer\.context_parallel = 2 x 1 x 2"):
        TrainerConfig(tensor_parallel=2, context_parallel=2).check_world(6, "policy.trainer")
    with pytest.raises(ValueError, match=r"trainer\.context_parallel = 1 x 1 x 4"):
        TrainerConfig(context_parallel=4).check_world(2, "trainer")
    TrainerConfig(context_parallel=2, expert_parallel=2).check_world(2, "policy.trainer")  # EP over the CP ranks
    TrainerConfig(context_parallel=2).check_model(str(tiny_policy), "policy.trainer")  # Qwen2-VL: supported
    # `yatt-mm rl --nproc N` checks its trainer's layout the same way, naming the RL setting
    from yatt_mm.rl.config import RLConfig

    rl = RLConfig()
    rl.policy.trainer.context_parallel = 2
    rl.check_world(2)
    with pytest.raises(ValueError, match=r"policy\.trainer\.context_parallel = 1 x 1 x 2"):
        rl.check_world(3)
    for kind in ("qwen3vl", "qwen3vlmoe", "qwen35", "qwen35moe"):  # every family has a CP path
        TrainerConfig(context_parallel=2).check_model(str(tiny_model_dir(kind)), "policy.trainer")
    with pytest.raises(ValueError, match=r"policy\.trainer\.context_parallel=4: the DeltaNet's key heads \(2\)"):
        TrainerConfig(context_parallel=4).check_model(str(tiny_model_dir("qwen35moe")), "policy.trainer")
    # a2a splits a TP rank's heads over CP: the tiny models' 2 heads split 2 ways, not 4; key/value
    # groups fewer than the ranks are copied (one group at TP 2: a copy on each of 2 CP ranks)
    TrainerConfig(context_parallel=2, context_parallel_comm="a2a").check_model(str(tiny_policy), "policy.trainer")
    with pytest.raises(ValueError, match=r"policy\.trainer\.context_parallel_comm=a2a: a TP rank's 2 query heads must "
                                         r"divide by context_parallel=4, and its 2 key/value groups divide it or be "
                                         r"divided by it .*; use all_gather"):
        TrainerConfig(context_parallel=4, context_parallel_comm="a2a").check_model(str(tiny_policy), "policy.trainer")


def test_at_context_parallel_only_the_controllers_tp_ranks_serve_the_rollout():
    """`yatt-mm rl` at TP 2 x CP 2 x PP 2 (8 ranks, one DP group): the rollout engine spans the
    controller's TP ranks (global 0 and 1); CP peers and later stages neither join it nor push the
    weight sync to theirs. Measured on 4 ranks at TP 2 x CP 2 with a 2-rank engine: sync probe and
    trainer/vLLM gap 1.6-1.9e-6; with the CP peers joining too (the rule before: every first-stage
    rank), their engine followed a leader outside their TP group and the run failed in step 1."""
    from types import SimpleNamespace

    from models.comm import layout_rank
    from yatt_mm.rl.step import serves_rollout

    serving = sorted(layout_rank(t, 0, p, 2, 1, c, 2) for t in range(2) for c in range(2) for p in range(2)
                     if serves_rollout(SimpleNamespace(first_stage=p == 0, cp_rank=c)))
    assert serving == [0, 1]


@pytest.mark.slow
def test_context_parallel_2_matches_cp_1_padded_and_packed(tmp_path):
    """The packing test's 12 samples plus a 16-frame video group (15 rows, 432 video tokens, rows
    of 227 tokens: padded to 228 for 2 x CP chunks), padded and packed: logprobs, entropy,
    gradients and the weights after one train step at CP 2 against CP 1 (fp32). Measured: logprobs
    1.1e-5 (the packing test's own packed-vs-padded figure at TP 1), entropy 7.6e-6, gradients
    1.8e-4 / 2.1e-4 of 669 at most (3e-7 relative), weights 1.2e-5 after a lr 1e-3 step, loss
    equal to 3e-7 relative; each rank's vision tower ran 5/9 and 4/9 of the patches.
    Then the tiny Qwen3-VL on one packed row (an image group, a video group and the longer video:
    983 tokens, 48 image and 120 video tokens; the videos' 4 frames split 3 + 1 over the ranks'
    vision towers), without recompute and with full recompute (the DeepStack features' gradient
    hand-over) against CP 1: logprobs 9.5e-6 (3 ulps of the largest, 33.6), gradients 4.7e-4 of
    819 at most (6e-7 relative), the same with full recompute. The tiny Qwen2.5-VL on the same row
    (1151 tokens, 432 video tokens): logprobs 9.5e-6 of 37.2, gradients 1.1e-4 of 207 (6e-7
    relative), rank 0's tower 0.6 of the patches (one image runs on both ranks: fewer frames than
    ranks). The tiny Qwen3-VL-MoE (4 experts, top 2, load-balancing loss 0.001) on the same
    samples as right-padded rows: logprobs 1.3e-5 of 32.8, gradients 5.5e-4 of 846, its routers'
    6.6e-6 of 4.4. The tiny Qwen3.5 on the packed row (DeltaNet layers: heads over CP), with and
    without full recompute: logprobs 1.1e-5 of 35.7, gradients 1.8e-4 of 212, the DeltaNet's own
    parameters 1.7e-4 of their scale at most; the tiny Qwen3.5-MoE on padded rows: 1.5e-5 of 33.1,
    4.0e-4 of 409, routers 1.2e-5 of 12.5."""
    script = str(ROOT / "tests" / "dist" / "context_parallel.py")
    ref = run_json([sys.executable, script, str(tmp_path / "cp1.pt")], timeout=600)
    assert ref["cp"] == 1
    r = run_json([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", script,
                  str(tmp_path / "cp1.pt")], timeout=600)
    print("CP 2 vs CP 1:", r)
    assert r["cp"] == 2 and r["video_tokens"] >= 400 and r["padded_width"] % 4, r  # the padding path runs
    for kind in ("padded", "packed"):
        assert r[f"{kind}/lp_max_diff"] < 5e-5 and r[f"{kind}/entropy_max_diff"] < 5e-5, r
        assert r[f"{kind}/grad_max_diff"] < 3e-6 * r["grad_scale"], r
    assert abs(r["loss_cp"] - r["loss_cp1"]) < 1e-6 * abs(r["loss_cp1"]), r
    assert r["weight_max_diff"] < 1e-4 and r["step_scale"] > 5e-4, r  # a hundredth of an lr 1e-3 Adam step
    # each rank's vision tower ran its share of the frames (whole on every rank: 1.0), each frame once
    for kind in ("padded", "packed"):
        assert r[f"{kind}/vision_share"] < 0.75 and r[f"{kind}/vision_share_all_ranks"] == 1.0, r
    # Qwen3-VL (its DeepStack features split over CP like the embeddings) and Qwen2.5-VL (window
    # attention in the tower) on a packed row with both media; Qwen3.5 (DeltaNet layers: heads
    # over CP) too, with and without full recompute; the MoE models on right-padded rows
    # core attention by all-to-all (a2a:): on the packed row under full recompute, on padded rows,
    # and in Qwen3.5's attention layers
    for kind, recomputes in (("qwen3vl", ("none", "full", "a2a:full")), ("policy25", ("none",)),
                             ("qwen3vlmoe", ("none", "a2a:none")), ("qwen35", ("none", "full", "a2a:none")),
                             ("qwen35moe", ("none",)), ("qwen3vl_kv1", ("a2a:none", "a2a:selective"))):
        assert r[f"{kind}/image_tokens"] > 0 and r[f"{kind}/video_tokens"] > 0 and r[f"{kind}/tokens"] % 4, r
        for recompute in recomputes:
            run = f"{kind}-{recompute}"
            assert r[f"{run}/lp_max_diff"] < 1e-6 * r[f"{kind}/lp_scale"], r
            assert r[f"{run}/grad_max_diff"] < 3e-6 * r[f"{kind}/grad_scale"], r
            assert r[f"{run}/vision_share"] < 0.75, r
    # Qwen3-VL-MoE on right-padded rows: the routers get this rank's chunks' padding mask, so the
    # load-balancing loss counts the same real tokens as at CP 1 (measured: router gradients
    # 6.6e-6 of 4.4; without the mask 5.4e-5, and 2.85 of 846 elsewhere)
    # and the step's expert-load metrics add the CP ranks' chunks up: load max/mean and the
    # load-balancing loss as at CP 1 (measured 1.3845 both, 1.2148314 vs 1.2148315); Qwen3.5-MoE
    # alike (routers 1.2e-5 of 12.5)
    for kind in ("qwen3vlmoe", "qwen35moe"):
        assert r[f"{kind}/router_grad_max_diff"] < 5e-6 * r[f"{kind}/router_grad_scale"], r
        assert r[f"{kind}/moe_metrics_cp"] == pytest.approx(r[f"{kind}/moe_metrics_cp1"], rel=1e-6), r
    # the DeltaNet's conv, A_log, dt_bias and output norm, each on its own scale: each CP rank
    # adds its heads' slices (measured 1.7e-4 at most, dt_bias' 0.03-sized gradient; a rank
    # taking another's A_log slice: 1 and more)
    for kind in ("qwen35", "qwen35moe"):
        assert r[f"{kind}/deltanet_grad_max_rel"] < 1e-3, r


@pytest.mark.slow
# not in CI: SFT's steps at CP 2 against one process are CI's CP layouts above (tests/dist/pipeline.py),
# the launcher's CP path is the long-video RL run at CP 2 (tests/e2e/test_rl_scale.py), and the SFT
# command on several ranks is tests/e2e/test_sft.py's DP 2 run
@pytest.mark.extended
def test_sft_cli_at_context_parallel_2_steps_like_one_process(tmp_path, tiny_policy):
    """`yatt-mm sft --nproc 2 trainer.context_parallel=2` (one DP replica) against `--nproc 1` on
    the same data: the same step losses, held-out eval (trainer.score over CP) and export.
    Measured: losses equal to 9e-8 relative, eval loss 2.9e-8, exported weights 3.4e-6 apart
    (lr 1e-3 Adam steps)."""
    from safetensors.torch import load_file

    from dataio.index import build_index
    from dataio.synth import write_shards

    data = tmp_path / "data"
    build_index(write_shards(str(data), images=96, videos=0, seed=1), str(data / "index.parquet"))
    common = [sys.executable, "-m", "yatt_mm.cli", "sft", "--config", "configs/tiny_sft.yaml", f"data.shards=[{data}]",
              "steps=3", "eval.every=0", "eval.samples=8", "batch_size=4", "micro_batch_size=2"]
    results = {}
    for name, extra in (("one", ["--nproc", "1"]), ("cp2", ["--nproc", "2", "trainer.context_parallel=2"])):
        run = tmp_path / name
        results[name] = run_json(common + extra + [f"run_dir={run}", f"output_dir={run / 'hf'}"], timeout=900)
        lines = (run / "metrics.jsonl").read_text().splitlines()
        results[name]["losses"] = [json.loads(ln)["train/loss"] for ln in lines if "train/loss" in ln]
    one, cp2 = results["one"], results["cp2"]
    assert len(one["losses"]) == len(cp2["losses"]) == 3
    assert all(abs(a - b) < 1e-5 * abs(b) for a, b in zip(cp2["losses"], one["losses"])), results
    assert abs(cp2["eval_after"]["eval/loss"] - one["eval_after"]["eval/loss"]) < 1e-5 * one["eval_after"]["eval/loss"]
    a, b = (load_file(str(tmp_path / d / "hf" / "model.safetensors")) for d in ("one", "cp2"))
    assert max(float((a[k] - b[k]).abs().max()) for k in a) < 1e-4  # lr 1e-3: a hundredth of an Adam step
