"""The tiny Qwen3.5-MoE on one rank, in one process (one import of Megatron and transformers, one
model build per check). Prints one JSON line: {"block": ..., "parity": ..., "padding": ...,
"replay": ...}.

    python tests/dist/qwen35_moe_one_rank.py HF_DIR

block: layer 0's MoE MLP alone, Megatron's MoELayer (routed experts, router, the gated shared
expert: models/qwen35_moe/config.py) loaded through models/qwen35_moe/convert.py from the saved
checkpoint, against transformers' Qwen3_5MoeSparseMoeBlock of the same checkpoint, fp32: outputs
on the same hidden states, and the gradients of a weighted sum of them (input, router, shared
expert gate, a routed expert, the shared expert).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import models  # noqa: F401 - CPU runtime hooks first
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from moe_one_rank import padding_check, replay_check  # noqa: E402

HF_MOE = "model.language_model.layers.0.mlp."


def megatron_moe_layer(experts, hidden: int):
    """Megatron-Core's MoE layer (the one the language model's layer spec builds) with the
    Qwen3.5-MoE settings, alone, on one rank."""
    import torch.nn.functional as F
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.spec_utils import build_module

    from models.megatron_config import common
    from models.qwen35_moe.config import moe_settings

    config = TransformerConfig(num_layers=1, hidden_size=hidden, ffn_hidden_size=experts.moe_intermediate_size,
                               num_attention_heads=2, normalization="RMSNorm", gated_linear_unit=True,
                               activation_func=F.silu, add_bias_linear=False, **common(torch.float32, 1),
                               **moe_settings(experts, 1, 1, 1))
    spec = get_gpt_layer_local_spec(num_experts=experts.num_experts, moe_grouped_gemm=False,
                                    normalization="RMSNorm", qk_layernorm=True).submodules.mlp
    layer = build_module(spec, config=config, pg_collection=ProcessGroupCollection.use_mpu_process_groups())
    layer.set_layer_number(1)
    return layer


def block_check(path: str) -> dict:
    from transformers import AutoModelForImageTextToText

    from models.qwen2vl.convert import load_hf_state
    from models.qwen35_moe.config import Experts
    from models.qwen35_moe.convert import moe_to_hf, moe_to_megatron

    hf_model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32)
    block = hf_model.model.language_model.layers[0].mlp
    text = hf_model.config.text_config.to_dict()
    experts = Experts.from_text_config(text, path)
    hf = load_hf_state(path)
    full = moe_to_megatron(hf, HF_MOE, "", experts.num_experts)
    back = moe_to_hf(full, "", HF_MOE, experts.num_experts)
    layer = megatron_moe_layer(experts, text["hidden_size"])
    layer.load_state_dict(full, strict=True)
    layer.eval()  # no load-balancing loss: the two blocks compute the same function

    g = torch.Generator().manual_seed(0)
    x = torch.randn(11, 3, text["hidden_size"], generator=g)  # [s, b, h], as an RMSNorm's output
    weight = torch.randn(x.shape, generator=g)
    xm, xh = x.clone().requires_grad_(), x.transpose(0, 1).contiguous().requires_grad_()
    out_m = layer(xm)[0]
    out_h = block(xh)
    (out_m * weight).sum().backward()
    (out_h * weight.transpose(0, 1)).sum().backward()
    shared = layer.shared_experts
    grads = {
        "input": (xm.grad, xh.grad.transpose(0, 1)),
        "router": (layer.router.weight.grad, block.gate.weight.grad),
        "shared_gate": (shared.gate_weight.grad, block.shared_expert_gate.weight.grad),
        "shared_fc2": (shared.linear_fc2.weight.grad, block.shared_expert.down_proj.weight.grad),
        "expert1_fc1": (layer.experts.local_experts[1].linear_fc1.weight.grad, block.experts.gate_up_proj.grad[1]),
    }
    with torch.no_grad():  # how much the gated shared expert adds (so parity would catch a lost gate)
        gated = layer.shared_experts(x)
        ungated = torch.nn.functional.linear(  # the shared MLP without its sigmoid gate
            torch.nn.functional.silu(x @ full["shared_experts.linear_fc1.weight"][:experts.shared_expert_intermediate_size].T)
            * (x @ full["shared_experts.linear_fc1.weight"][experts.shared_expert_intermediate_size:].T),
            full["shared_experts.linear_fc2.weight"])
    return {
        "output": float((out_m - out_h.transpose(0, 1)).abs().max()), "output_scale": float(out_h.detach().abs().max()),
        "grads": {k: float((a - b).abs().max()) for k, (a, b) in grads.items()},
        "grad_scale": {k: float(b.abs().max()) for k, (a, b) in grads.items()},
        "shared_out": float(gated.abs().max()), "gate_effect": float((gated - ungated).abs().max()),
        "roundtrip_equal": back.keys() == {k for k in hf if k.startswith(HF_MOE)}
        and all(torch.equal(back[k], hf[k]) for k in back),
        "megatron_names": sorted({k.split(".local_experts.")[0] if ".local_experts." in k else k for k in full}),
    }


def main() -> int:
    from models.comm import init_parallel

    from models.qwen35_moe.parity import run_parity

    init_parallel(1)
    path = sys.argv[1]
    print(json.dumps({"block": block_check(path), "parity": run_parity(path),
                      "padding": padding_check(path), "replay": replay_check(path)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
