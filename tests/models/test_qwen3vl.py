"""Qwen3-VL (dense) on Megatron-Core, on the tiny `qwen3vl` model built offline: the config's
refusals, conversion, M-RoPE positions against transformers' get_rope_index, and logits
against transformers at TP 1 (fast) and TP 2 / PP 2 under torchrun (slow). Megatron runs in
subprocesses (see test_models.py)."""

import json
import sys
from pathlib import Path

import pytest
import torch

from models.qwen3vl.config import Qwen3VLSpec, check_layout
from models.qwen3vl.convert import hf_to_megatron, load_hf_state, megatron_to_hf, shard
from models.qwen3vl.rope_index import rope_index

from subproc import run_json

ROOT = Path(__file__).resolve().parents[2]
PROBES = {"text", "image", "multi_image", "video"}


@pytest.fixture(scope="module")
def tiny3():
    from models.tiny import tiny_model_dir

    return tiny_model_dir("qwen3vl", seed=0)


def _config(tiny3) -> dict:
    return json.loads((tiny3 / "config.json").read_text())


def test_spec_reads_the_tiny_model_and_the_family_finds_it(tiny3):
    from models.family import family_for_dir

    spec = Qwen3VLSpec.from_hf_dir(tiny3)
    assert family_for_dir(tiny3).parity_module == "models.qwen3vl.parity"
    assert (spec.hidden_size, spec.head_dim, spec.num_layers, spec.mrope_section) == (128, 64, 4, (12, 10, 10))
    assert (spec.vision_embed_dim, spec.patch_size, spec.num_position_embeddings) == (64, 16, 256)
    assert spec.deepstack_visual_indexes == (0, 1) and spec.position_grid_side == 16


@pytest.mark.parametrize("change, message", [
    (lambda c: c.update(model_type="qwen3_vl_moe"), "MoE variant is not implemented"),
    (lambda c: c["text_config"]["rope_parameters"].update(rope_type="yarn"), "rope_type 'yarn'"),
    (lambda c: c["text_config"]["rope_parameters"].update(mrope_interleaved=False), "mrope_interleaved is false"),
    (lambda c: c["text_config"]["rope_parameters"].pop("mrope_interleaved"), "mrope_interleaved is false"),
    (lambda c: c["text_config"].update(attention_bias=True), "attention_bias"),
    (lambda c: c["text_config"].update(hidden_act="gelu"), "text hidden_act 'gelu'"),
    (lambda c: c["vision_config"].update(hidden_act="silu"), "vision hidden_act 'silu'"),
    (lambda c: c["vision_config"].update(num_position_embeddings=200), "not a square"),
    (lambda c: c["vision_config"].update(deepstack_visual_indexes=[1, 0]), "deepstack_visual_indexes"),
    (lambda c: c["text_config"]["rope_parameters"].update(mrope_section=[12, 10, 12]), "mrope_section"),
])
def test_config_refuses_what_is_not_implemented(tiny3, change, message):
    cfg = _config(tiny3)
    Qwen3VLSpec.from_hf_config(cfg)  # the unchanged config reads
    change(cfg)
    with pytest.raises(ValueError, match=message):
        Qwen3VLSpec.from_hf_config(cfg, "tiny")


def test_layout_keeps_deepstack_layers_beside_the_vision_tower(tiny3):
    spec = Qwen3VLSpec.from_hf_dir(tiny3)
    check_layout(spec, 2, 2)  # 2 layers a stage: both DeepStack layers on the first
    with pytest.raises(ValueError, match="DeepStack"):
        check_layout(spec, 1, 4)  # 1 layer a stage: layer 1's features would be on stage 2
    from models.qwen3vl.config import language_config

    with pytest.raises(ValueError, match="recompute 'full' with pipeline_parallel > 1"):
        language_config(spec, recompute="full", pp=2)
    assert language_config(spec, recompute="full").recompute_granularity == "full"  # without a pipeline


