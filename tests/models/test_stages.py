"""Uneven pipeline stages (`policy.trainer.pipeline_layers`): the checks that refuse a split
naming the setting, before any rank starts, and what the memory plan counts per stage. The
Megatron runs (parity with transformers and training equal to one process on the 3-layer tiny
model at PP 2 with [1, 2]) are in test_models.py and test_layouts.py."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

from models.stages import check_stage_layers, megatron_layout, stage_layers, uneven_example
from yatt_mm.config import ConfigError, load
from yatt_mm.rl.config import RLConfig

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("layers, error", [
    ([1, 1], "p.pipeline_layers=[1, 1]: they add up to 2 but the model has 3 layers"),
    ([3], "p.pipeline_layers=[3]: one count per pipeline stage, so 2 entries (p.pipeline_parallel=2), not 1"),
    ([1, 1, 1], "p.pipeline_layers=[1, 1, 1]: one count per pipeline stage, so 2 entries"),
    ([0, 3], "p.pipeline_layers=[0, 3]: every stage needs at least 1 language layer"),
])
def test_a_split_that_does_not_fit_the_model_is_refused_naming_the_setting(layers, error):
    with pytest.raises(ValueError) as e:
        check_stage_layers(3, 2, layers, "p.")
    assert str(e.value).startswith(error), e.value


def test_uneven_counts_without_the_setting_point_to_it():
    with pytest.raises(ValueError, match=r"p.pipeline_parallel=2: the model's 3 layers must divide evenly .* set "
                                         r"p.pipeline_layers .* e.g. \[1, 2\]"):
        check_stage_layers(3, 2, (), "p.")
    assert uneven_example(7, 3) == [2, 2, 3] and uneven_example(3, 2) == [1, 2]


def test_the_pipeline_hint_proposes_a_split_that_validation_accepts():
    """Every refusal of an even split suggests either pipeline_layers or a pipeline_parallel;
    what it suggests passes the same check (it once proposed [0, 1, 1] for 2 layers at PP 3)."""
    for num_layers in range(1, 9):
        for pp in range(1, 10):
            try:
                check_stage_layers(num_layers, pp, (), "p.")
                continue
            except ValueError as e:
                hint = str(e)
            if m := re.search(r"e\.g\. (\[[\d, ]+\])", hint):
                check_stage_layers(num_layers, pp, [int(n) for n in m.group(1)[1:-1].split(",")], "p.")
            else:
                fewer = int(re.search(r"p\.pipeline_parallel to at most (\d+)", hint).group(1))
                check_stage_layers(num_layers, fewer, (), "p.")


def test_stage_layers_and_megatrons_layout():
    assert stage_layers(4, 2) == (2, 2) and stage_layers(3, 2, [1, 2]) == (1, 2) and stage_layers(5, 3, [1, 3, 1])
    # Megatron-Core's pipeline_model_parallel_layout: the embedding first, the loss last
    assert megatron_layout([1, 2]) == [["embedding", "decoder"], ["decoder", "decoder", "loss"]]
    from megatron.core.transformer import TransformerConfig

    from models.megatron_config import pipeline_settings

    # Megatron accepts it (middle stages of any count: the layout has no equal-middle rule)
    import torch

    cfg = TransformerConfig(num_layers=6, hidden_size=8, num_attention_heads=2, pipeline_dtype=torch.float32,
                            **pipeline_settings(3, (1, 4, 1)))
    layout = cfg.pipeline_model_parallel_layout
    assert [layout.get_num_layers_to_build(pp_rank=s, vp_stage=0) for s in range(3)] == [1, 4, 1]
    assert [layout.get_layer_offset(pp_rank=s, vp_stage=0) for s in range(3)] == [0, 1, 5]


def test_the_config_refuses_a_list_of_the_wrong_length_or_a_zero_stage():
    rl = ROOT / "configs" / "tiny_demo.yaml"
    with pytest.raises(ConfigError, match=r"policy.trainer: pipeline_layers=\[1\]: one count per pipeline stage, so 2"):
        load(RLConfig, rl, ["policy.trainer.pipeline_parallel=2", "policy.trainer.pipeline_layers=[1]"])
    with pytest.raises(ConfigError, match=r"policy.trainer.pipeline_layers must be >= 1, got \[0, 3\]"):
        load(RLConfig, rl, ["policy.trainer.pipeline_parallel=2", "policy.trainer.pipeline_layers=[0, 3]"])
    cfg = load(RLConfig, rl, ["policy.trainer.pipeline_parallel=2", "policy.trainer.pipeline_layers=[1, 2]"])
    assert cfg.policy.trainer.pipeline_layers == [1, 2]


def test_the_launchers_model_check_refuses_a_split_that_does_not_add_up():
    """What `yatt-mm rl` runs before torchrun (launch.py: check_model, exit 2 with the message;
    tests/cli/test_architecture.py checks that path stops before any rank)."""
    from models.tiny import tiny_model_dir

    rl = ROOT / "configs" / "tiny_demo.yaml"
    judge = str(tiny_model_dir("judge"))  # 3 layers
    cfg = load(RLConfig, rl, [f"policy.model={judge}", "policy.trainer.pipeline_parallel=2",
                              "policy.trainer.pipeline_layers=[1, 1]"])
    with pytest.raises(ValueError) as e:
        cfg.check_model()
    assert str(e.value) == "policy.trainer.pipeline_layers=[1, 1]: they add up to 2 but the model has 3 layers"
    cfg.policy.trainer.pipeline_layers = []
    with pytest.raises(ValueError, match=r"policy.trainer.pipeline_parallel=2: .* set policy.trainer.pipeline_layers"):
        cfg.check_model()
    cfg.policy.trainer.pipeline_layers = [1, 2]
    cfg.check_model()


@pytest.mark.slow
def test_the_launcher_refuses_a_split_that_does_not_add_up_before_any_rank_starts(demo_shards):
    out = subprocess.run([sys.executable, "-m", "yatt_mm.cli", "rl", "--config", "configs/tiny_demo.yaml", "--nproc", "2",
                          "policy.model=tiny:judge", "reward.judges=[]", "policy.trainer.pipeline_parallel=2",
                          "policy.trainer.pipeline_layers=[1, 1]", *demo_shards], capture_output=True, text=True,
                         cwd=ROOT, timeout=300)
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip().splitlines()[-1] == ("yatt-mm rl: policy.trainer.pipeline_layers=[1, 1]: they add up to 2 "
                                                   "but the model has 3 layers")
    assert out.stdout == "" and "torchrun" not in out.stderr


def test_the_plan_counts_each_stages_layers():
    """`yatt-mm plan` with pipeline_layers: stage 0 holds the vision tower, the embedding and 1
    layer, stage 1 the other 2 layers, the final norm and the output layer; moving a layer between
    the stages moves one layer's parameters. The counts equal Megatron's built stages in the
    uneven training run (test_layouts.py)."""
    from yatt_mm.plan import load_spec, param_counts

    spec = load_spec("tiny:judge")
    assert spec.num_layers == 3
    whole = param_counts(spec)
    first, last = (param_counts(spec, 1, 2, s, (1, 2)) for s in range(2))
    first_of_21, last_of_21 = (param_counts(spec, 1, 2, s, (2, 1)) for s in range(2))
    embedding, norm = spec.vocab_size * spec.hidden_size, spec.hidden_size
    output = 0 if spec.tie_word_embeddings else embedding  # the whole model's own output layer
    layer = (whole.language - embedding - norm - output) // 3
    assert first.vision == whole.vision and last.vision == 0
    # the last stage's output layer: its own, or under tied embeddings its copy of the embedding
    assert first.language == embedding + layer and last.language == 2 * layer + norm + embedding
    assert first_of_21.total - first.total == layer == last.total - last_of_21.total
    with pytest.raises(ValueError, match="pipeline_layers"):
        param_counts(spec, 1, 2, 0, (1, 1))
