"""The checkpointer in-process: a real torch module and Adam state, a real dynamic sampler whose
buffer holds a group with an image, written by the background thread and read back."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from PIL import Image

from yatt_mm.engines.engine import Response
from yatt_mm.rl.checkpoint import Checkpointer, NoUsableCheckpoint, drop_lines_after
from yatt_mm.rl.checkpoint_files import latest_complete
from yatt_mm.rl.checkpoint_state import controller_state, load_controller, load_trainer
from yatt_mm.rl.layout import Layout, resume_plan, weights_plan
from yatt_mm.rl.dynamic_sampling import DynamicSampler, DynamicSamplingConfig
from yatt_mm.rl.samples import Group, Prompt


def _trainer(seed: int):
    torch.manual_seed(seed)
    module = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    opt = torch.optim.Adam(module.parameters(), lr=0.1)
    module(torch.randn(3, 4)).sum().backward()
    opt.step()  # optimizer state that must come back exactly
    # a stand-in for VLMTrainer: its checkpoint interface over a plain module and Adam
    cfg = SimpleNamespace(tensor_parallel=1, pipeline_parallel=1, distributed_optimizer=False)
    return SimpleNamespace(module=module, optimizer=opt, cfg=cfg, optimizer_state=opt.state_dict,
                           load_optimizer_state=opt.load_state_dict, checkpoint_weights=module.state_dict,
                           load_checkpoint_weights=module.load_state_dict, lora=None)


class _Source:
    def __init__(self, position=0):
        self.position = position

    def state_dict(self):
        return {"position": self.position}

    def load_state_dict(self, state):
        self.position = state["position"]


def _controller(position: int, buffered: bool):
    sampler = DynamicSampler(DynamicSamplingConfig())
    if buffered:
        prompt = Prompt("k1", "What colour?", "red", images=[Image.new("RGB", (28, 28), "red")], metadata={"t": 1})
        sampler.buffer = [Group(prompt, [Response([5, 6], "red", [-0.1, -0.2], "stop")], [1.0], {"exact_match": [1.0]})]
        sampler.valid_rate = 0.3
    return SimpleNamespace(source=_Source(position), sampler=sampler)


def test_round_trip_is_bitwise_and_restores_the_controller(tmp_path):
    saved, ctrl = _trainer(0), _controller(17, buffered=True)
    ckpt = Checkpointer(tmp_path, rank=0, world=1, keep=2, attempt="a")
    ckpt.save(3, saved, ctrl)
    ckpt.wait()
    found = latest_complete(tmp_path, world=1)
    assert found is not None and found.name == "step_3"
    fresh, restored = _trainer(1), _controller(0, buffered=False)
    assert not torch.equal(fresh.module[0].weight, saved.module[0].weight)
    assert load_trainer(found, fresh, rank=0, world=1) == 3
    for a, b in zip(saved.module.parameters(), fresh.module.parameters()):
        assert torch.equal(a, b)
    for sa, sb in zip(saved.optimizer.state.values(), fresh.optimizer.state.values()):
        assert all(torch.equal(sa[k], sb[k]) for k in ("exp_avg", "exp_avg_sq", "step"))
    load_controller(found, restored, dp_rank=0)
    assert restored.source.position == 17 and restored.sampler.valid_rate == 0.3
    group = restored.sampler.buffer[0]
    assert group.prompt.key == "k1" and group.prompt.metadata == {"t": 1} and group.rewards == [1.0]
    assert group.prompt.images[0].getpixel((0, 0)) == (255, 0, 0) and group.responses[0].token_ids == [5, 6]


def test_incomplete_or_damaged_checkpoints_are_never_used(tmp_path):
    trainer = _trainer(0)
    ckpt = Checkpointer(tmp_path, rank=0, world=2, keep=2, attempt="a")  # rank 1 never writes: incomplete
    ckpt.save(1, trainer)
    ckpt.wait()
    said = []
    assert latest_complete(tmp_path, world=2, say=said.append) is None  # skipped, not a world-size error
    assert said == [f"checkpoint {tmp_path / 'step_1'} is incomplete (1 of 2 ranks' markers): skipped"]
    other = Checkpointer(tmp_path, rank=1, world=2, keep=2, attempt="a")
    other.save(1, trainer)
    other.wait()  # now complete for the 2 ranks that wrote it, whatever size resumes it (resume_plan)
    assert latest_complete(tmp_path, world=1).name == "step_1"
    solo = Checkpointer(tmp_path / "solo", rank=0, world=1, keep=2, attempt="a")
    solo.save(1, trainer)
    solo.wait()
    done = tmp_path / "solo" / "step_1" / "done_rank0"
    with torch.no_grad():
        trainer.module[0].weight[0, 0] = torch.nextafter(trainer.module[0].weight[0, 0], torch.tensor(9.0))
    torch.save({"model": trainer.module.state_dict(), "optimizer": trainer.optimizer_state(), "step": 1,
                "world": 1, "tensor_parallel": 1}, tmp_path / "solo" / "step_1" / "trainer_rank0.pt")
    with pytest.raises(RuntimeError, match="damaged"):  # one float one ulp off: the hash says so
        load_trainer(tmp_path / "solo" / "step_1", _trainer(1), rank=0, world=1)
    assert done.is_file()


def test_markers_of_a_crashed_attempt_never_complete_a_rewritten_checkpoint(tmp_path):
    """Attempt a: rank 0 finished step_4, rank 1 was killed. Attempt b rewrites step_4 and
    rank 1 finishes first: two markers, from two attempts, must not look complete."""
    trainer = _trainer(0)
    for rank, attempt in ((0, "a"), (1, "b")):
        ckpt = Checkpointer(tmp_path, rank=rank, world=2, keep=2, attempt=attempt)
        ckpt.save(4, trainer)
        ckpt.wait()
    said = []
    assert latest_complete(tmp_path, world=2, say=said.append) is None
    assert "from 2 different attempts" in said[0]
    ckpt = Checkpointer(tmp_path, rank=0, world=2, keep=2, attempt="b")  # attempt b's rank 0 catches up
    ckpt.save(4, trainer)
    ckpt.wait()
    assert latest_complete(tmp_path, world=2).name == "step_4"
    assert not list(tmp_path.glob("step_4/.*.tmp"))  # every file renamed into place


def test_only_the_newest_complete_checkpoints_are_kept(tmp_path):
    trainer = _trainer(0)
    ckpt = Checkpointer(tmp_path, rank=0, world=1, keep=2, attempt="a")
    for step in (1, 2, 3):
        ckpt.save(step, trainer)
        ckpt.wait()
    assert sorted(d.name for d in tmp_path.glob("step_*")) == ["step_2", "step_3"]


def test_resume_restores_and_drops_log_lines_of_lost_steps(tmp_path):
    saved = _trainer(0)
    ckpt = Checkpointer(tmp_path / "checkpoints", rank=0, world=1, keep=2, attempt="a")
    ckpt.save(2, saved, _controller(5, buffered=False))
    ckpt.wait()
    log = tmp_path / "metrics.jsonl"
    log.write_text("".join(json.dumps({"step": s}) + "\n" for s in range(5)))
    fresh, ctrl, synced = _trainer(1), _controller(0, buffered=False), []
    assert ckpt.resume(fresh, ctrl, 0, lambda: synced.append(True), [log]) == 2
    assert synced == [True] and ctrl.source.position == 5
    assert torch.equal(fresh.module[1].bias, saved.module[1].bias)
    assert [json.loads(ln)["step"] for ln in log.read_text().splitlines()] == [0, 1, 2]
    drop_lines_after(tmp_path / "missing.jsonl", 1)  # no file: nothing to do


def test_no_checkpoint_means_a_fresh_start_and_the_crashed_attempts_lines_go(tmp_path):
    """A crash before the first checkpoint: the rerun starts at step 0, so every logged step of
    the crashed attempt (metrics, data lineage) is dropped, or its samples would count twice."""
    ckpt = Checkpointer(tmp_path / "checkpoints", rank=0, world=1, keep=2, attempt="a")
    log = tmp_path / "consumed_rank0.jsonl"
    log.write_text('{"step": 0}\n{"step": 1}\n{"step": 2, "ke')  # torn by a kill -9
    assert ckpt.resume(_trainer(0), None, 0, lambda: pytest.fail("no sync without a checkpoint"), [log]) == 0
    assert log.read_text() == ""


def test_a_torn_last_log_line_is_dropped_and_a_torn_middle_line_is_an_error(tmp_path):
    log = tmp_path / "metrics.jsonl"
    log.write_text('{"step": 1}\n{"step": 2}\n{"st')
    drop_lines_after(log, 5)
    assert log.read_text() == '{"step": 1}\n{"step": 2}\n'
    log.write_text('{"step": 1}\n{"st\n{"step": 2}\n')
    with pytest.raises(RuntimeError, match="line 2 is not JSON"):
        drop_lines_after(log, 5)


# ---------------------------------------------------------------- damaged checkpoints fall back


def _two_checkpoints(root, world: int = 1, rank: int = 0, dp_rank: int = 0):
    """Steps 2 and 4 of one attempt, each with its controller files (data positions 2 and 4)."""
    ckpt = Checkpointer(root, rank=rank, world=world, keep=2, attempt="a")
    for step in (2, 4):
        ckpt.save(step, _trainer(step), _controller(step, buffered=False), dp_rank=dp_rank)
        ckpt.wait()
    return ckpt


def _truncate(path, keep: float = 0.5) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


def test_a_truncated_newest_checkpoint_is_named_and_the_one_before_resumes(tmp_path, capsys):
    ckpt = _two_checkpoints(tmp_path)
    _truncate(tmp_path / "step_4" / "trainer_rank0.pt")
    fresh, ctrl = _trainer(9), _controller(0, buffered=False)
    assert ckpt.resume(fresh, ctrl, 0, lambda: None, []) == 2
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith(f"checkpoint {tmp_path / 'step_4'} is damaged, skipped: rank 0: trainer_rank0.pt "
                               "cannot be read (truncated or damaged: PytorchStreamReader failed"), lines
    assert lines[1].startswith(f"resumed from {tmp_path / 'step_2'} (step 2;")
    assert ctrl.source.position == 2 and torch.equal(fresh.module[0].weight, _trainer(2).module[0].weight)


@pytest.mark.parametrize("damage, reason", [
    ("hash", "trainer_rank0.pt does not hash to the SHA-256 in done_rank0"),
    ("no_controller", "controller_dp0.safetensors is missing"),
    ("bad_controller", "controller_dp0.json cannot be read (truncated or damaged: "),
])
def test_each_kind_of_damage_is_named_with_its_own_reason(tmp_path, capsys, damage, reason):
    ckpt = _two_checkpoints(tmp_path)
    newest = tmp_path / "step_4"
    if damage == "hash":  # a whole, loadable file whose weights are not the ones written: one float one ulp off
        state = torch.load(newest / "trainer_rank0.pt", weights_only=True)
        weight = state["model"]["0.weight"]
        weight[0, 0] = torch.nextafter(weight[0, 0], torch.tensor(9.0))
        torch.save(state, newest / "trainer_rank0.pt")
    elif damage == "no_controller":
        (newest / "controller_dp0.safetensors").unlink()
    else:
        _truncate(newest / "controller_dp0.json")
    assert ckpt.resume(_trainer(9), _controller(0, buffered=False), 0, lambda: None, []) == 2
    assert f"checkpoint {newest} is damaged, skipped: rank 0: {reason}" in capsys.readouterr().out


def test_when_every_checkpoint_is_damaged_the_run_stops_with_one_clear_error(tmp_path, capsys):
    ckpt = _two_checkpoints(tmp_path)
    for step in (2, 4):
        _truncate(tmp_path / f"step_{step}" / "trainer_rank0.pt")
    log = tmp_path / "metrics.jsonl"
    log.write_text('{"step": 1}\n')
    with pytest.raises(NoUsableCheckpoint) as e:
        ckpt.resume(_trainer(9), _controller(0, buffered=False), 0, lambda: pytest.fail("nothing to sync"), [log])
    assert str(e.value) == (f"no checkpoint in {tmp_path} can be resumed: all 2 complete one(s) are damaged (step_4, "
                            f"step_2; the reasons are above). Restore them from a copy, or remove {tmp_path} to start "
                            "this run over from step 0")
    said = capsys.readouterr().out.splitlines()
    assert [line.split(" is damaged")[0] for line in said] == [f"checkpoint {tmp_path / f'step_{s}'}" for s in (4, 2)]
    assert log.read_text() == '{"step": 1}\n'  # the run's logs stay as they were: nothing resumed, nothing restarted


@pytest.mark.filterwarnings("ignore:You are using a Backend")  # gloo_threads' bare groups, made without a default group
def test_ranks_agree_on_the_newest_checkpoint_every_one_of_them_verifies(tmp_path, capsys):
    """Two ranks (real gloo, a thread each) with checkpoints 2, 4 and 6: rank 1's file of step 6
    and rank 0's of step 4 are damaged, so only step 2 verifies on both. Each rank checks only
    its own files; both resume step 2, and rank 0 names each skipped step with the failing
    rank's reason."""
    from gloo_threads import on_ranks

    for rank in (0, 1):
        ckpt = Checkpointer(tmp_path, rank=rank, world=2, keep=3, attempt="a")
        for step in (2, 4, 6):
            ckpt.save(step, _trainer(step), _controller(step, buffered=False), dp_rank=rank)
            ckpt.wait()
    _truncate(tmp_path / "step_6" / "trainer_rank1.pt")
    (tmp_path / "step_4" / "controller_dp0.json").unlink()

    def resume(rank, group):
        ctrl = _controller(0, buffered=False)
        ckpt = Checkpointer(tmp_path, rank=rank, world=2, keep=3, attempt="b")
        return ckpt.resume(_trainer(9), ctrl, rank, lambda: None, [], group=group), ctrl.source.position

    assert on_ranks(2, resume) == [(2, 2), (2, 2)]
    said = [line for line in capsys.readouterr().out.splitlines() if "damaged" in line]
    assert said == [f"checkpoint {tmp_path / 'step_6'} is damaged, skipped: rank 1: trainer_rank1.pt cannot be read "
                    f"(truncated or damaged: {said[0].split('truncated or damaged: ', 1)[-1]}",
                    f"checkpoint {tmp_path / 'step_4'} is damaged, skipped: rank 0: controller_dp0.json is missing"]


