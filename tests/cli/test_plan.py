"""`yatt-mm plan`: every checked-in recipe fits the cluster it states (its `cluster` section), and so
does every plan command of its header; the flags override the stated cluster figure by figure; a
heavy variant on 24 GB GPUs does not fit and names a fix, and the numbers behind it match the real
model: parameter counts and the bytes
autograd keeps (measured on the tiny Megatron Qwen2-VL, Qwen2.5-VL and Qwen3-VL in a fresh
process; Qwen3-VL's per-stage counts at TP 2 and PP 2 under torchrun, slow)."""

from __future__ import annotations

import ast
import dataclasses
import itertools
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from subproc import run_json
from yatt_mm.cli import main
from yatt_mm.config import load
from yatt_mm.plan import (CUDA, Assumptions, Cluster, MicroBatchShape, PlanError, activation_bytes, input_problems,
                          load_spec, make_plan, param_counts, trainer_memory)
from yatt_mm.rl.config import RLConfig

ROOT = Path(__file__).resolve().parents[2]
RECIPES = ["configs/qwen2vl_7b_8gpu.yaml", "configs/qwen25vl_3b_8gpu.yaml", "configs/qwen3vl_8b_8gpu.yaml"]
GIB = 2**30


@pytest.mark.parametrize("recipe", RECIPES)
def test_recipe_loads_and_fits_8x80(recipe, capsys):
    cfg = load(RLConfig, ROOT / recipe)  # validates every section
    assert cfg.policy.trainer.dtype == "bf16" and cfg.policy.trainer.distributed_optimizer
    assert [wj.judge.backend for wj in cfg.reward.judges] == ["server"]
    plan = make_plan(cfg, Cluster(gpus_per_node=8, gpu_memory_gib=80))
    assert plan.fits, plan.problems
    assert {p.phase for p in plan.phases} >= {"rollout", "train", "sync"}
    assert all(p.total < 80 * GIB for p in plan.phases)
    assert plan.trainer.peak > 10 * GIB  # a real model's trainer, not a tiny one
    assert main(["plan", "--config", str(ROOT / recipe), "--gpus-per-node", "8", "--gpu-memory-gb", "80"]) == 0
    out = capsys.readouterr().out
    assert "verdict: fits" in out
    # the GPU constants say where they were measured; each phase on a GPU carries the context
    assert "CUDA context 2.44 GiB a process and allocator slack 6%: measured on one NVIDIA H200" in out
    assert all(any(ln.what == "CUDA context" and ln.nbytes == int(2.44 * GIB) for ln in p.lines) for p in plan.phases)


def _rl_recipes() -> dict[str, dict]:
    """configs/*.yaml that are RL configs (a policy section), by path: their YAML as written."""
    raw = {f"configs/{p.name}": yaml.safe_load(p.read_text()) for p in sorted((ROOT / "configs").glob("*.yaml"))}
    return {path: data for path, data in raw.items() if "policy" in data}


# What CI checks of every recipe that says which cluster it is for (make test)
STATED = [path for path, data in _rl_recipes().items() if data.get("cluster")]


def test_every_recipe_for_a_real_model_states_its_cluster():
    """A recipe for a published model names the cluster it was sized for (the tiny CPU ones need none)."""
    real = [path for path, data in _rl_recipes().items()
            if not str(data["policy"].get("model", "")).startswith(("tiny:", "warmstart:"))]
    assert len(real) >= 6 and set(real) <= set(STATED), sorted(set(real) - set(STATED))
    for path in STATED:
        assert {"nodes", "gpus_per_node", "gpu_memory_gib"} <= set(load(RLConfig, ROOT / path).cluster.stated()), path


