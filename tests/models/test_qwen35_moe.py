"""Qwen3.5-MoE on Megatron-Core (models/qwen35_moe/), on the tiny `qwen35moe` model built offline
(4 layers linear/full/linear/full, 4 experts, top-2, expert width 192, a gated shared expert of
width 160; hidden 128): the config's refusals, the MoE MLP's conversion both ways in the saved
per-expert layout, the family, and in one child process (tests/dist/qwen35_moe_one_rank.py): the
MoE MLP alone (Megatron's MoE layer with its gated shared expert) against transformers' sparse
MoE block, the whole model's logits against transformers (fp32), padding in the routers,
routing replay and training steps."""

import json
import sys
from pathlib import Path

import pytest
import torch

from models.qwen2vl.convert import load_hf_state
from models.qwen35_moe.config import Experts
from models.qwen35_moe.convert import moe_to_hf, moe_to_megatron

from subproc import run_json

ROOT = Path(__file__).resolve().parents[2]
LAYER0 = "model.language_model.layers.0.mlp."


@pytest.fixture(scope="module")
def tiny_q35moe():
    from models.tiny import tiny_model_dir

    return tiny_model_dir("qwen35moe", seed=0)


def _text(path) -> dict:
    return json.loads((path / "config.json").read_text())["text_config"]


def test_spec_reads_the_tiny_model_and_the_family_finds_it(tiny_q35moe):
    from models.family import family_for_dir, family_for_tiny_kind
    from models.qwen35_moe.config import Qwen35MoeSpec

    spec = Qwen35MoeSpec.from_hf_dir(tiny_q35moe)
    family = family_for_dir(tiny_q35moe)
    assert family.name == "Qwen3.5-MoE" and family_for_tiny_kind("qwen35moe") is family
    assert (spec.num_experts, spec.num_experts_per_tok, spec.moe_intermediate_size,
            spec.shared_expert_intermediate_size, spec.router_aux_loss_coef) == (4, 2, 192, 160, 0.001)
    assert spec.model_type == "qwen3_5_moe" and spec.linear_layers == (True, False, True, False)
    assert spec.rotary_dim == 32 and spec.hidden_size == 128  # Qwen3.5's reader did the rest


def test_experts_read_from_the_config_and_what_is_refused(tiny_q35moe):
    text = _text(tiny_q35moe)
    experts = Experts.from_text_config(text)
    assert (experts.num_experts, experts.num_experts_per_tok, experts.moe_intermediate_size,
            experts.shared_expert_intermediate_size, experts.router_aux_loss_coef) == (4, 2, 192, 160, 0.001)
    for change, message in [({"shared_expert_intermediate_size": 0}, "no shared_expert_intermediate_size"),
                            ({"norm_topk_prob": False}, "norm_topk_prob false"),
                            ({"num_experts_per_tok": 5}, "num_experts_per_tok 5"),
                            ({"num_experts": 0}, "no num_experts")]:
        with pytest.raises(ValueError, match=message):
            Experts.from_text_config({**text, **change}, "tiny")


def test_expert_parallel_layout_is_checked_before_any_rank_starts(tiny_q35moe):
    from models.qwen35_moe.config import Qwen35MoeSpec, check_layout

    spec = Qwen35MoeSpec.from_hf_dir(tiny_q35moe)
    check_layout(spec, 1, 1, "policy.trainer.", ep=4)
    with pytest.raises(ValueError, match=r"policy\.trainer\.expert_parallel=3: the model's 4 experts"):
        check_layout(spec, 1, 1, "policy.trainer.", ep=3)
    check_layout(spec, 2, 1, "policy.trainer.", ep=2)  # EP x TP: measured by hand, parity as at TP 2
    with pytest.raises(ValueError, match=r"policy\.trainer\.tensor_parallel=4: the vocabulary"):
        check_layout(spec, 4, 1, "policy.trainer.", ep=1)  # the dense checks apply