def _lora_trainer(seed: int, base_seed: int = 0, rank: int = 2):
    """A stand-in for a LoRA VLMTrainer: a frozen base linear with an adapter pair named as
    models/lora.py names them, Adam over the adapter alone, and the trainer's own checkpoint
    methods (VLMTrainer.checkpoint_weights / load_checkpoint_weights) bound to it."""
    from types import MethodType

    from models.trainer import VLMTrainer

    torch.manual_seed(base_seed)
    module = torch.nn.Sequential(torch.nn.Linear(4, 4)).requires_grad_(False)
    torch.manual_seed(seed)
    module[0].lora_A = torch.nn.Parameter(torch.randn(rank, 4))
    module[0].lora_B = torch.nn.Parameter(torch.randn(4, rank))
    opt = torch.optim.Adam([module[0].lora_A, module[0].lora_B], lr=0.1)
    x = torch.randn(3, 4)
    (module(x) + x @ module[0].lora_A.T @ module[0].lora_B.T).sum().backward()
    opt.step()
    cfg = SimpleNamespace(tensor_parallel=1, pipeline_parallel=1, distributed_optimizer=False)
    trainer = SimpleNamespace(module=module, optimizer=opt, cfg=cfg, optimizer_state=opt.state_dict,
                              load_optimizer_state=opt.load_state_dict, lora=SimpleNamespace(rank=rank),
                              hf_dir="/models/base")
    trainer.checkpoint_weights = MethodType(VLMTrainer.checkpoint_weights, trainer)
    trainer.load_checkpoint_weights = MethodType(VLMTrainer.load_checkpoint_weights, trainer)
    return trainer