@pytest.mark.parametrize("recipe", STATED)
def test_a_recipe_fits_the_cluster_it_states(recipe, capsys):
    """`yatt-mm plan --config RECIPE` with no flag plans on the recipe's `cluster` section, and it fits."""
    stated = load(RLConfig, ROOT / recipe).cluster.stated()
    code = main(["plan", "--config", str(ROOT / recipe)])
    out = capsys.readouterr().out
    assert (f"cluster: {stated['nodes']} node(s) x {stated['gpus_per_node']} GPUs of {stated['gpu_memory_gib']:g} "
            "GiB;") in out, out[:600]
    assert "note: cluster figures from the config: cluster.gpus_per_node, cluster.gpu_memory_gib, cluster.nodes" in out
    assert code == 0 and "verdict: fits" in out, out[out.find("GPU memory per phase"):]


def _header_plan_commands(path: Path) -> list[list[str]]:
    """The arguments of each `yatt-mm plan` command in a recipe's header comment (a line ending in
    a backslash goes on in the next; an opening parenthesis starts the prose after it)."""
    header = "\n".join(line[1:] for line in itertools.takewhile(lambda ln: ln.startswith("#"),
                                                                path.read_text().splitlines()))
    commands = []
    for line in header.replace("\\\n", " ").splitlines():
        words = line.split()
        if words[:2] == ["yatt-mm", "plan"]:
            commands.append(list(itertools.takewhile(lambda w: not w.startswith("("), words[2:])))
    return commands


@pytest.mark.parametrize("recipe", STATED)
def test_every_plan_command_of_a_recipes_header_fits(recipe, capsys):
    """A header shows how to plan the recipe (on its cluster) and its variants (flags and overrides
    on top); each command it shows fits, as the header says."""
    commands = _header_plan_commands(ROOT / recipe)
    assert commands and commands[0] == ["--config", recipe], commands
    for args in commands:
        code = main(["plan", *[str(ROOT / a) if a.startswith("configs/") else a for a in args]])
        out = capsys.readouterr().out
        assert code == 0 and "verdict: fits" in out, (args, out[out.find("GPU memory per phase"):])


def test_flags_override_the_stated_cluster_figure_by_figure(capsys):
    """The Qwen3.5 recipe states 2 nodes x 8 GPUs of 141 GiB: --gpu-memory-gb 80 replaces that figure
    alone (and then it does not fit); an override of the section does the same; a figure set back
    to 0 (not stated) takes the plan's default; a stated host memory is checked."""
    recipe = str(ROOT / QWEN35_RECIPE)
    for change in (["--gpu-memory-gb", "80"], ["cluster.gpu_memory_gib=80"]):
        assert main(["plan", "--config", recipe, *change]) == 1, change
        out = capsys.readouterr().out
        assert "cluster: 2 node(s) x 8 GPUs of 80 GiB;" in out and "DOES NOT FIT" in out, change
    assert main(["plan", "--config", recipe, "--gpu-memory-gb", "80"]) == 1
    assert ("note: cluster figures from the flags: --gpu-memory-gb; from the config: cluster.gpus_per_node, "
            "cluster.nodes; from the defaults: host_memory_gib") in capsys.readouterr().out
    assert main(["plan", "--config", recipe, "--nodes", "4", "cluster.gpus_per_node=0"]) == 0
    out = capsys.readouterr().out
    assert "cluster: 4 node(s) x 8 GPUs of 141 GiB;" in out and "verdict: fits" in out
    assert ("note: cluster figures from the flags: --nodes; from the config: cluster.gpu_memory_gib; from the "
            "defaults: gpus_per_node, host_memory_gib") in out
    assert main(["plan", "--config", recipe, "cluster.host_memory_gib=256"]) == 1
    out = capsys.readouterr().out
    assert "host memory per node: 542.0 GiB > 256.0 GiB" in out and "of 256" in out
    assert main(["plan", "--config", recipe, "cluster.host_memory_gib=256", "--host-memory-gb", "0"]) == 0  # 0: unchecked
    capsys.readouterr()


