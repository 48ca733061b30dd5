"""`yatt-mm plan` for the families and roles beyond the dense Qwen-VL policy: mixture of experts
(each EP rank's experts, their Adam state over expert DP), context parallelism (language layers
split, vision and KV not), Qwen3.5 (DeltaNet state instead of KV) and the distillation teacher;
each recipe of theirs fits the cluster it states."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import yaml

from yatt_mm.cli import main
from yatt_mm.config import load
from yatt_mm.plan import CUDA, Cluster, MicroBatchShape, activation_bytes, load_spec, make_plan, param_counts, \
    trainer_memory
from yatt_mm.rl.config import RLConfig

ROOT = Path(__file__).resolve().parents[2]

# -- mixture of experts (issue 27) and context parallelism (issue 29) ------------------------------------------------

MOE_RECIPE = "configs/qwen3vl_30b_a3b_16gpu.yaml"
LONG_VIDEO_RECIPE = "configs/qwen3vl_8b_long_video_cp4.yaml"


def test_moe_counts_each_ep_ranks_experts_and_shards_their_adam_state_over_expert_dp():
    """Qwen3-VL-30B-A3B by hand: 48 layers of 128 SwiGLU experts (768 wide, hidden 2048), split
    over EP; everything else (attention, q/k norms, router, embeddings, vision) whole on every
    rank. The published sizes: the language model is Qwen3-30B-A3B's 30.5 B, 3.3 B active."""
    from yatt_mm.plan.params import active_params

    spec = load_spec("Qwen/Qwen3-VL-30B-A3B-Instruct")
    h, layers, experts, inter = 2048, 48, 128, 768
    expert = 3 * inter * h  # fc1 [2I, h] and fc2 [h, I]
    attention = h * (32 + 2 * 4) * 128 + 32 * 128 * h + 2 * 128  # QKV, output projection, q/k norms
    dense_layer = attention + 2 * h + experts * h  # two RMSNorms, the router
    full = param_counts(spec)
    language_dense = layers * dense_layer + 2 * 151936 * h + h  # untied embedding and output layer, final norm
    assert full.language == language_dense + layers * experts * expert
    for ep in (1, 8, 16):
        rank = param_counts(spec, ep=ep)
        assert rank.experts == layers * experts // ep * expert, ep
        assert rank.dense == full.vision + language_dense, ep  # dense parameters whole on every EP rank
    assert round(full.language / 1e9, 1) == 30.5
    assert int((active_params(spec) - full.vision) / 1e8) == 33  # 3.35 B: top-8 of 128 experts a token
    # a token's training FLOPs: 6 x its active parameters (the embedding lookup aside) + attention
    from yatt_mm.plan import train_flops

    token = MicroBatchShape(rows=1, seq=1, scored=1, media_tokens=0, frame_tokens=1)
    matmuls = full.language - 151936 * h - layers * (experts - 8) * expert
    assert train_flops(spec, token) == 6 * matmuls + 6 * layers * 32 * 128
    every_expert = dataclasses.replace(spec, num_experts_per_tok=experts)
    assert train_flops(every_expert, token) - train_flops(spec, token) == 6 * layers * (experts - 8) * expert
    # the distributed optimizer: the dense state over the 16 DP ranks, the experts' over the
    # ranks holding the same experts (16 / EP); the fp32 gradient buffer is not sharded
    from models.trainer import TrainerConfig

    shape = MicroBatchShape(rows=1, seq=1024, scored=256, media_tokens=256, frame_tokens=256)
    for ep in (8, 16):
        rank = param_counts(spec, ep=ep)
        t = trainer_memory(spec, TrainerConfig(dtype="bf16", expert_parallel=ep), 16, shape)
        assert t.optimizer == rank.dense * 12 // 16 + rank.experts * 12 // (16 // ep), ep
        assert (t.weights, t.grads) == (2 * rank.total, 4 * rank.total)


