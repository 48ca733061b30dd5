"""run.checkpoint_format=torch_dist: a full-weight trainer's state in Megatron-Core's distributed
checkpoint, resumed at another layout by the checkpointer with no conversion step
(tests/dist/dist_checkpoint.py; models/dist_ckpt.py)."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
import torch

from tests.subproc import ROOT

SCRIPT = str(ROOT / "tests/dist/dist_checkpoint.py")


def _launch(*jobs: tuple) -> list[tuple[dict, str]]:
    """`jobs` one after another in one 2-rank launch: each job's JSON line and what it printed."""
    args = [a for i, job in enumerate(jobs) for a in ([] if i == 0 else ["+"]) + list(map(str, job))]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", SCRIPT, *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-4000:])
    heads = re.split(r"^=== job (\d+) ===$", proc.stdout, flags=re.M)  # [before, 0, what job 0 said, 1, ...]
    numbers, said = heads[1::2], heads[2::2]
    assert numbers == [str(i) for i in range(len(jobs))], proc.stdout[-2000:]
    return [(json.loads([ln for ln in part.splitlines() if ln.startswith("{")][-1]), part) for part in said]


def _weights(path):
    from safetensors.torch import load_file

    return load_file(str(path))


def _global_tensors(ckpt, tmp) -> dict:
    """Every global tensor of a distributed checkpoint (the model's and the optimizer's, whole),
    read in this process."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(str(ckpt / "trainer"), str(tmp))
    return {k: v for k, v in torch.load(tmp, weights_only=False).items() if isinstance(v, torch.Tensor)}


def _assert_resumed_as_saved(root, jobs: tuple[int, int], saved: dict, resumed: dict, tmp_path) -> None:
    """The resume's weights (or adapter) equal the saved ones bit for bit, so does the state it
    restored, and step 2 trains as the uninterrupted run did within float32 rounding."""
    written, back = (_weights(root / f"weights_{job}.safetensors") for job in jobs)
    assert back.keys() == written.keys() and all(torch.equal(back[k], written[k]) for k in written)
    _assert_restored_bitwise(root, jobs[1], tmp_path)
    for k in ("loss", "grad_norm"):
        assert resumed[k] == pytest.approx(saved[k], rel=2e-6), k


def _assert_restored_bitwise(root, job: int, tmp_path) -> None:
    """The state a resume restored, saved again at its own layout, holds the same global tensors as
    the checkpoint it resumed, bit for bit: the weights and the optimizer's main weights and moments."""
    written = _global_tensors(root / "checkpoints" / "step_1", tmp_path / "written.pt")
    again = _global_tensors(root / f"resaved_{job}" / "step_1", tmp_path / "again.pt")
    assert any(k.startswith("optimizer.state.exp_avg.") for k in written), sorted(written)[:5]
    assert again.keys() == written.keys(), sorted(set(again) ^ set(written))[:5]
    assert all(torch.equal(again[k], written[k]) for k in written), \
        [k for k in written if not torch.equal(again[k], written[k])][:5]