def test_heavy_7b_on_24gb_does_not_fit_and_names_a_setting(capsys):
    args = ["plan", "--config", str(ROOT / RECIPES[0]), "--gpus-per-node", "8", "--gpu-memory-gb", "24",
            "policy.trainer.distributed_optimizer=false", "policy.trainer.recompute=none"]
    assert main(args) == 1
    out = capsys.readouterr().out
    assert "DOES NOT FIT" in out and "OVER" in out
    assert "policy.trainer.recompute=full" in out  # the largest single saving here
    assert "policy.trainer.distributed_optimizer=true" in out


def test_qwen3vl_plans_full_recompute_only_without_a_pipeline(capsys):
    """The Qwen3-VL trainer runs full recompute without a pipeline only (under one, a recomputed
    layer would take another micro-batch's DeepStack features), so the plan refuses it at PP 2
    naming the setting and plans it at PP 1, where it saves activations."""
    recipe = str(ROOT / "configs/qwen3vl_8b_8gpu.yaml")
    assert main(["plan", "--config", recipe, "policy.trainer.recompute=full", "policy.trainer.pipeline_parallel=2"]) == 2
    assert "policy.trainer.recompute=full with pipeline_parallel > 1 is not implemented" in capsys.readouterr().err
    assert main(["plan", "--config", recipe, "policy.trainer.recompute=full"]) == 0
    full = capsys.readouterr().out
    assert main(["plan", "--config", recipe]) == 0  # selective, as the recipe says
    assert "verdict: fits" in full and full != capsys.readouterr().out


def test_distributed_optimizer_divides_the_optimizer_state_by_dp():
    from models.trainer import TrainerConfig

    spec = load_spec("Qwen/Qwen2-VL-7B-Instruct")
    shape = MicroBatchShape(rows=1, seq=1024, scored=256, media_tokens=256, frame_tokens=256)
    sharded = TrainerConfig(dtype="bf16", distributed_optimizer=True)
    dp1, dp2 = (trainer_memory(spec, sharded, dp, shape).optimizer for dp in (1, 2))
    assert dp1 == 12 * 8_291_375_616  # Adam m, v and fp32 master weights: 12 bytes a parameter
    assert dp2 * 2 == dp1
    plain = TrainerConfig(dtype="bf16", distributed_optimizer=False)
    assert trainer_memory(spec, plain, 2, shape).optimizer == dp1  # not sharded: every DP rank holds it all
    assert trainer_memory(spec, sharded, 2, shape).grads == 4 * 8_291_375_616  # the fp32 grad buffer is not sharded


def test_known_models_have_their_published_sizes():
    published = {"Qwen/Qwen2-VL-2B-Instruct": 2.21, "Qwen/Qwen2-VL-7B-Instruct": 8.29,
                 "Qwen/Qwen2-VL-72B-Instruct": 73.41, "Qwen/Qwen2.5-VL-3B-Instruct": 3.75,
                 "Qwen/Qwen2.5-VL-7B-Instruct": 8.29, "Qwen/Qwen2.5-VL-72B-Instruct": 73.41,
                 # the 8B model card states 8.77 B (see yatt_mm/plan/architectures.py for the rest)
                 "Qwen/Qwen3-VL-2B-Instruct": 2.13, "Qwen/Qwen3-VL-4B-Instruct": 4.44,
                 "Qwen/Qwen3-VL-8B-Instruct": 8.77, "Qwen/Qwen3-VL-32B-Instruct": 33.36}
    for model_id, billions in published.items():
        assert round(param_counts(load_spec(model_id)).total / 1e9, 2) == billions, model_id
    assert param_counts(load_spec("/models/Qwen2-VL-7B-Instruct")).total == 8_291_375_616  # matched by name
    spec = load_spec("/models/Qwen3-VL-8B-Instruct")  # the table read by the Qwen3-VL family's own parser
    assert (spec.model_type, spec.num_deepstack, spec.patch_size, spec.num_position_embeddings) == ("qwen3_vl", 3, 16,
                                                                                                    2304)
    with pytest.raises(ValueError, match="not a known model"):
        load_spec("/models/Llama-3-8B")