def test_moe_recipe_uses_gspo_and_fits_16x80_and_ep_needs_141gb(capsys):
    """The 30B-A3B recipe: GSPO, TP 4 x PP 2 x DP 2, fits 2 nodes x 8 x 80 GB. Its EP 16 variant
    (the header's override) fits 141 GB GPUs but not 80 GB: under EP the rollout engine spans one
    rank and holds every expert, woken beside the whole trainer rank for the weight sync."""
    cfg = load(RLConfig, ROOT / MOE_RECIPE)
    assert cfg.algorithm.policy_loss == "gspo"
    plan = make_plan(cfg, Cluster(gpus_per_node=8, nodes=2, gpu_memory_gib=80))
    assert plan.fits, plan.problems
    spec = plan.spec
    assert plan.trainer.params.experts == 24 * 128 * 3 * 768 * 2048 // 4  # a stage's experts, split over TP 4
    assert plan.rollout.weights == param_counts(spec).total * 2 // 4
    args = ["plan", "--config", str(ROOT / MOE_RECIPE), "--nodes", "2", "--gpus-per-node", "8"]
    assert main(args + ["--gpu-memory-gb", "80"]) == 0
    out = capsys.readouterr().out
    assert "verdict: fits" in out and "active parameters 3.89 B of 31.07 B" in out
    ep = ["policy.trainer.tensor_parallel=1", "policy.trainer.pipeline_parallel=1", "policy.trainer.expert_parallel=16",
          "rollout.engine.tensor_parallel_size=1", "rollout.engine.gpu_memory_utilization=0.55"]
    ep_cfg = load(RLConfig, ROOT / MOE_RECIPE, ep)
    big = make_plan(ep_cfg, Cluster(gpus_per_node=8, nodes=2, gpu_memory_gib=141))
    assert big.fits, big.problems
    assert big.trainer.params.experts == 48 * 8 * 3 * 768 * 2048  # 8 of the 128 experts of each layer
    assert big.rollout.weights == param_counts(spec).total * 2  # vLLM at TP 1: every expert resident
    assert big.trainer.activations.dispatched == 48 * 3072 * 8 * 2048 * 2  # tokens x top-k x hidden, bf16
    small = make_plan(ep_cfg, Cluster(gpus_per_node=8, nodes=2, gpu_memory_gib=80))
    assert not small.fits and any(p.startswith("phase sync") for p in small.problems), small.problems
    assert main(args + ["--gpu-memory-gb", "141", *ep]) == 0
    assert "8 on each of EP 16 ranks" in capsys.readouterr().out
    # one node (in place of the recipe's two) at EP 4 does not fit; the advice names twice the expert parallelism
    assert main(["plan", "--config", str(ROOT / MOE_RECIPE), "--nodes", "1", "--gpu-memory-gb", "141", *ep[:2],
                 "policy.trainer.expert_parallel=4", *ep[3:]]) == 1
    out = capsys.readouterr().out
    assert "DOES NOT FIT" in out and "policy.trainer.expert_parallel=8" in out.split("verdict")[1]


def test_context_parallel_splits_the_language_layers_and_vision_not_kv():
    """At CP 2 a rank's language layers keep half of CP 1's for every per-token tensor; core
    attention's gathered K and V stay whole rows; the vision tower runs half the frames; the
    loss scores at most a chunk of each row on a rank."""
    from yatt_mm.plan import language_block, layer_bytes
    from yatt_mm.plan.activations import _core_attention_bytes
    from yatt_mm.plan.batch import context_share

    spec = load_spec("Qwen/Qwen2-VL-7B-Instruct")
    shape = MicroBatchShape(rows=2, seq=8192, scored=2 * 1024, media_tokens=2 * 4096, frame_tokens=256)
    half = context_share(shape, 2)
    assert (half.rows, half.seq, half.scored, half.media_tokens) == (2, 4096, 2 * 1024, 4096)  # 16 of 32 frames
    assert context_share(dataclasses.replace(shape, media_tokens=256), 2).media_tokens == 256  # 1 frame: whole
    assert context_share(shape, 8).scored == 2 * 512  # a response longer than a chunk spans two ranks
    one, two = language_block(spec, shape, 1), language_block(spec, half, 1, 2)
    # no recompute: norms, projections, MLP keep half the positions; core attention more than half
    split1 = layer_bytes(one, 2, CUDA, "none") - _core_attention_bytes(one, 2)
    assert (layer_bytes(two, 2, CUDA, "none") - _core_attention_bytes(two, 2)) * 2 == split1
    # selective keeps core attention's local inputs (the gather runs again), full the layer's input
    for recompute in ("selective", "full"):
        assert layer_bytes(two, 2, CUDA, recompute) * 2 == layer_bytes(one, 2, CUDA, recompute), recompute
    assert _core_attention_bytes(two, 2) > 2 * 2 * shape.tokens * one.kv  # K and V of the whole rows, bf16
    # the vision tower's frames split over the CP ranks (models/context.py): 16 of the 32 frames
    # on each of 2 ranks, half the tower's activations (but its rotary table, one frame's, on
    # every rank: 295 kB of 37 GB for Qwen3-VL); Qwen2.5-VL's windows too
    def vision(model_spec, cp, recompute="none"):
        media = activation_bytes(model_spec, shape, 1, 2, recompute, cp=cp).saved
        return media - activation_bytes(model_spec, dataclasses.replace(shape, media_tokens=0), 1, 2, recompute,
                                        cp=cp).saved
    for recompute in ("none", "full"):
        assert abs(vision(spec, 2, recompute) * 2 - vision(spec, 1, recompute)) <= 1e-5 * vision(spec, 1, recompute)
        assert activation_bytes(spec, shape, 1, 2, recompute, cp=2).peak < activation_bytes(spec, shape, 1, 2,
                                                                                           recompute).peak
    for name in ("Qwen/Qwen3-VL-8B-Instruct", "Qwen/Qwen2.5-VL-7B-Instruct"):
        other = load_spec(name)
        assert abs(vision(other, 2) * 2 - vision(other, 1)) <= 1e-5 * vision(other, 1), name


