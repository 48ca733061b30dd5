"""run.checkpoint_format=torch_dist: a full-weight trainer's state in Megatron-Core's distributed
checkpoint, resumed at another layout by the checkpointer with no conversion step
(tests/dist/dist_checkpoint.py; models/dist_ckpt.py)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from tests.subproc import ROOT

SCRIPT = str(ROOT / "tests/dist/dist_checkpoint.py")


def _launch(nproc: int, *args) -> tuple[dict, str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc), SCRIPT,
           *map(str, args)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-4000:])
    return json.loads([ln for ln in proc.stdout.splitlines() if ln.startswith("{")][-1]), proc.stdout


def _weights(path):
    from safetensors.torch import load_file

    return load_file(str(path))


def _global_tensors(ckpt, tmp) -> dict:
    """Every global tensor of a distributed checkpoint (the model's and the optimizer's, whole),
    read in this process."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(str(ckpt / "trainer"), str(tmp))
    return {k: v for k, v in torch.load(tmp, weights_only=False).items() if isinstance(v, torch.Tensor)}


def _assert_resumed_as_saved(root, saved: dict, resumed: dict, tmp_path) -> None:
    """The resume's weights (or adapter) equal the saved ones bit for bit, so does the state it
    restored, and step 2 trains as the uninterrupted run did within float32 rounding."""
    written, back = _weights(root / "weights_save.safetensors"), _weights(root / "weights_resume.safetensors")
    assert back.keys() == written.keys() and all(torch.equal(back[k], written[k]) for k in written)
    _assert_restored_bitwise(root, tmp_path)
    for k in ("loss", "grad_norm"):
        assert resumed[k] == pytest.approx(saved[k], rel=2e-6), k


def _assert_restored_bitwise(root, tmp_path) -> None:
    """The state a resume restored, saved again at its own layout, holds the same global tensors as
    the checkpoint it resumed, bit for bit: the weights and the optimizer's main weights and moments."""
    import shutil

    written = _global_tensors(root / "checkpoints" / "step_1", tmp_path / "written.pt")
    again = _global_tensors(root / "resaved" / "step_1", tmp_path / "again.pt")
    shutil.rmtree(root / "resaved")
    assert any(k.startswith("optimizer.state.exp_avg.") for k in written), sorted(written)[:5]
    assert again.keys() == written.keys(), sorted(set(again) ^ set(written))[:5]
    assert all(torch.equal(again[k], written[k]) for k in written), \
        [k for k in written if not torch.equal(again[k], written[k])][:5]


@pytest.mark.slow  # ten launches of 1-2 ranks, ~10 s each
def test_a_checkpoint_written_at_one_layout_resumes_at_another_tp_pp_dp_ep_and_optimizer(tmp_path):
    """Written at DP 2 with the distributed optimizer, resumed: at the same layout (checked bit
    for bit against the markers' SHA-256); at DP 1 x TP 2 with the plain optimizer; at DP 1 x PP 2.
    The tiny Qwen3-VL-MoE written at EP 2 resumes on one rank (EP 1, plain optimizer). Each
    resume's weights are the saved ones bit for bit (gathered into HF names), and step 2 after it
    gives the uninterrupted run's loss and gradient norm: equal at the same layout, within
    float32 rounding of another reduction order elsewhere. A LoRA run of the tiny Qwen3.5 with
    adapters on every target (the gated DeltaNet's fused in_proj: six sections, each split over TP
    on its own; [gate; up]; the vision tower's) written at DP 2 resumes at TP 2: its adapter, as
    PEFT names it, is the saved one bit for bit. The MoE's 4 layers written at PP 2 as 2 + 2 resume
    at PP 2 as 3 + 1 (the same sizes, another split: not taken for the writing layout)."""
    dense, moe = tmp_path / "dense", tmp_path / "moe"
    saved, _ = _launch(2, "save", dense, "policy", 1, 1, 1, 1)
    assert saved["checkpoint/snapshot_seconds"] > 0
    assert saved["snapshot_shares_live"] == 0  # SwiGLU's factory held its live parameter once
    step = dense / "checkpoints" / "step_1"
    markers = [json.loads((step / f"done_rank{r}").read_text()) for r in range(2)]
    assert all(m["format"] == "torch_dist" for m in markers)
    assert {"trainer/.metadata", "trainer/common.pt", "trainer/metadata.json"} <= set(markers[0]["files"])
    assert not list(step.glob("trainer_rank*.pt"))
    written = _weights(dense / "weights_save.safetensors")
    for nproc, tp, pp, distopt, how in (
            (2, 1, 1, 1, "weights and optimizer state bitwise as written"),
            (2, 2, 1, 0, "read at this layout from the distributed checkpoint written at DP 2 x TP 1 x PP 1 x CP 1, "
                         "distributed_optimizer=true"),
            (2, 1, 2, 1, "read at this layout")):
        resumed, said = _launch(nproc, "resume", dense, "policy", tp, pp, 1, distopt)
        print((tp, pp, distopt), resumed)
        assert f"resumed from {step} (step 1; " in said and how in said, said
        assert "converting" not in said
        back = _weights(dense / "weights_resume.safetensors")
        assert back.keys() == written.keys() and all(torch.equal(back[k], written[k]) for k in written)
        _assert_restored_bitwise(dense, tmp_path)
        if (tp, pp, distopt) == (1, 1, 1):
            assert (resumed["loss"], resumed["grad_norm"]) == (saved["loss"], saved["grad_norm"])
        for k in ("loss", "grad_norm"):
            assert resumed[k] == pytest.approx(saved[k], rel=2e-6), (k, tp, pp)

    saved, _ = _launch(2, "save", moe, "qwen3vlmoe", 1, 1, 2, 1)
    resumed, said = _launch(1, "resume", moe, "qwen3vlmoe", 1, 1, 1, 0)
    assert "distributed checkpoint written at DP 2 x TP 1 x PP 1 x CP 1 x EP 2" in said, said
    _assert_resumed_as_saved(moe, saved, resumed, tmp_path)

    lora, targets = tmp_path / "lora", ",".join(["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                 "down_proj", "in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a",
                                                 "out_proj"])
    saved, _ = _launch(2, "save", lora, "qwen35", 1, 1, 1, 1, 4, targets)
    held = json.loads((lora / "checkpoints" / "step_1" / "done_rank0").read_text())
    assert held["base"]["lora_rank"] == 4
    resumed, said = _launch(2, "resume", lora, "qwen35", 2, 1, 1, 1, 4, targets)
    assert "the LoRA adapter and its optimizer state read at this layout" in said, said
    adapter = _weights(lora / "weights_save.safetensors")
    assert any(".in_proj_z." in k for k in adapter) and any("visual" in k for k in adapter), sorted(adapter)[:5]
    _assert_resumed_as_saved(lora, saved, resumed, tmp_path)

    split = tmp_path / "split"
    saved, _ = _launch(2, "save", split, "qwen3vlmoe", 1, 2, 1, 1, "layers=2,2")
    resumed, said = _launch(2, "resume", split, "qwen3vlmoe", 1, 2, 1, 1, "layers=3,1")
    assert "written at DP 1 x TP 1 x PP 2 x CP 1, distributed_optimizer=true, pipeline_layers=[2, 2]" in said, said
    _assert_resumed_as_saved(split, saved, resumed, tmp_path)
