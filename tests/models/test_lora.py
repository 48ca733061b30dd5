"""LoRA's settings and what is refused before any rank starts (no model is built), and `yatt-mm
export --merge` against peft's merge on the tiny policy. The adapters on the trainer are checked
against transformers + peft in test_models.py (one launch with the other 2-rank cases), the
engine's adapter sync there too (tests/dist/lora_vs_vllm.py)."""

import re
from pathlib import Path

import pytest

from models.family import family_for_model_type
from models.lora import LoRAConfig, check_layout, peft_config
from models.trainer import TrainerConfig

ROOT = Path(__file__).resolve().parents[2]


def test_families_without_lora_and_targets_beyond_a_familys_reach_are_refused_by_name():
    import dataclasses

    lora = LoRAConfig(rank=8)
    # every family here has LoRA; one registered without it (lora_to_hf None) is refused by name
    without = dataclasses.replace(family_for_model_type("qwen2_vl"), name="Custom-VL", lora_to_hf=None)
    with pytest.raises(ValueError, match=r"policy.lora: Custom-VL has no LoRA yet .*set policy.lora.rank=0"):
        check_layout(lora, without, TrainerConfig())
    # without LoRA nothing is refused, and the dense families have it, at TP, PP and CP
    check_layout(LoRAConfig(rank=0), family_for_model_type("qwen3_5_moe"), TrainerConfig(context_parallel=2))
    for model_type in ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_5"):
        check_layout(lora, family_for_model_type(model_type),
                     TrainerConfig(tensor_parallel=2, pipeline_parallel=2, context_parallel=2))
    # Qwen3-VL-MoE: the attention's projections and the routed experts (tests/cli/test_prelaunch_checks.py
    # names the refusal); Qwen3.5-MoE also its shared expert (gate/up/down_proj) and its DeltaNet's
    moe = LoRAConfig(rank=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "experts"])
    check_layout(moe, family_for_model_type("qwen3_vl_moe"), TrainerConfig(tensor_parallel=2, pipeline_parallel=2))
    check_layout(moe, family_for_model_type("qwen3_vl_moe"), TrainerConfig(expert_parallel=2))
    check_layout(moe, family_for_model_type("qwen3_5_moe"), TrainerConfig(expert_parallel=2))
    check_layout(lora, family_for_model_type("qwen3_5_moe"), TrainerConfig(expert_parallel=2))
    with pytest.raises(ValueError, match=r"Qwen3-VL-MoE's adapters reach q_proj, k_proj, v_proj, o_proj, experts only "
                                         r"\(not gate_proj, up_proj, down_proj: its MLPs are the experts: name them "
                                         r"experts\)"):
        check_layout(lora, family_for_model_type("qwen3_vl_moe"), TrainerConfig())
    with pytest.raises(ValueError, match=r"Qwen3-VL's adapters reach .* only \(not experts: it has no such projections\)"):
        check_layout(LoRAConfig(rank=8, target_modules=["experts"]), family_for_model_type("qwen3_vl"), TrainerConfig())
    # peft adapts the experts' stacked weights, not their inputs: no dropout there
    with pytest.raises(ValueError, match=r"dropout=0.1 with target_modules naming experts: .* set dropout=0"):
        LoRAConfig(rank=8, dropout=0.1, target_modules=["experts"]).validate()
    LoRAConfig(rank=8, dropout=0.1, target_modules=["q_proj", "k_proj", "v_proj"]).validate()
    # a gated DeltaNet's projections: Qwen3.5's, not the other families'
    deltanet = LoRAConfig(rank=8, target_modules=["in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"])
    check_layout(deltanet, family_for_model_type("qwen3_5"), TrainerConfig(tensor_parallel=2))
    with pytest.raises(ValueError, match=r"Qwen2-VL / Qwen2.5-VL's adapters reach .* only \(not in_proj_qkv, in_proj_z, in_proj_b, "
                                         r"in_proj_a, out_proj: it has no such projections\)"):
        check_layout(deltanet, family_for_model_type("qwen2_vl"), TrainerConfig())