def test_long_video_recipe_fits_at_cp4_and_a_cp_that_does_not_divide_is_refused(capsys):
    cfg = load(RLConfig, ROOT / LONG_VIDEO_RECIPE)
    assert cfg.policy.trainer.context_parallel == 4 and cfg.rollout.engine.max_model_len == 32768
    plan = make_plan(cfg, Cluster(gpus_per_node=8, gpu_memory_gib=80))
    assert plan.fits, plan.problems
    assert plan.shape.seq == 32768 and plan.shape.media_tokens > 30000  # a minute of video a sample
    assert plan.dp == 1 and plan.trainer.activations.peak < trainer_memory(
        plan.spec, dataclasses.replace(cfg.policy.trainer, context_parallel=1), 4, plan.shape).activations.peak
    recipe = str(ROOT / LONG_VIDEO_RECIPE)
    assert main(["plan", "--config", recipe]) == 0
    assert "TP 2 x CP 4 x PP 1 x DP 1" in capsys.readouterr().out
    assert main(["plan", "--config", recipe, "policy.trainer.context_parallel=3"]) == 2
    assert "policy.trainer.context_parallel = 2 x 1 x 3" in capsys.readouterr().err
    # core attention by all-to-all: no chunk masks (the recipe's full recompute keeps nothing
    # else of attention: 0.28 GiB less), and a recomputed layer holds 1/CP of the whole rows' K
    # and V; refused where a TP rank's key/value groups do not split CP ways
    from yatt_mm.plan.activations import _chunk_mask_elems

    assert cfg.policy.trainer.context_parallel_comm == "a2a"  # the recipe's
    cfg.policy.trainer.context_parallel_comm = "all_gather"
    gather = make_plan(cfg, Cluster(gpus_per_node=8, gpu_memory_gib=80))
    print("long-video recipe, activation peak all_gather vs a2a (GiB):", gather.trainer.activations.peak / 2**30,
          plan.trainer.activations.peak / 2**30)
    assert gather.trainer.activations.saved - plan.trainer.activations.saved == _chunk_mask_elems(32768, 4) * 2
    assert plan.trainer.activations.peak < gather.trainer.activations.peak
    # at CP 8 a TP rank's 4 key/value groups are copied, one to each rank: planned; 3 does not split 16 heads
    assert main(["plan", "--config", recipe, "--nodes", "2", "policy.trainer.context_parallel=8"]) == 0
    assert "TP 2 x CP 8 x PP 1 x DP 1" in capsys.readouterr().out
    assert main(["plan", "--config", recipe, "--nodes", "3", "policy.trainer.context_parallel=3"]) == 2
    assert ("policy.trainer.context_parallel_comm=a2a: a TP rank's 16 query heads must divide by context_parallel=3, "
            "and its 4 key/value groups divide it or be divided by it" in capsys.readouterr().err)
    # the MoE recipe at CP 2 (TP 4 x PP 2 x CP 2 on 16 GPUs), with EP 2 over the CP ranks too,
    # plans; the trainer's refusals, before any GPU: EP that does not divide DP x CP, EP without experts
    assert main(["plan", "--config", str(ROOT / MOE_RECIPE), "--nodes", "2", "policy.trainer.context_parallel=2"]) == 0
    assert "TP 4 x CP 2 x PP 2 x DP 1" in capsys.readouterr().out
    assert main(["plan", "--config", str(ROOT / MOE_RECIPE), "--nodes", "2", "policy.trainer.context_parallel=2",
                 "policy.trainer.expert_parallel=2"]) == 0
    assert "TP 4 x CP 2 x PP 2 x DP 1, EP 2" in capsys.readouterr().out
    assert main(["plan", "--config", str(ROOT / MOE_RECIPE), "--nodes", "2", "policy.trainer.context_parallel=2",
                 "policy.trainer.expert_parallel=4"]) == 2
    assert "policy.trainer.expert_parallel = 4 x 2 x 4" in capsys.readouterr().err
    assert main(["plan", "--config", recipe, "policy.trainer.expert_parallel=2",
                 "policy.trainer.context_parallel=1", "policy.trainer.tensor_parallel=1",
                 "rollout.engine.tensor_parallel_size=1"]) == 2
    assert "policy.trainer.expert_parallel=2: qwen3_vl is not a mixture-of-experts model" in capsys.readouterr().err