def test_a_lora_checkpoint_holds_the_adapter_and_its_base_by_hash_and_resumes_onto_that_base_only(tmp_path):
    saved = _lora_trainer(0)
    ckpt = Checkpointer(tmp_path, rank=0, world=1, keep=2, attempt="a")
    ckpt.save(2, saved)
    ckpt.wait()
    state = torch.load(tmp_path / "step_2" / "trainer_rank0.pt", weights_only=True)
    assert sorted(state["model"]) == ["0.lora_A", "0.lora_B"]  # no base weight, no base Adam state
    assert state["base"]["path"] == "/models/base" and state["base"]["lora_rank"] == 2
    assert len(state["base"]["sha256"]) == 64
    assert len(state["optimizer"]["state"]) == 2

    fresh = _lora_trainer(1)  # the same base, another adapter: restored bit for bit
    assert load_trainer(tmp_path / "step_2", fresh, rank=0, world=1) == 2
    for name in ("lora_A", "lora_B"):
        assert torch.equal(getattr(fresh.module[0], name), getattr(saved.module[0], name))
    for sa, sb in zip(saved.optimizer.state.values(), fresh.optimizer.state.values()):
        assert all(torch.equal(sa[k], sb[k]) for k in ("exp_avg", "exp_avg_sq", "step"))

    with pytest.raises(RuntimeError, match=r"/models/base has other weights .*resume with the base the adapter was"):
        load_trainer(tmp_path / "step_2", _lora_trainer(1, base_seed=7), rank=0, world=1)
    with pytest.raises(RuntimeError, match=r"written with policy.lora.rank=2; this run has policy.lora.rank=4"):
        load_trainer(tmp_path / "step_2", _lora_trainer(1, rank=4), rank=0, world=1)
    with pytest.raises(RuntimeError, match=r"written with policy.lora.rank=2; this run has policy.lora.rank=0"):
        load_trainer(tmp_path / "step_2", _trainer(1), rank=0, world=1)  # a full-weight run