def test_the_peft_config_targets_the_language_model_only():
    """A plain list of names would also catch Qwen2.5-VL's vision MLP (gate/up/down_proj), which
    the adapter does not hold: peft would add empty adapters there, vLLM warn about them."""
    config = peft_config(LoRAConfig(rank=8, alpha=32, target_modules=["gate_proj", "up_proj", "down_proj"]), "/base")
    assert (config["r"], config["lora_alpha"], config["peft_type"]) == (8, 32, "LORA")
    pattern = config["target_modules"]
    assert re.fullmatch(pattern, "model.language_model.layers.3.mlp.down_proj")
    assert not re.fullmatch(pattern, "model.visual.blocks.0.mlp.down_proj")
    assert not re.fullmatch(pattern, "model.language_model.layers.3.self_attn.q_proj")  # not targeted
    assert config["target_parameters"] is None
    # the routed experts: parameters (peft's target_parameters), never a module of the regex
    config = peft_config(LoRAConfig(rank=8, target_modules=["q_proj", "k_proj", "v_proj", "experts"]), "/base")
    assert config["target_parameters"] == ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    assert re.fullmatch(config["target_modules"], "model.language_model.layers.3.self_attn.k_proj")
    assert not re.fullmatch(config["target_modules"], "model.language_model.layers.3.mlp.experts")
    assert peft_config(LoRAConfig(rank=8, target_modules=["experts"]), "/base")["target_modules"] is None


def test_the_engine_serves_adapters_at_the_rank_vllm_accepts():
    from yatt_mm.engines.adapters import engine_lora_kwargs

    assert engine_lora_kwargs(0) == {}  # no LoRA: the engine as without it
    assert engine_lora_kwargs(8) == {"enable_lora": True, "max_lora_rank": 8, "max_loras": 1}
    assert engine_lora_kwargs(12)["max_lora_rank"] == 16  # vLLM takes 1, 8, 16, 32, ... 512 only