# -- Qwen3.5: hybrid linear attention (issue 30) -------------------------------------------------------------------

QWEN35_RECIPE = "configs/qwen35_35b_a3b_16gpu.yaml"


def test_qwen35_counts_deltanet_gated_attention_shared_expert_and_a_state_instead_of_kv():
    """Qwen3.5-35B-A3B by hand: 40 layers of hidden 2048, every 4th gated attention (16 query
    heads and their 16 gate heads, 2 KV heads, of 256), the rest gated DeltaNets (16 key / 32
    value heads of 128, conv kernel 4); every MLP 256 experts of 512 (top 8), a router and a
    shared expert of 512 with its gate. vLLM keeps K and V for the 10 attention layers only, and
    for each DeltaNet layer a state per sequence: 32 heads x 128 x 128 plus 3 conv inputs."""
    from yatt_mm.plan import kv_bytes_per_token, state_bytes_per_sequence
    from yatt_mm.plan.params import active_params

    spec = load_spec("Qwen/Qwen3.5-35B-A3B")
    h, vocab, layers, full_layers = 2048, 248320, 40, 10
    attention = h * (2 * 16 + 2 * 2) * 256 + 16 * 256 * h + 2 * 256  # QKV and gate, output, q/k norms
    qk, v = 16 * 128, 32 * 128
    delta = h * (2 * qk + 2 * v + 2 * 32) + (2 * qk + v) * 4 + 2 * 32 + 128 + v * h  # in_proj, conv, A/dt, norm, out
    expert = 3 * 512 * h
    mlp = 256 * h + expert + h  # router, shared expert and its gate
    experts = layers * 256 * expert
    full = param_counts(spec)
    language = (full_layers * attention + (layers - full_layers) * delta + layers * (2 * h + mlp) + experts
                + 2 * vocab * h + h)
    assert (full.language, full.experts) == (language, experts)
    assert round(full.total / 1e9, 2) == 35.11
    assert round((active_params(spec) - full.vision) / 1e9, 2) == 3.45  # "A3B": top-8 of 256 experts + the rest
    assert param_counts(spec, tp=2).experts == experts // 2
    assert kv_bytes_per_token(spec, 1) == 2 * full_layers * 2 * 256 * 2
    assert state_bytes_per_sequence(spec, 1) == (layers - full_layers) * (32 * 128 * 128 + (2 * qk + v) * 3) * 2
    assert state_bytes_per_sequence(spec, 2) == state_bytes_per_sequence(spec, 1) // 2
    assert state_bytes_per_sequence(load_spec("Qwen/Qwen3-VL-8B-Instruct"), 1) == 0