@pytest.mark.slow  # one 2-rank launch of ten jobs (~1 min on a quiet machine)
def test_a_checkpoint_written_at_one_layout_resumes_at_another_tp_pp_dp_ep_and_optimizer(tmp_path):
    """Written at DP 2 with the distributed optimizer, resumed: at the same layout (checked bit
    for bit against the markers' SHA-256); at DP 1 x TP 2 with the plain optimizer; at DP 1 x PP 2.
    The tiny Qwen3-VL-MoE written at EP 2 resumes at EP 1 (DP 2, plain optimizer). Each
    resume's weights are the saved ones bit for bit (gathered into HF names), and step 2 after it
    gives the uninterrupted run's loss and gradient norm: equal at the same layout, within
    float32 rounding of another reduction order elsewhere. A LoRA run of the tiny Qwen3.5 with
    adapters on every target (the gated DeltaNet's fused in_proj: six sections, each split over TP
    on its own; [gate; up]; the vision tower's) written at DP 2 resumes at TP 2: its adapter, as
    PEFT names it, is the saved one bit for bit. The MoE's 4 layers written at PP 2 as 2 + 2 resume
    at PP 2 as 3 + 1 (the same sizes, another split: not taken for the writing layout). The jobs
    share one launch, each with its own parallel state, trainer and checkpointer."""
    dense, moe, lora, split = (tmp_path / name for name in ("dense", "moe", "lora", "split"))
    targets = ",".join(["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "in_proj_qkv",
                        "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"])
    dense_resumes = ((1, 1, 1, "weights and optimizer state bitwise as written"),
                     (2, 1, 0, "read at this layout from the distributed checkpoint written at DP 2 x TP 1 x PP 1 x "
                               "CP 1, distributed_optimizer=true"),
                     (1, 2, 1, "read at this layout"))
    jobs = [("save", dense, "policy", 1, 1, 1, 1),
            *(("resume", dense, "policy", tp, pp, 1, distopt) for tp, pp, distopt, _ in dense_resumes),
            ("save", moe, "qwen3vlmoe", 1, 1, 2, 1), ("resume", moe, "qwen3vlmoe", 1, 1, 1, 0),
            ("save", lora, "qwen35", 1, 1, 1, 1, 4, targets), ("resume", lora, "qwen35", 2, 1, 1, 1, 4, targets),
            ("save", split, "qwen3vlmoe", 1, 2, 1, 1, "layers=2,2"),
            ("resume", split, "qwen3vlmoe", 1, 2, 1, 1, "layers=3,1")]
    ran = _launch(*jobs)

    saved = ran[0][0]
    assert saved["checkpoint/snapshot_seconds"] > 0
    assert saved["snapshot_shares_live"] == 0  # SwiGLU's factory held its live parameter once
    step = dense / "checkpoints" / "step_1"
    markers = [json.loads((step / f"done_rank{r}").read_text()) for r in range(2)]
    assert all(m["format"] == "torch_dist" for m in markers)
    assert {"trainer/.metadata", "trainer/common.pt", "trainer/metadata.json"} <= set(markers[0]["files"])
    assert not list(step.glob("trainer_rank*.pt"))
    written = _weights(dense / "weights_0.safetensors")
    for job, (tp, pp, distopt, how) in enumerate(dense_resumes, start=1):
        resumed, said = ran[job]
        print((tp, pp, distopt), resumed)
        assert f"resumed from {step} (step 1; " in said and how in said, said
        assert "converting" not in said
        back = _weights(dense / f"weights_{job}.safetensors")
        assert back.keys() == written.keys() and all(torch.equal(back[k], written[k]) for k in written)
        _assert_restored_bitwise(dense, job, tmp_path)
        if (tp, pp, distopt) == (1, 1, 1):
            assert (resumed["loss"], resumed["grad_norm"]) == (saved["loss"], saved["grad_norm"])
        for k in ("loss", "grad_norm"):
            assert resumed[k] == pytest.approx(saved[k], rel=2e-6), (k, tp, pp)

    assert "distributed checkpoint written at DP 2 x TP 1 x PP 1 x CP 1 x EP 2" in ran[5][1], ran[5][1]
    _assert_resumed_as_saved(moe, (4, 5), ran[4][0], ran[5][0], tmp_path)

    held = json.loads((lora / "checkpoints" / "step_1" / "done_rank0").read_text())
    assert held["base"]["lora_rank"] == 4
    assert "the LoRA adapter and its optimizer state read at this layout" in ran[7][1], ran[7][1]
    adapter = _weights(lora / "weights_6.safetensors")
    assert any(".in_proj_z." in k for k in adapter) and any("visual" in k for k in adapter), sorted(adapter)[:5]
    _assert_resumed_as_saved(lora, (6, 7), ran[6][0], ran[7][0], tmp_path)

    assert ("written at DP 1 x TP 1 x PP 2 x CP 1, distributed_optimizer=true, pipeline_layers=[2, 2]"
            in ran[9][1]), ran[9][1]
    _assert_resumed_as_saved(split, (8, 9), ran[8][0], ran[9][0], tmp_path)