def test_which_files_a_rank_reads_at_another_layout_and_which_changes_are_refused(tmp_path):
    """At another number of DP groups: without the distributed optimizer a rank loads the
    whole state of one old rank at its TP/PP place (at its expert shard with EP); with it, every
    old DP rank's there (their optimizer shards). Each controller reads every old group's
    position and takes the buffers of old groups d with d % new DP == its own."""
    at = lambda **kw: Layout(**({"dp": 2} | kw))  # noqa: E731
    same = resume_plan(at(), at(), rank=1)
    assert (same.trainers, same.positions, same.buffers, same.resharded) == ([1], [1], [1], False)
    shrink = resume_plan(at(), at(dp=1), rank=0)
    assert (shrink.trainers, shrink.positions, shrink.buffers, shrink.resharded) == ([0], [0, 1], [0, 1], True)
    grow = resume_plan(at(dp=1), at(dp=3), rank=2)
    assert (grow.trainers, grow.positions, grow.buffers) == ([0], [0], [])
    sharded = resume_plan(at(distributed_optimizer=True), at(dp=1, distributed_optimizer=True), rank=0)
    assert sharded.trainers == [0, 1]
    tp2 = resume_plan(at(tp=2, pp=2), at(tp=2, pp=2, dp=1), rank=3)  # TP rank 1 of stage 1
    assert tp2.trainers == [2 * 2 * 1 + 1]  # the old TP rank 1 of stage 1, DP 0: rank 5
    moe = resume_plan(at(dp=4, ep=2), at(dp=2, ep=2), rank=1)
    assert moe.trainers == [1] and moe.buffers == [1, 3]
    # TP, PP, CP, EP and the distributed optimizer's setting may change: through HF names
    # (yatt_mm/rl/relayout.py), with or without the distributed optimizer
    plain_tp = resume_plan(at(), at(dp=1, tp=2), rank=0)
    assert plain_tp.convert and plain_tp.resharded and plain_tp.positions == [0, 1]
    sharded_at = lambda **kw: at(distributed_optimizer=True, **kw)  # noqa: E731
    switch = resume_plan(at(), sharded_at(), rank=1)
    assert (switch.convert, switch.resharded, switch.positions, switch.buffers) == (True, False, [1], [1])
    assert resume_plan(sharded_at(), at(), rank=0).convert
    tp_change = resume_plan(sharded_at(tp=2, dp=1), sharded_at(dp=1, pp=2), rank=1)
    assert (tp_change.convert, tp_change.resharded, tp_change.trainers, tp_change.positions) == (True, False, [], [0])
    both = resume_plan(sharded_at(tp=2, dp=2), sharded_at(tp=1, dp=1), rank=0)
    assert both.convert and both.resharded and both.positions == [0, 1] and both.buffers == [0, 1]
    # EP too, from a checkpoint written at DP = EP (its ranks are the conversion's); a DP change
    # under EP converts as well (the experts' optimizer shards lie over other groups)
    ep_change = resume_plan(sharded_at(ep=2), sharded_at(ep=1), rank=1)
    assert (ep_change.convert, ep_change.resharded, ep_change.positions) == (True, False, [1])
    ep_dp = resume_plan(sharded_at(ep=2), sharded_at(dp=4, ep=2), rank=3)
    assert ep_dp.convert and ep_dp.resharded and ep_dp.positions == [0, 1] and ep_dp.buffers == []
    # written at DP > EP with the distributed optimizer: converted too, by the ranks of the layout
    # that wrote it (the experts' optimizer shards lie over their expert-data-parallel ranks)
    assert resume_plan(sharded_at(dp=4, ep=2), sharded_at(ep=2), 0).convert
    assert resume_plan(sharded_at(dp=4, ep=2), sharded_at(dp=4, ep=1), 0).convert
    assert resume_plan(at(dp=4, ep=2), at(ep=1), rank=0).convert  # plain: each DP rank holds its shard whole
    # the export's weights alone come from any such checkpoint: each export rank (one per expert
    # shard and TP place) reads the file of DP group 0's rank at its place
    from yatt_mm.rl.export import export_layout

    wide = sharded_at(dp=4, ep=2, tp=2)
    assert [weights_plan(wide, export_layout(wide), r).trainers for r in range(4)] == [[0], [1], [2], [3]]
    assert weights_plan(wide, export_layout(wide), 3).saved == wide
    assert export_layout(wide, with_optimizer=True) == wide  # the conversion: every rank its own file
    assert export_layout(sharded_at(ep=2), with_optimizer=True) == sharded_at(ep=2)  # DP = EP already
    assert export_layout(at(dp=4, ep=2), with_optimizer=True).dp == 2  # plain: each DP rank holds it whole