def test_qwen35_recipe_uses_gspo_and_fits_16x141_not_16x80(capsys):
    """The 35B-A3B recipe: GSPO, TP 2 x PP 4 x DP 2 on 2 x 8 H200s; the engine's cache holds whole
    sequences (their KV and their DeltaNet state). On 16 x 80 GB the sync phase (the trainer rank
    beside half the model in vLLM) does not fit; on 32 it does, and on 16 with EP 4 beside TP 2."""
    from yatt_mm.plan import kv_bytes_per_token, state_bytes_per_sequence

    cfg = load(RLConfig, ROOT / QWEN35_RECIPE)
    assert cfg.algorithm.policy_loss == "gspo" and cfg.policy.trainer.dtype == "bf16"
    plan = make_plan(cfg, Cluster(gpus_per_node=8, nodes=2, gpu_memory_gib=141))
    assert plan.fits, plan.problems
    e, spec = plan.rollout, plan.spec
    per_sequence = e.max_model_len * kv_bytes_per_token(spec, 2) + state_bytes_per_sequence(spec, 2)
    assert e.state_bytes == state_bytes_per_sequence(spec, 2)
    assert e.kv_tokens == e.kv_cache // per_sequence * e.max_model_len
    args = ["plan", "--config", str(ROOT / QWEN35_RECIPE), "--nodes", "2", "--gpus-per-node", "8"]
    assert main(args + ["--gpu-memory-gb", "141"]) == 0
    out = capsys.readouterr().out
    assert "verdict: fits" in out and "active parameters 3.90 B of 35.11 B" in out
    assert "MiB of linear-attention state" in out
    small = make_plan(cfg, Cluster(gpus_per_node=8, nodes=2, gpu_memory_gib=80))
    assert not small.fits and any(p.startswith("phase sync") for p in small.problems), small.problems
    # the header's 32-GPU option: with full recompute (selective leaves the DeltaNet layers whole)
    more = load(RLConfig, ROOT / QWEN35_RECIPE, ["rollout.engine.gpu_memory_utilization=0.6"])
    assert not make_plan(more, Cluster(gpus_per_node=8, nodes=4, gpu_memory_gib=80)).fits
    more = load(RLConfig, ROOT / QWEN35_RECIPE, ["rollout.engine.gpu_memory_utilization=0.6", "policy.trainer.recompute=full"])
    assert make_plan(more, Cluster(gpus_per_node=8, nodes=4, gpu_memory_gib=80)).fits
    # expert parallelism beside TP (the header's 80 GB option): the experts' weights and state split over EP 4
    ep = load(RLConfig, ROOT / QWEN35_RECIPE, ["policy.trainer.pipeline_parallel=2", "policy.trainer.expert_parallel=4",
                                              "rollout.engine.gpu_memory_utilization=0.55"])
    ep_plan = make_plan(ep, Cluster(gpus_per_node=8, nodes=2, gpu_memory_gib=80))
    assert ep_plan.fits, ep_plan.problems
    assert ep_plan.trainer.params.experts == param_counts(spec, 2, 2, 0, ep=4).experts == 20 * 64 * 3 * 512 * 2048 // 2
    # context parallelism (models/qwen35/model.py: the DeltaNet layers split heads over CP, the
    # attention layers positions): CP 2 in place of DP 2 halves the language activations' rows;
    # a CP the DeltaNet's 16 key heads do not divide into (TP 2 x CP 16) is refused by name
    cp = load(RLConfig, ROOT / QWEN35_RECIPE, ["policy.trainer.context_parallel=2"])
    cp_plan = make_plan(cp, Cluster(gpus_per_node=8, nodes=2, gpu_memory_gib=141))
    assert cp_plan.fits and cp_plan.dp == 1, cp_plan.problems
    assert cp_plan.trainer.activations.saved < 0.75 * plan.trainer.activations.saved
    assert main(args + ["--nodes", "16", "policy.trainer.context_parallel=16"]) == 2
    assert ("policy.trainer.context_parallel=16: the DeltaNet's key heads (16) and value heads (32) must divide by "
            "tensor_parallel x context_parallel = 2 x 16") in capsys.readouterr().err


def test_a_distillation_teacher_is_planned_in_its_own_phase_or_resident_as_a_server():
    """The recipe's in-process teacher (Qwen3-VL-8B for a 2B student): its engine awake in the
    teacher phase only (after the rollout, before training), asleep in host memory otherwise; the
    same teacher as a server: resident on its GPU in every phase."""
    recipe = ROOT / "configs/qwen3vl_2b_from_8b_distill_8gpu.yaml"
    cfg = load(RLConfig, recipe)
    plan = make_plan(cfg, Cluster(gpus_per_node=8, gpu_memory_gib=80))
    assert plan.fits, plan.problems
    phases = {p.phase: {ln.what: ln.nbytes for ln in p.lines} for p in plan.phases}
    assert list(phases).index("teacher") == list(phases).index("rollout") + 2  # rollout, reward, teacher
    teacher = plan.judges["teacher"]
    assert teacher.max_model_len == cfg.rollout.engine.max_model_len + 1
    assert teacher.weights > 2 * plan.rollout.weights  # the 8B teacher's weights, not the 2B student's
    assert phases["teacher"]["teacher weights"] == teacher.weights and "vLLM rollout weights" not in phases["teacher"]
    assert all("teacher weights" not in lines for name, lines in phases.items() if name != "teacher")
    assert any(ln.what.startswith("teacher weights asleep") for ln in plan.host)
    served = load(RLConfig, recipe, ["algorithm.distill.backend=server", "algorithm.distill.devices=0"])
    plan = make_plan(served, Cluster(gpus_per_node=8, gpu_memory_gib=80))
    on_gpu0 = [p for p in plan.phases if p.gpus.startswith("GPU 0 (+ teacher server)")]
    assert on_gpu0 and all(any(ln.what == "teacher server (x1, resident)" for ln in p.lines) for p in on_gpu0)
    assert not any(ln.what.startswith("teacher") for p in plan.phases if p not in on_gpu0 for ln in p.lines)
