"""LoRA's settings and what is refused before any rank starts (fast: no model is built). The
adapters on the trainer are checked against transformers + peft in test_models.py (one launch
with the other 2-rank cases), the engine's adapter sync in tests/engines/test_lora_engine.py."""

import re

import pytest

from models.family import family_for_model_type
from models.lora import LoRAConfig, check_layout, peft_config
from models.trainer import TrainerConfig


def test_families_without_lora_and_unsupported_layouts_are_refused_by_name():
    lora = LoRAConfig(rank=8)
    with pytest.raises(ValueError, match=r"policy.lora: Qwen3-VL-MoE has no LoRA yet .*set policy.lora.rank=0"):
        check_layout(lora, family_for_model_type("qwen3_vl_moe"), TrainerConfig())
    for setting in ("context_parallel", "expert_parallel"):
        with pytest.raises(ValueError, match=f"policy.trainer.{setting}=2: set it to 1, or policy.lora.rank=0"):
            check_layout(lora, family_for_model_type("qwen2_vl"), TrainerConfig(**{setting: 2}))
    # without LoRA nothing is refused, and the dense families have it
    check_layout(LoRAConfig(rank=0), family_for_model_type("qwen3_vl_moe"), TrainerConfig(context_parallel=2))
    for model_type in ("qwen2_vl", "qwen2_5_vl", "qwen3_vl"):
        check_layout(lora, family_for_model_type(model_type), TrainerConfig(tensor_parallel=2, pipeline_parallel=2))


def test_the_peft_config_targets_the_language_model_only():
    """A plain list of names would also catch Qwen2.5-VL's vision MLP (gate/up/down_proj), which
    the adapter does not hold: peft would add empty adapters there, vLLM warn about them."""
    config = peft_config(LoRAConfig(rank=8, alpha=32, target_modules=["gate_proj", "up_proj", "down_proj"]), "/base")
    assert (config["r"], config["lora_alpha"], config["peft_type"]) == (8, 32, "LORA")
    pattern = config["target_modules"]
    assert re.fullmatch(pattern, "model.language_model.layers.3.mlp.down_proj")
    assert not re.fullmatch(pattern, "model.visual.blocks.0.mlp.down_proj")
    assert not re.fullmatch(pattern, "model.language_model.layers.3.self_attn.q_proj")  # not targeted


def test_the_engine_serves_adapters_at_the_rank_vllm_accepts():
    from yatt_mm.engines.adapters import engine_lora_kwargs

    assert engine_lora_kwargs(0) == {}  # no LoRA: the engine as without it
    assert engine_lora_kwargs(8) == {"enable_lora": True, "max_lora_rank": 8, "max_loras": 1}
    assert engine_lora_kwargs(12)["max_lora_rank"] == 16  # vLLM takes 1, 8, 16, 32, ... 512 only