def test_hf_megatron_hf_roundtrip_is_bitwise(tiny3):
    hf = load_hf_state(tiny3)
    spec = Qwen3VLSpec.from_hf_dir(tiny3)
    full = hf_to_megatron(hf, spec)
    back = megatron_to_hf(full, spec)
    assert back.keys() == hf.keys()  # every tensor (DeepStack mergers, q/k norms, pos table) both ways
    for k in hf:
        assert back[k].dtype == hf[k].dtype and torch.equal(back[k], hf[k]), k
    # under TP the language MLP's [gate; up] splits by halves; the vision MLP (not gated) plainly
    param = torch.nn.Parameter(torch.empty(0))
    param.tensor_model_parallel, param.partition_dim = True, 0
    name = "language.decoder.layers.0.mlp.linear_fc1.weight"
    gate, up = full[name].chunk(2)
    assert torch.equal(shard(name, full[name], param, 1, 2), torch.cat([gate.chunk(2)[1], up.chunk(2)[1]]))
    name = "vision.decoder.layers.0.mlp.linear_fc1.weight"
    assert torch.equal(shard(name, full[name], param, 1, 2), full[name].chunk(2)[1])


def test_rope_index_equals_transformers(tiny3):
    """An image and a 3-temporal-patch video (timestamp text between its frames, as the
    processor writes it), a second row right-padded: transformers' positions exactly."""
    from transformers import Qwen3VLConfig
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLModel

    spec = Qwen3VLSpec.from_hf_dir(tiny3)
    img, vid, start = spec.image_token_id, spec.video_token_id, spec.vision_start_token_id
    frame = [start] + [vid] * 6 + [5]  # merged 2 x 3 per temporal patch
    row0 = [1, 2, start] + [img] * 12 + [3] + [7, 8] + frame + [9] + frame + [9] + frame + [4, 4]  # image 3 x 4
    row1 = [1, start] + [img] * 4 + [6, 6, 6]  # image 2 x 2, then padding
    ids = torch.tensor([row0, row1 + [0] * (len(row0) - len(row1))])
    mask = torch.tensor([[1] * len(row0), [1] * len(row1) + [0] * (len(row0) - len(row1))])
    image_grid = torch.tensor([[1, 6, 8], [1, 4, 4]])
    video_grid = torch.tensor([[3, 4, 6]])
    ours = rope_index(ids, image_grid, video_grid, img, vid, spec.spatial_merge_size, mask)

    hf_model = Qwen3VLModel.__new__(Qwen3VLModel)
    hf_model.config = Qwen3VLConfig.from_pretrained(tiny3)
    types = (ids == img).int() + 2 * (ids == vid).int()
    ref, _ = Qwen3VLModel.get_rope_index(hf_model, ids, types, image_grid, video_grid.clone(), mask)
    real = mask.bool()
    assert torch.equal(ours[:, real], ref[:, real])
    # each temporal patch is a one-frame image: t starts where the group starts, no time axis
    first = row0.index(vid)
    assert ours[:, 0, first].tolist() == [first - 12 + 4] * 3  # the 12 image tokens span max(3, 4) positions


def _parity(tiny3, *torchrun: str, timeout: int = 300) -> dict:
    """The parity module's result, after checking that the model's HF export (TP-gathered,
    handed between stages) gave back the checkpoint bit for bit."""
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"] if torchrun else \
        [sys.executable]
    result = run_json([*launch, "-m", "models.qwen3vl.parity", str(tiny3), *torchrun], timeout=timeout)
    assert result["max_abs_diff"].pop("export_equal") == 1.0, result
    return result


def test_parity_with_transformers_tp1(tiny3):
    """Text, one image, two images and a video (two temporal patches with timestamps): the
    DeepStack features, interleaved M-RoPE, q/k norms and the learned position table all in."""
    result = _parity(tiny3)
    print("Qwen3-VL TP 1 max |logits diff| vs transformers:", result)
    assert set(result["max_abs_diff"]) == PROBES
    # measured 0.0 for every probe (the same float32 ops in the same order: the patch embedding
    # runs as transformers' Conv3d); 1e-5 leaves room for another CPU's kernels. Without the
    # DeepStack additions the image logits move by 17 (checked by hand)
    assert all(d <= 1e-5 for d in result["max_abs_diff"].values()), result


