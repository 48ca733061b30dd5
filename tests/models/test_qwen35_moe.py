"""Qwen3.5-MoE on Megatron-Core (models/qwen35_moe/), on the tiny `qwen35moe` model built offline
(4 experts, top-2, expert width 192, a gated shared expert of width 160; hidden 128): the MoE
config's refusals, the MoE MLP's conversion both ways in the saved per-expert layout, and the
MoE MLP alone (Megatron's MoE layer with its gated shared expert) against transformers' sparse
MoE block in fp32 (one process: tests/dist/qwen35_moe_one_rank.py)."""

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
def tiny_q35moe(tmp_path_factory):
    from models.qwen35.tiny import make_tiny

    path = tmp_path_factory.mktemp("qwen35moe")
    make_tiny(path, "qwen35moe")
    return path


def _text(path) -> dict:
    return json.loads((path / "config.json").read_text())["text_config"]


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
    """tests/dist/qwen35_moe_one_rank.py: Megatron and transformers in one child process."""
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