def test_moe_conversion_both_ways_is_bitwise_in_the_saved_per_expert_layout(tiny_q35moe):
    """The per-expert Linear weights transformers saves (and the released checkpoints hold) ->
    Megatron's [gate; up] fc1 of each expert and of the shared expert -> the same tensors; the
    Megatron tensors equal transformers' own fused in-memory experts after its loading."""
    from transformers import AutoModelForImageTextToText

    hf = load_hf_state(tiny_q35moe)
    E, H, I, S = 4, 128, 192, 160  # noqa: E741
    assert hf[LAYER0 + "experts.3.gate_proj.weight"].shape == (I, H)  # per expert, as saved
    full = moe_to_megatron(hf, LAYER0, "mlp.", E)
    assert full["mlp.experts.local_experts.3.linear_fc1.weight"].shape == (2 * I, H)
    assert full["mlp.shared_experts.linear_fc1.weight"].shape == (2 * S, H)
    assert full["mlp.shared_experts.gate_weight"].shape == (1, H)
    back = moe_to_hf(full, "mlp.", LAYER0, E)
    assert back.keys() == {k for k in hf if k.startswith(LAYER0)}
    assert all(torch.equal(back[k], hf[k]) for k in back)
    block = AutoModelForImageTextToText.from_pretrained(tiny_q35moe, dtype=torch.float32).model.language_model.layers[0].mlp
    for e in range(E):  # transformers fuses them on load: [E, 2I, H] with the gate half first
        assert torch.equal(block.experts.gate_up_proj[e], full[f"mlp.experts.local_experts.{e}.linear_fc1.weight"])
        assert torch.equal(block.experts.down_proj[e], full[f"mlp.experts.local_experts.{e}.linear_fc2.weight"])
    fused = {k.replace("experts.0.gate_proj.weight", "experts.gate_up_proj"): v for k, v in hf.items()}
    with pytest.raises(ValueError, match="fused expert layout"):
        moe_to_megatron(fused, LAYER0, "mlp.", E)


@pytest.fixture(scope="module")
def one_rank(tiny_q35moe):
    """tests/dist/qwen35_moe_one_rank.py: Megatron and transformers in one child process (~40 s
of CPU time)."""
    return run_json([sys.executable, str(ROOT / "tests/dist/qwen35_moe_one_rank.py"), str(tiny_q35moe)], timeout=600)


def test_the_moe_mlp_with_its_gated_shared_expert_equals_transformers(one_rank):
    """Layer 0's MoE MLP alone: Megatron's MoE layer (SequentialMLP experts, top-k router, the
    shared expert scaled by sigmoid(shared_expert_gate(x))) against transformers'
    Qwen3_5MoeSparseMoeBlock, fp32, on 33 tokens, forward and the backward of a weighted sum.
    Measured: outputs 2.6e-8 apart (largest 0.031), gradients 6e-8 to 4.5e-7 (largest 0.14 to
    0.81); without the shared expert's gate the outputs would be 0.014 apart."""
    r = one_rank["block"]
    print("MoE MLP vs transformers:", r)
    assert r["roundtrip_equal"], r
    assert "shared_experts.gate_weight" in r["megatron_names"], r
    assert r["output"] <= 3e-7 and r["output_scale"] > 0.01, r
    assert r["gate_effect"] > 100 * r["output"], r  # the gate matters: a lost gate would show
    for name, diff in r["grads"].items():
        assert diff <= 2e-6 * max(1.0, r["grad_scale"][name]), (name, r)
        assert r["grad_scale"][name] > 0, (name, r)


def test_logits_equal_transformers_and_the_export_is_the_checkpoint(one_rank):
    """The whole model at TP 1 against transformers (fp32): text, one image, two images, a video.
    Measured: 2.0e-5 on every probe (logits up to ~20; the largest difference is on text tokens
    all four prompts share); the HF export equals the checkpoint bit for bit."""
    r = one_rank["parity"]
    print("logits vs transformers:", r)
    assert r.pop("export_equal") == 1.0, r
    assert set(r) == {"text", "image", "multi_image", "video", "packed"} and all(d <= 1e-4 for d in r.values()), r