@pytest.mark.slow
def test_parity_with_transformers_tp2(tiny3):
    """Against transformers as it is, and against transformers summing its row-parallel products
    in TP 2's order ("tp_order/", models/qwen3vl/parity.py): the first differ by the float32
    order alone, the second must agree (a bias added before the all-reduce shows there as 1e-5
    while the first stay at 1.3e-5: checked by hand)."""
    result = _parity(tiny3, "--tp", "2")
    print("Qwen3-VL TP 2 max |logits diff| vs transformers:", result)
    diffs = result["max_abs_diff"]
    in_tp_order = {k.removeprefix("tp_order/"): diffs.pop(k) for k in list(diffs) if k.startswith("tp_order/")}
    assert result["tp"] == 2 and set(diffs) == PROBES and set(in_tp_order) == PROBES, result
    # measured 1.3e-5 on every probe, text included: the logits reach 24, so ~7 float32 steps
    assert all(d < 1e-4 for d in diffs.values()), result
    # measured 0.0 on every probe; 1e-6 for another CPU's kernels
    assert all(d <= 1e-6 for d in in_tp_order.values()), result


@pytest.mark.slow
def test_parity_with_transformers_pp2(tiny3):
    """Two uneven stages (`--pipeline-layers 3,1`): the vision tower and layers 0-2 (both
    DeepStack layers among them) on rank 0, layer 3 and the head on rank 1, through Megatron's
    schedule."""
    # through the CLI (`yatt-mm model parity`, which hands --pipeline-layers to the family's module)
    result = run_json([sys.executable, "-m", "yatt_mm.cli", "model", "parity", str(tiny3), "--pp", "2",
                       "--pipeline-layers", "3,1"], timeout=300)
    assert result["max_abs_diff"].pop("export_equal") == 1.0, result
    print("Qwen3-VL PP 2 [3, 1] max |logits diff| vs transformers:", result)
    assert result["pp"] == 2 and result["pipeline_layers"] == [3, 1] and set(result["max_abs_diff"]) == PROBES
    assert all(d <= 1e-5 for d in result["max_abs_diff"].values()), result  # measured 0.0


@pytest.mark.slow
def test_trainer_logprobs_match_vllm_on_an_image_two_images_and_a_video(tiny3):
    """The Megatron trainer and vLLM (in one process, as in an RL rank, ~60 s): logprobs of vLLM's
    sampled tokens and of every prompt token, per prompt, before and after a step whose weights
    are pushed into the engine in buckets. The video was 0.45 apart before tiny Qwen3-VL v2 and
    the trainer's video metadata (yatt_mm/engines/vllm_fixes.py, media.py)."""
    result = run_json([sys.executable, str(ROOT / "tests/dist/vlm_vs_vllm.py"), "--kind", "qwen3vl", "--two-images"],
                      timeout=600)
    print("Qwen3-VL trainer vs vLLM logprob |diff|:", result)
    assert result["model_type"] == "qwen3_vl" and result["video_timed"] and result["positions_equal"], result
    assert set(result["before_max_each"]) == {"image", "video", "two_images"}
    # measured 5.5e-6 (image), 9.1e-6 (video), 8.3e-6 (two images); every prompt token 7.6e-6 to 1.1e-5
    assert all(d < 1e-4 for d in result["before_max_each"].values()), result
    assert all(d < 1e-4 for d in result["before_prompt_max_each"].values()), result
    assert result["before_mean"] < 1e-5  # measured 1.6e-6
    assert result["buckets_cover_export"] and result["sync_buckets"] > 3, result
    assert result["after_max"] < 1e-4 and result["after_prompt_max"] < 1e-4, result  # 3.8e-6, 1.1e-5