# Impossible cluster figures and assumptions: (the flags, the message that names the flag).
BAD_FIGURES = [
    (["--gpu-memory-gb", "0"], "--gpu-memory-gb must be > 0, not 0.0"),
    (["--gpu-memory-gb", "-8"], "--gpu-memory-gb must be > 0, not -8.0"),
    (["--gpu-memory-gb", "nan"], "--gpu-memory-gb must be a finite number, not nan"),
    (["--gpu-memory-gb", "inf"], "--gpu-memory-gb must be a finite number, not inf"),
    (["--gpus-per-node", "0"], "--gpus-per-node must be >= 1, not 0"),
    (["--gpus-per-node", "-4"], "--gpus-per-node must be >= 1, not -4"),
    (["--nodes", "0"], "--nodes must be >= 1, not 0"),
    (["--host-memory-gb", "-1"], "--host-memory-gb must be >= 0, not -1.0"),
    (["--seq-len", "-1"], "--seq-len must be >= 0, not -1"),
    (["--media-tokens", "-2"], "--media-tokens must be >= -1, not -2"),
    (["--frame-tokens", "-1"], "--frame-tokens must be >= 0, not -1"),
]


def test_impossible_cluster_figures_are_refused_naming_the_flag_before_any_work(capsys, monkeypatch):
    import yatt_mm.config

    def no_work(*args, **kwargs):
        raise AssertionError("the config was read before the cluster figures were checked")

    monkeypatch.setattr(yatt_mm.config, "load", no_work)  # run_plan imports it when it runs
    for args, message in BAD_FIGURES:
        assert main(["plan", "--config", str(ROOT / RECIPES[0]), *args]) == 2, args
        captured = capsys.readouterr()
        assert captured.err.startswith(f"yatt-mm plan: {message} (") and captured.err.count("\n") == 1, captured.err
        assert captured.out == ""
    # several at once: one line each, every flag named
    assert main(["plan", "--gpus-per-node", "0", "--nodes", "0", "--gpu-memory-gb", "-1"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert [line.split()[2] for line in err] == ["--gpus-per-node", "--gpu-memory-gb", "--nodes"], err
    # argparse refuses what is not a number of the flag's type, with its usage exit code 2
    with pytest.raises(SystemExit) as refused:
        main(["plan", "--nodes", "1.5"])
    assert refused.value.code == 2 and "argument --nodes: invalid int value: '1.5'" in capsys.readouterr().err
    # the library refuses the same figures (before it looks at the config), and the defaults pass
    with pytest.raises(PlanError, match="--gpu-memory-gb must be > 0, not 0 .*Cluster.gpu_memory_gib"):
        make_plan(None, Cluster(gpu_memory_gib=0))
    with pytest.raises(PlanError, match="--nodes must be a whole number, not 1.5"):
        make_plan(None, Cluster(nodes=1.5))
    assert input_problems(Cluster(), Assumptions()) == []
    assert input_problems(Cluster(gpus_per_node=1, gpu_memory_gib=0.5, host_memory_gib=0),
                          Assumptions(seq_len=1, media_tokens=0, frame_tokens=1)) == []


def test_the_command_exits_2_on_an_impossible_cluster():
    out = subprocess.run([sys.executable, "-m", "yatt_mm.cli", "plan", "--gpu-memory-gb", "0", "--nodes", "-1"],
                         capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 2, out
    assert "--gpu-memory-gb must be > 0" in out.stderr and "--nodes must be >= 1" in out.stderr
    assert out.stdout == ""


# Single-process Megatron in a fresh interpreter (never beside the pytest process's other state):
# the tiny models' parameter counts, and the bytes autograd keeps for one forward
# of an image micro-batch with a scored response span, as the trainer computes its logprobs,
# without recompute and with full recompute.
# Qwen2-VL, Qwen2.5-VL, Qwen3-VL (DeepStack, q/k norms, position table), Qwen3-VL-MoE (4 experts,
# top-2), Qwen3.5 and Qwen3.5-MoE (gated DeltaNet and gated attention layers, a shared expert)
KINDS = ["policy", "policy25", "qwen3vl", "qwen3vlmoe", "qwen35", "qwen35moe"]
COUNT_ONLY: list[str] = []  # kinds whose parameters are counted but not their activations
LORA_KINDS = ["policy", "policy25", "qwen3vl"]  # the families with LoRA: also counted with adapters
WORKER = r"""
import json, sys
import models, torch
from models.comm import init_parallel
from models.family import read_spec
from models.inputs import VLMInputs
from models.tiny import tiny_model_dir
from models.logprobs import next_token_labels, token_logprobs
from models.lora import LoRAConfig, add_adapters, is_adapter
from models.trainer import TrainerConfig, build_module

init_parallel(1)
out = {}
COUNT_ONLY, LORA_KINDS = json.loads(sys.argv[1]), json.loads(sys.argv[2])


def saved_bytes(module, spec):
    rows, seq, media, scored = 2, 160, 64, 32
    ids = torch.randint(0, 600, (rows, seq), generator=torch.Generator().manual_seed(0))
    ids[:, 4:4 + media] = spec.image_token_id
    patch = spec.in_channels * spec.temporal_patch_size * spec.patch_size**2  # 1176 (patch 14), 1536 (patch 16)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids),
             "pixel_values": torch.randn(rows * media * 4, patch), "image_grid_thw": torch.tensor([[1, 16, 16]] * rows)}
    score = torch.zeros(rows, seq, dtype=torch.bool)
    score[:, seq - scored - 1: seq - 1] = True
    inputs = VLMInputs.from_processor(spec, batch)
    kept = {}
    def pack(t):
        kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logits = module(inputs)  # as the trainer scores an RL micro-batch: the response positions only
        token_logprobs(logits[score], next_token_labels(ids)[score])
    weights = {p.untyped_storage().data_ptr() for p in module.parameters()}
    return sum(n for ptr, n in kept.items() if ptr not in weights)


for kind in sys.argv[3:]:
    path = str(tiny_model_dir(kind))
    spec = read_spec(path)
    for recompute in ("none", "full"):
        module = build_module(path, spec, TrainerConfig(recompute=recompute)).train()
        out.setdefault(kind, {"params": sum(p.numel() for p in module.parameters()), "saved_bytes": {}})
        if kind in COUNT_ONLY:
            break
        out[kind]["saved_bytes"][recompute] = saved_bytes(module, spec)
    if kind in LORA_KINDS:  # rank-4 adapters with dropout on every projection, the base frozen
        module = build_module(path, spec, TrainerConfig(recompute="none")).train()
        add_adapters(module, LoRAConfig(rank=4, dropout=0.1), seed=0)
        out[kind]["lora_params"] = sum(p.numel() for n, p in module.named_parameters() if is_adapter(n))
        out[kind]["lora_saved_bytes"] = saved_bytes(module, spec)
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def tiny_measured():
    return run_json([sys.executable, "-c", WORKER, json.dumps(COUNT_ONLY), json.dumps(LORA_KINDS), *KINDS, *COUNT_ONLY],
                    timeout=300)


@pytest.mark.parametrize("kind", KINDS + COUNT_ONLY)
def test_param_count_equals_the_megatron_model(tiny_measured, kind):
    assert param_counts(load_spec(f"tiny:{kind}")).total == tiny_measured[kind]["params"]


@pytest.mark.parametrize("recompute", ["none", "full"])
@pytest.mark.parametrize("kind", KINDS)
def test_saved_activations_match_autograd(tiny_measured, kind, recompute):
    from yatt_mm.plan import CPU

    shape = MicroBatchShape(rows=2, seq=160, scored=64, media_tokens=128, frame_tokens=64)
    planned = activation_bytes(load_spec(f"tiny:{kind}"), shape, tp=1, e=4, recompute=recompute, kernels=CPU).saved
    measured = tiny_measured[kind]["saved_bytes"][recompute]
    print(f"{kind}, recompute {recompute}: planned {planned} saved bytes, autograd kept {measured}")
    # measured without recompute: 896 bytes short of autograd's in the dense three (5.9e-5, 4.7e-5
    # and 3.6e-5 of it); for Qwen3-VL without its q/k norm, DeepStack merger and position table
    # terms 1.9 MB (7.5%) short. The MoE: 11-16 kB over (3.5e-4 to 5.2e-4 from run to run; the
    # dense MLP's count in its place: 6.7 MB, 21%, short). With full recompute (each layer's input
    # kept, the vision towers' blocks too): within 0.8% (Qwen2-VL 0.78% short, the others 0.17%
    # over); when Qwen3-VL's tower, run block by block, kept every block's activations under full
    # recompute, the plan was 35% short of autograd (6.4 of 9.9 MB). Qwen3.5 (its DeltaNet layers
    # through Megatron's pure-torch rule, a measured constant; gated attention) and Qwen3.5-MoE
    # (a shared expert too): 0.1-0.33% short without recompute (autograd's count moves by 128 kB
    # from run to run), 0.2% over with full; when the DeltaNet layers were planned as attention
    # layers, autograd kept 2.1x the plan
    tolerance = {"qwen3vlmoe": 1e-3, "qwen35": 5e-3, "qwen35moe": 5e-3}.get(kind, 5e-4) if recompute == "none" else 1e-2
    assert abs(planned - measured) <= tolerance * measured, (planned, measured)


@pytest.mark.parametrize("kind", LORA_KINDS)
def test_lora_adapter_params_and_activations_match_the_megatron_model(tiny_measured, kind):
    """policy.lora in the plan: the adapter's parameters exactly as models/lora.py puts them on the
    model (one A for fused q/k/v and gate/up); its activations an upper bound of autograd's saved
    bytes, close to them (adapters with dropout, no recompute): the base model's activations but
    the frozen vision tower's (no gradient reaches it: it keeps nothing), plus the adapters' (A x
    for B's gradient, dropout's input and mask). Measured: planned / kept 1.16 (Qwen2-VL,
    Qwen2.5-VL), 1.20 (Qwen3-VL); the rest is what a frozen linear need not keep for its weight's
    gradient. With the tower's activations counted, 1.99, 2.20 and 1.69."""
    from yatt_mm.plan import CPU
    from yatt_mm.plan.params import lora_params

    from models.lora import LoRAConfig
    from models.trainer import TrainerConfig

    spec, lora = load_spec(f"tiny:{kind}"), LoRAConfig(rank=4, dropout=0.1)
    assert lora_params(spec, lora) == tiny_measured[kind]["lora_params"]
    shape = MicroBatchShape(rows=2, seq=160, scored=64, media_tokens=128, frame_tokens=64)
    base = activation_bytes(spec, shape, tp=1, e=4, recompute="none", kernels=CPU, vision_trained=False)
    planned = trainer_memory(spec, TrainerConfig(recompute="none"), 1, shape, CPU, lora).activations.saved
    measured = tiny_measured[kind]["lora_saved_bytes"]
    print(f"{kind} with LoRA: planned {planned} saved bytes ({planned - base.saved} for the adapters), autograd "
          f"kept {measured}: {planned / measured:.2f}x")
    assert planned > base.saved and measured <= planned <= 1.3 * measured, (planned, measured)


def test_lora_is_planned_without_base_gradients_optimizer_or_reference_and_recommended_when_full_does_not_fit(capsys):
    """The 8-GPU Qwen2-VL-7B recipe on 2 GPUs: full weights do not fit, and LoRA is named as the
    one change that does; with it the gradients and Adam state are the adapter's, the KL's
    reference is the base (no second copy), and the sync bucket is the adapter."""
    recipe = str(ROOT / RECIPES[0])
    assert main(["plan", "--config", recipe, "--gpus-per-node", "2"]) == 1
    out = capsys.readouterr().out
    assert "DOES NOT FIT" in out and "policy.lora.rank=64 sync.lora=adapter" in out
    cluster = Cluster(gpus_per_node=2, gpu_memory_gib=80)
    full = make_plan(load(RLConfig, recipe, ["algorithm.kl_coef=0.01"]), cluster)
    lora = make_plan(load(RLConfig, recipe, ["algorithm.kl_coef=0.01", "policy.lora.rank=64", "sync.lora=adapter"]),
                     cluster)
    assert lora.fits and not full.fits
    t, f = lora.trainer, full.trainer
    assert t.adapter > 0 and t.trainable == t.adapter and t.grads == 4 * t.adapter and t.weights > f.weights
    assert t.optimizer < f.optimizer / 40 and t.grads < f.grads / 40  # 142 M of 8.3 B parameters train
    phases = lambda plan: {line.what for phase in plan.phases for line in phase.lines}  # noqa: E731
    assert "reference policy weights" in phases(full) and "reference policy weights" not in phases(lora)
    assert main(["plan", "--config", recipe, "--gpus-per-node", "2", "policy.lora.rank=64", "sync.lora=adapter"]) == 0
    assert "M adapter parameters per GPU beside the frozen base" in capsys.readouterr().out


@pytest.fixture(scope="module")
def qwen3vl_stage_params():
    """Each rank's parameters as Megatron builds the tiny Qwen3-VL at TP 2 and at PP 2 (one launch)."""
    return run_json([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                     str(ROOT / "tests/dist/stage_params.py"), "tiny:qwen3vl", "2,1", "1,2"], timeout=300)


@pytest.mark.slow
@pytest.mark.parametrize("tp, pp", [(2, 1), (1, 2)])
def test_qwen3vl_stage_param_counts_equal_megatrons(tp, pp, qwen3vl_stage_params):
    """Each rank's parameters as Megatron builds the tiny Qwen3-VL at TP 2 (column/row shards;
    norms, q/k norms, the position table and the DeepStack mergers whole on each rank) and PP 2
    (the vision tower and both DeepStack layers on stage 0): the plan's count for that rank."""
    got = qwen3vl_stage_params[f"{tp},{pp}"]
    spec = load_spec("tiny:qwen3vl")
    assert len(got["ranks"]) == 2
    for r in got["ranks"]:
        assert r["params"] == param_counts(spec, tp, pp, r["stage"]).total, (r, tp, pp)
    assert len({r["params"] for r in got["ranks"]}) == (1 if pp == 1 else 2)  # TP shards alike, stages not


def _plan_imports(path: Path, modules: set[str]) -> set[str]:
    """The modules of `modules` (yatt_mm.plan's) that `path` imports, anywhere in it (function-level
    imports too): `from yatt_mm.plan import params` imports the module params, `from yatt_mm.plan
    import make_plan` the package's __init__."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = ["yatt_mm", "plan"][:3 - node.level] if node.level else []  # relative to yatt_mm.plan
            module = ".".join(base + ([node.module] if node.module else []))
            names |= {f"{module}.{a.name}" if f"{module}.{a.name}" in modules else module for a in node.names}
    return names & modules


def test_plan_package_has_no_import_cycles():
    package = ROOT / "yatt_mm/plan"
    modules = {("yatt_mm.plan" if p.stem == "__init__" else f"yatt_mm.plan.{p.stem}"): p
               for p in package.glob("*.py")}
    graph = {m: sorted(_plan_imports(p, set(modules)) - {m}) for m, p in modules.items()}
    assert not [m for m, deps in graph.items() if m != "yatt_mm.plan" and "yatt_mm.plan" in deps], \
        "a module of the package imports the package itself (its __init__ imports every module)"
    done, path = set(), []

    def visit(m: str) -> None:
        if m in path:
            raise AssertionError("import cycle: " + " -> ".join(path[path.index(m):] + [m]))
        if m in done:
            return
        path.append(m)
        for dep in graph[m]:
            visit(dep)
        path.pop()
        done.add(m)

    for m in graph:
        visit(m)


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