def test_export_merge_writes_the_model_peft_gives_with_the_adapter(tiny_policy, tmp_path, capsys):
    """A PEFT adapter directory as a LoRA run's RUN_DIR/final is written (save_adapter_dir,
    peft_config), random A and B on every projection of the language model: transformers' model
    of the merged directory gives peft's logits with the adapter, and the weights the adapter
    does not touch (the vision tower, embeddings) are the base's bit for bit."""
    import torch
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForImageTextToText

    from models.lora import PEFT_PREFIX, save_adapter_dir
    from yatt_mm.cli import main

    config = peft_config(LoRAConfig(rank=4, alpha=8), str(tiny_policy))
    base = AutoModelForImageTextToText.from_pretrained(str(tiny_policy), dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(3)
    adapter = {}
    for name, module in base.named_modules():
        if re.fullmatch(config["target_modules"], name):
            adapter[f"{PEFT_PREFIX}{name}.lora_A.weight"] = torch.randn(4, module.in_features, generator=gen) * 0.1
            adapter[f"{PEFT_PREFIX}{name}.lora_B.weight"] = torch.randn(module.out_features, 4, generator=gen) * 0.1
    assert len(adapter) == 2 * 7 * base.config.text_config.num_hidden_layers
    final = save_adapter_dir(adapter, config, tmp_path / "final")

    assert main(["export", str(final), "--out", str(tmp_path / "merged")]) == 2  # --merge is what it does
    assert "give --merge" in capsys.readouterr().err
    assert main(["export", str(final), "--merge", "--out", str(tmp_path / "merged")]) == 0
    ids = torch.tensor([[5, 17, 42, 99, 3, 64, 7, 12]])
    with torch.no_grad():
        merged = AutoModelForImageTextToText.from_pretrained(str(tmp_path / "merged"), dtype=torch.float32).eval()
        want = PeftModel.from_pretrained(base, str(final)).eval()(input_ids=ids).logits
        got = merged(input_ids=ids).logits
        plain = AutoModelForImageTextToText.from_pretrained(str(tiny_policy), dtype=torch.float32)(input_ids=ids).logits
    assert (want - plain).abs().max() > 1e-2  # the adapter changes the logits ...
    # ... and the merge as peft does: 2.3e-5 on logits of up to ~12 (fp32, another summation order)
    assert (got - want).abs().max() < 1e-4, (got - want).abs().max()
    before, after = load_file(str(next(tiny_policy.glob("*.safetensors")))), load_file(str(tmp_path / "merged" /
                                                                                              "model.safetensors"))
    assert before.keys() == after.keys()
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert len(changed) == 7 * base.config.text_config.num_hidden_layers
    assert all(re.search(r"\.(q|k|v|o|gate|up|down)_proj\.weight$", k) and "visual" not in k for k in changed)


def test_the_engines_adapter_folder_goes_with_a_process_that_crashes(tmp_path):
    """The adapter versions a rollout engine serves live in a folder of its process's own; a rank
    that dies of an exception (close() never called) leaves none behind in the temp folder."""
    import os
    import subprocess
    import sys

    code = ("from yatt_mm.engines.adapters import AdapterSlot\n"
            "slot = AdapterSlot()\n"
            "version = slot._next_version()\n"
            "version.mkdir()\n"
            "(version / 'adapter_model.safetensors').write_bytes(b'x')\n"
            "print(slot.root, flush=True)\n"
            "raise RuntimeError('the step failed')\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "TMPDIR": str(tmp_path)}, cwd=str(ROOT))
    assert proc.returncode == 1 and "the step failed" in proc.stderr, proc.stderr[-2000:]
    root = proc.stdout.strip()
    assert root.startswith(str(tmp_path)) and not list(tmp_path.glob("yatt-mm-adapter-*")), (root, proc.stderr)


def test_export_merge_of_expert_adapters_writes_the_model_peft_gives(tmp_path):
    """The routed experts' adapters (peft's target_parameters: a layer's stacked gate_up_proj as
    experts.base_layer, down_proj as experts) merged by `yatt-mm export --merge` into the tiny
    Qwen3-VL-MoE: transformers' model of the merged directory gives peft's logits, each expert
    its own pair."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForImageTextToText

    from models.lora import PEFT_PREFIX, save_adapter_dir
    from models.tiny import tiny_model_dir
    from yatt_mm.cli import main

    path = tiny_model_dir("qwen3vlmoe")
    config = peft_config(LoRAConfig(rank=4, alpha=8, target_modules=["experts"]), str(path))
    base = AutoModelForImageTextToText.from_pretrained(str(path), dtype=torch.float32).eval()
    text = base.config.text_config
    experts, hidden, inter = text.num_experts, text.hidden_size, text.moe_intermediate_size
    gen = torch.Generator().manual_seed(3)
    adapter = {}
    for layer in range(text.num_hidden_layers):
        for module, (n_in, n_out) in (("experts.base_layer", (hidden, 2 * inter)), ("experts", (inter, hidden))):
            key = f"{PEFT_PREFIX}model.language_model.layers.{layer}.mlp.{module}"
            adapter[f"{key}.lora_A.weight"] = torch.randn(4 * experts, n_in, generator=gen) * 0.1
            adapter[f"{key}.lora_B.weight"] = torch.randn(n_out, 4 * experts, generator=gen) * 0.1
    final = save_adapter_dir(adapter, config, tmp_path / "final")
    assert main(["export", str(final), "--merge", "--out", str(tmp_path / "merged")]) == 0
    ids = torch.tensor([[5, 17, 42, 99, 3, 64, 7, 12]])
    with torch.no_grad():
        plain = base(input_ids=ids).logits
        merged = AutoModelForImageTextToText.from_pretrained(str(tmp_path / "merged"), dtype=torch.float32).eval()
        got = merged(input_ids=ids).logits
        want = PeftModel.from_pretrained(base, str(final)).eval()(input_ids=ids).logits
    assert (want - plain).abs().max() > 1e-2  # the experts' adapters change the logits ...
    assert (got - want).abs().max() < 1e-4, (got - want).abs().max()  # ... as peft's merge does