def test_a_controller_resumed_at_another_dp_size_reads_the_rest_of_the_epoch_and_takes_the_buffers(tmp_path):
    """Two DP groups' real readers and samplers, written as a 2-rank run writes them, resumed by
    one group: it reads exactly the samples neither had read, and holds both groups' buffers."""
    from dataio.reader import DataConfig, DataReader
    from dataio.synth import write_shards
    from yatt_mm.rl.sources import ParallelSource

    write_shards(str(tmp_path / "data"), images=11, videos=0, samples_per_shard=4, seed=1, tasks=["colour"])
    data = DataConfig(shards=[str(tmp_path / "data")], seed=3, slice_size=2, shuffle_buffer=3, workers=0)

    def controller(dp_rank, dp_size):
        sampler = DynamicSampler(DynamicSamplingConfig())
        return SimpleNamespace(source=ParallelSource(DataReader(data, dp_rank, dp_size)), sampler=sampler)

    old = [controller(0, 2), controller(1, 2)]
    taken = [p.key for c, n in zip(old, (2, 4)) for p in c.source.take(n)]
    for d, c in enumerate(old):
        c.sampler.buffer = [Group(c.source.take(1)[0], [Response([d], "x", [-0.5], "stop")], [1.0], {})]
        taken.append(c.sampler.buffer[0].prompt.key)
        c.sampler.valid_rate = 0.2 + 0.4 * d
        ckpt = Checkpointer(tmp_path / "ckpt", rank=d, world=2, keep=2, attempt="a")
        ckpt.save(1, _trainer(0), c, dp_rank=d)
        ckpt.wait()
    new = controller(0, 1)
    plan = resume_plan(Layout(dp=2), Layout(dp=1), rank=0)
    load_controller(tmp_path / "ckpt" / "step_1", new, 0, plan, dp_size=1)
    rest = [s.key for s in new.source.reader.iter_epoch()]
    assert sorted(taken + rest) == sorted(new.source.reader.index.sample_key) and len(rest) == 11 - 8
    assert [g.responses[0].token_ids for g in new.sampler.buffer] == [[0], [1]]
    assert new.sampler.buffer[1].prompt.images[0].size == old[1].sampler.buffer[0].prompt.images[0].size
    assert new.sampler.valid_rate == pytest.approx(0.4)
    assert controller_state(new)[0]["source"]["reader"]["dp_size"] == 1