def test_padding_stays_out_of_the_load_balancing_loss_and_the_expert_load(one_rank):
    """Qwen3-VL-MoE's padding check on this model: a step whose only loss is the load-balancing
    loss on two right-padded rows; the pad token gets no gradient and the expert load counts
    top-k experts per real token in each of the 4 layers (DeltaNet and attention layers alike).
    Measured: pad row 0.0, grad norm 0.018."""
    r = one_rank["padding"]
    print("aux loss alone on padded rows:", r)
    assert r["padding"] > 0 and r["pad_is_padding_only"], r
    assert r["pad_row_grad"] == 0.0 and 0 < r["grad_norm"] < 0.5, r
    assert r["routed_per_layer"] == [r["real_tokens"] * r["topk"]] * 4, r
    assert 0 < r["moe/aux_loss"] <= 2.0 and r["moe/load_max_over_mean_worst"] >= 1.0, r


def test_routing_replay_forces_the_recorded_routes_in_training_and_the_actor(one_rank):
    """Routing replay (models/routing_replay.py) on a padded and a packed micro-batch (the packed
    one runs each sample's DeltaNet recurrence from a zero state): replayed, every router call
    takes the recorded experts, in the forward and the full recompute of a training step and in
    the RL Actor's update passes; freely routed some routes flip after the weights move.
    Measured: 2.1% of routings would differ, mean |logprob gap| 0.107 replayed vs 0.120 free."""
    r = one_rank["replay"]
    print("routing replay:", r)
    assert r["routes_shape"] == [[4, 152, 2], [4, 146, 2]], r
    assert r["replayed_took_recorded"] and r["train_took_recorded"] and r["train_calls"] == 4, r
    assert not r["free_took_recorded"] and 0 < r["free_mismatch"] < 0.2, r
    assert 0 < r["replayed_mismatch"] == r["train_mismatch"] < 0.2, r
    assert r["replayed_gap"] < r["free_gap"] and r["router_grad"] > 0, r
    assert r["actor_routes_shape"] == r["routes_shape"] and r["actor_steps"] == 2, r
    assert r["actor_took_recorded"] and 0 < r["actor_mismatch"] < 0.2, r


@pytest.mark.slow
def test_expert_parallel_trains_a_step_and_equals_transformers(tiny_q35moe, tmp_path):
    """One launch of 2 ranks at EP 2 (tests/dist/moe_ep.py --kind qwen35moe --parity): a training
    step of Qwen3-VL-MoE's EP test (2 experts a rank, tokens exchanged by all-to-all, the
    distributed optimizer, different samples on each DP rank), the export gathering every expert
    from both ranks; then a fresh model's logits against transformers at EP 2. Measured: logits
    2.0e-5 from transformers on every probe (as at EP 1), the export of the fresh model bitwise;
    after the step every routed expert, the shared experts and their gates moved."""
    import subprocess

    from safetensors.torch import load_file

    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(ROOT / "tests/dist/moe_ep.py"), "--kind", "qwen35moe", "--ep", "2", "--parity",
                           "--out", str(tmp_path)], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-4000:])
    step, parity = (json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{"))
    print(step, parity)
    assert step["ep_size"] == 2 and step["dp"] == 2 and step["local_experts_rank0"] == ["0", "1"], step
    assert 0 < step["grad_norm"] < float("inf"), step
    diffs = parity["parity"]
    assert diffs.pop("export_equal") == 1.0, parity
    assert set(diffs) == {"text", "image", "multi_image", "video"} and all(d <= 1e-4 for d in diffs.values()), parity
    start, trained = load_hf_state(tiny_q35moe), load_file(str(tmp_path / "qwen35moe_ep2.safetensors"))
    assert trained.keys() == start.keys()
    moe = [k for k in start if ".mlp." in k and "layers." in k and "visual" not in k]
    assert len(moe) == 4 * (1 + 4 * 3 + 3 + 1)  # per layer: router, 4 experts x 3, shared expert x 3, its gate
    assert all(not torch.equal(trained[k], start[k]) for k in moe), [k for k in moe if torch.equal(trained[k], start[k])]
