"""`yatt-mm rl`: the RL loop. One process per rank (torchrun); the TP rank 0 of every DP group
is that group's controller: it reads its own data, rolls out on its own vLLM engine, scores,
and builds training samples. Then all ranks balance, train, and sync weights.

    python -m torch.distributed.run --nproc-per-node 2 -m yatt_mm.rl.train --config configs/tiny_demo.yaml
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import asdict
from pathlib import Path

import models  # noqa: F401 - CPU runtime hooks before anything imports torchvision or megatron
import psutil
import torch
import torch.distributed as dist

from dataio.reader import DataConfig, DataReader
from models.trainer import MicroBatch, VLMTrainer, init_parallel
from yatt_mm import config_utils
from yatt_mm.algorithms import policy_loss
from yatt_mm.dynamic_sampling import DynamicSampler
from yatt_mm.launch import relaunch, under_torchrun
from yatt_mm.metrics import MetricsWriter, Timeline
from yatt_mm.rl.comm import balance_groups, broadcast_samples, sum_across
from yatt_mm.rl.checkpoint import Checkpointer, latest_complete, load_controller, load_trainer
from yatt_mm.rl.config import RLConfig, prebuild_models, resolve_model
from yatt_mm.rl.controller import Controller
from yatt_mm.rl.placement import PLANS, PhaseRunner
from yatt_mm.rl.rewarder import Rewarder, reward_metrics
from yatt_mm.rl.samples import SampleBuilder, micro_batches
from yatt_mm.rl.sources import ParallelSource, SingleControllerSource, to_prompt
from yatt_mm.rollout.engine import RolloutEngine, SamplingConfig


class Run:
    """Everything one rank holds for the run."""

    def __init__(self, cfg: RLConfig):
        from megatron.core import parallel_state as ps
        from transformers import AutoProcessor

        self.cfg = cfg
        init_parallel(cfg.policy.trainer.tensor_parallel, cfg.run.seed)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.dp_rank, self.dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
        self.leader = ps.get_tensor_model_parallel_rank() == 0  # this DP group's controller
        self.tp_group = ps.get_tensor_model_parallel_group()
        self.tp_src = ps.get_tensor_model_parallel_src_rank()
        self.leaders = ps.get_data_parallel_group() if self.leader else None  # TP rank 0 of every DP group
        self.run_dir = Path(cfg.run.run_dir or f"runs/{cfg.run.name}-{time.strftime('%Y%m%d-%H%M%S')}")
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.metrics = MetricsWriter(self.run_dir, self.rank)
        self.checkpointer = Checkpointer(self.run_dir / "checkpoints", self.rank, self.world, cfg.run.keep_checkpoints)
        self.timeline = Timeline(self.rank, self.run_dir / f"timeline_rank{self.rank}.jsonl")
        if self.rank == 0:
            (self.run_dir / "config.json").write_text(json.dumps(asdict(cfg), indent=1, default=str))

        self.policy_dir = resolve_model(cfg.policy.model, cfg.data.shards)
        self.trainer = VLMTrainer(self.policy_dir, cfg.policy.trainer)
        self.processor = AutoProcessor.from_pretrained(self.policy_dir)
        self.controller = self.eval_prompts = None
        # Every rank starts its engines, TP peers included (theirs stay idle): an in-process vLLM
        # engine creates its process groups with collectives over all ranks, so a rank that
        # skipped it would leave the others waiting forever.
        cfg.rollout.engine.model = self.policy_dir
        self.engine = RolloutEngine(cfg.rollout.engine)
        self.judges = [(wj.judge.name, _make_judge(wj.judge, cfg.data.shards), wj.weight) for wj in cfg.reward.judges]
        if self.leader:
            self._build_controller()

    def _build_controller(self) -> None:
        cfg = self.cfg
        rewarder = Rewarder(cfg.reward, self.judges)
        reader = DataReader(_rank_data(cfg.data, self.run_dir, self.dp_rank), self.dp_rank, self.dp_size)
        if cfg.run.controller == "single":
            source = SingleControllerSource(reader if self.dp_rank == 0 else None, self.dp_rank, self.dp_size)
        else:
            source = ParallelSource(reader)
        resources = {"rollout": [self.engine], "judge": [j.engine for _, j, _ in self.judges if hasattr(j, "engine")]}
        self.phases = PhaseRunner(PLANS[cfg.run.placement](), resources, self.timeline)
        builder = SampleBuilder(self.processor, self.engine.prompt_text)
        self.controller = Controller(source, self.engine, rewarder, DynamicSampler(cfg.dynamic_sampling),
                                     cfg.rollout.sampling, builder, cfg.algorithm, self.phases)
        if cfg.eval.every and cfg.eval.shards:
            eval_data = DataConfig(shards=cfg.eval.shards, shuffle=False, workers=cfg.data.workers,
                                   media=cfg.data.media, video_isolation=cfg.data.video_isolation)
            eval_reader = DataReader(eval_data, self.dp_rank, self.dp_size)
            self.eval_prompts = ParallelSource(eval_reader).take(cfg.eval.num_prompts)
            eval_reader.close()


def _rank_data(data: DataConfig, run_dir: Path, dp_rank: int) -> DataConfig:
    if data.quarantine_log is None:
        data.quarantine_log = str(run_dir / f"quarantine_rank{dp_rank}.jsonl")
    return data


def _make_judge(cfg, data_shards):
    from yatt_mm.reward.genrm import InProcessJudge, ServerJudge
    from yatt_mm.reward.judge_server import JudgeServer

    cfg.model = resolve_model(cfg.model, data_shards) if cfg.model else cfg.model
    if cfg.backend == "server":
        server = JudgeServer(cfg).start()
        judge = ServerJudge(cfg, server.base_url, server.model_name)
        judge.server = server
        return judge
    return InProcessJudge(cfg)


def rl_step(run: Run, step: int) -> dict[str, float]:
    cfg, trainer = run.cfg, run.trainer
    step_start = time.time()
    metrics: dict[str, float] = {}

    # 1-3. rollout, reward and dynamic sampling: each DP group on its own
    groups = None
    if run.leader:
        chosen, stats = run.controller.collect(step, cfg.rollout.prompts_per_step)
        with run.timeline.phase("prepare", step):
            groups = run.controller.train_samples(chosen)
        local = {"groups": stats.groups, "responses": stats.responses, "reward_sum": stats.reward_sum,
                 "reward_sq_sum": stats.reward_sq_sum, "response_tokens": stats.response_tokens,
                 "valid_generated": chosen.valid_generated, "padded": chosen.padded, "waves": chosen.waves,
                 "from_buffer": chosen.from_buffer, "gen_seconds": stats.seconds}
        local.update({f"reward:{k}": v for k, v in run.controller.rewarder.take_counts().items()})
        totals = sum_across(local, run.leaders)
        metrics.update(_rollout_metrics(totals))
        metrics.update(reward_metrics({k[len("reward:"):]: v for k, v in totals.items() if k.startswith("reward:")},
                                      [f.name for f in cfg.reward.functions], [name for name, _, _ in run.judges]))
        # 4. balance whole groups across DP groups by text tokens + vision patches
        if cfg.run.balance and run.dp_size > 1:
            with run.timeline.phase("balance", step):
                groups, bal = balance_groups(groups, cfg.run.patch_weight, run.leaders)
            metrics.update(bal)
    samples = broadcast_samples([s for g in (groups or []) for s in g], run.tp_src, run.tp_group)

    # 5. train: trainer logprobs of the batch (old policy), then one PPO-clip/GRPO update
    with run.timeline.phase("prepare", step):
        mbs = micro_batches(samples, cfg.run.micro_batch_tokens, trainer.spec, run.processor.tokenizer.pad_token_id)
    with run.timeline.phase("logprobs", step):
        old = trainer.logprobs(mbs, with_entropy=True)
    counts = _loss_counts(mbs, cfg.algorithm.loss_agg, trainer.dp_group)
    sums = {"diff": 0.0, "entropy": 0.0, "tokens": 0.0}
    for mb, (lp, ent) in zip(mbs, old):
        mb.extra["old_logprobs"] = lp
        fresh = mb.extra["fresh_mask"]  # vLLM sampled these with the weights the trainer has now
        sums["diff"] += float(((lp - mb.extra["rollout_logprobs"]).abs() * fresh).sum())
        sums["entropy"] += float((ent * fresh).sum())
        sums["tokens"] += float(fresh.sum())
    sums = sum_across(sums, trainer.dp_group)
    metrics["train/logprob_diff_vs_rollout"] = sums["diff"] / max(sums["tokens"], 1)
    metrics["train/entropy"] = sums["entropy"] / max(sums["tokens"], 1)

    def loss_fn(logprobs: torch.Tensor, mb: MicroBatch):
        out = policy_loss(cfg.algorithm, logprobs, mb.extra["old_logprobs"], mb.extra["advantages"],
                          mb.extra["loss_mask"], rollout_logprobs=mb.extra["rollout_logprobs"],
                          group_ids=mb.group_ids, normalizer=counts / trainer.dp_size)
        return out.loss, {"clip_fraction": out.clip_fraction / len(mbs), "is_weight": out.is_weight_mean / len(mbs)}

    with run.timeline.phase("train", step):
        metrics.update(trainer.train_step(mbs, loss_fn) if mbs else _empty_step(trainer))

    # 6. weight sync: Megatron weights -> HF names -> this group's engine, in place
    with run.timeline.phase("sync", step):
        weights = trainer.export_hf()
        if run.leader:
            info = run.engine.update_weights(weights.items())
            metrics["sync/seconds"], metrics["sync/bytes"] = info["seconds"], info["bytes"]

    if run.leader and run.eval_prompts is not None and cfg.eval.every and (step + 1) % cfg.eval.every == 0:
        metrics.update(evaluate(run, step))
    if run.leader and hasattr(run.controller.source, "drain_consumed"):
        with open(run.run_dir / f"consumed_rank{run.rank}.jsonl", "a") as f:
            for epoch, key in run.controller.source.drain_consumed():
                f.write(json.dumps({"step": step + 1, "epoch": epoch, "key": key}) + "\n")
    metrics.update(_phase_metrics(run, step, time.time() - step_start))
    return metrics


def _loss_counts(mbs, how: str, dp_group) -> float:
    """The step's global count that the loss is a mean over (tokens, responses or groups)."""
    if how == "token":
        n = sum(float(mb.extra["loss_mask"].sum()) for mb in mbs)
    elif how == "sequence":
        n = sum(float((mb.extra["loss_mask"].sum(1) > 0).sum()) for mb in mbs)
    else:
        n = len({g for mb in mbs for g, m in zip(mb.group_ids, mb.extra["loss_mask"].sum(1)) if m > 0})
    t = torch.tensor([n], dtype=torch.float64)
    dist.all_reduce(t, group=dp_group)
    return max(float(t), 1.0)


def _empty_step(trainer) -> dict[str, float]:
    raise RuntimeError("a DP rank ended a step with no training samples: rollout.prompts_per_step must be "
                       ">= 1 and the data must not run dry (see the quarantine log)")


def _rollout_metrics(t: dict[str, float]) -> dict[str, float]:
    counts = {"rollout/groups_generated": t["groups"], "rollout/padded_groups": t["padded"],
              "rollout/waves": t["waves"], "rollout/from_buffer": t["from_buffer"]}
    if not t["responses"]:  # the whole step came from dynamic sampling's buffer
        return counts
    n = t["responses"]
    mean = t["reward_sum"] / n
    return {
        **counts,
        "rollout/reward_mean": mean,
        "rollout/reward_std": math.sqrt(max(t["reward_sq_sum"] / n - mean * mean, 0.0)),
        "rollout/valid_group_rate": t["valid_generated"] / max(t["groups"], 1),
        "rollout/response_length": t["response_tokens"] / n,
        "rollout/tokens_per_s": t["response_tokens"] / max(t["gen_seconds"], 1e-9),
    }


def evaluate(run: Run, step: int) -> dict[str, float]:
    """Greedy answers to this group's held-out prompts, scored by a rule (unfiltered)."""
    from yatt_mm.reward.rules import get_rule

    rule = get_rule(run.cfg.eval.reward)
    score = 0.0
    if run.eval_prompts:
        with run.phases.phase("eval", step):
            result = run.engine.generate([p.request() for p in run.eval_prompts],
                                         SamplingConfig(n=1, max_tokens=run.cfg.eval.max_tokens, temperature=0.0))
        score = sum(rule(g[0].text, p.answer, p.metadata) for p, g in zip(run.eval_prompts, result.responses))
    t = sum_across({"s": score, "n": len(run.eval_prompts)}, run.leaders)
    return {"eval/reward_mean": t["s"] / max(t["n"], 1)}


TIMED_PHASES = ("rollout", "reward", "rollout_reward", "prepare", "balance", "logprobs", "train", "sync", "eval")


def _phase_metrics(run: Run, step: int, seconds: float) -> dict[str, float]:
    phases = run.timeline.seconds(step)
    busy = sum(v for k, v in phases.items() if not k.startswith("switch:"))
    # the same keys on every rank: a rank may skip a phase (all groups from the buffer, no eval)
    local = {f"time/{k}": phases.get(k, 0.0) for k in TIMED_PHASES}
    local["time/step"] = seconds
    local["time/idle"] = max(seconds - busy, 0.0)
    local["memory/rss_gb"] = psutil.Process().memory_info().rss / 2**30
    peak = sum_across(local, op=dist.ReduceOp.MAX)
    return {**peak, "time/idle_share": peak["time/idle"] / max(peak["time/step"], 1e-9)}


def progress_line(step: int, steps: int, m: dict[str, float]) -> str:
    if "rollout/reward_mean" in m:
        parts = [f"step {step + 1}/{steps}", f"reward {m['rollout/reward_mean']:.3f}",
                 f"valid {m['rollout/valid_group_rate']:.2f}"]
    else:
        parts = [f"step {step + 1}/{steps}", f"all {m['rollout/from_buffer']:.0f} groups from the buffer"]
    if "eval/reward_mean" in m:
        parts.append(f"eval {m['eval/reward_mean']:.3f}")
    parts += [f"{k.split('/')[1]} agrees with {k.split('/agreement_', 1)[1]} {v:.2f}" for k, v in m.items()
              if k.startswith("genrm/") and "/agreement_" in k]
    times = " ".join(f"{k[5:]} {v:.1f}" for k, v in m.items()
                     if k.startswith("time/") and k not in ("time/step", "time/idle_share", "time/idle") and v >= 0.05)
    parts += [f"{m['time/step']:.1f}s ({times})", f"lp-diff {m.get('train/logprob_diff_vs_rollout', 0):.1e}"]
    return " | ".join(parts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="yatt-mm rl")
    parser.add_argument("--config", required=True)
    parser.add_argument("--nproc", type=int, default=None, help="run as N local ranks under torchrun")
    parser.add_argument("overrides", nargs="*", help="key=value settings, e.g. run.steps=5")
    args = parser.parse_args(argv)
    try:
        cfg = config_utils.load(RLConfig, args.config, args.overrides)
        check_placement(cfg)
    except config_utils.ConfigError as e:
        print(f"yatt-mm rl: {e}", file=sys.stderr)
        return 2
    if args.nproc is not None and not under_torchrun():
        if args.nproc % cfg.policy.trainer.tensor_parallel:
            print(f"yatt-mm rl: --nproc {args.nproc} is not a multiple of policy.trainer.tensor_parallel="
                  f"{cfg.policy.trainer.tensor_parallel}", file=sys.stderr)
            return 2
        prebuild_models(cfg)
        return relaunch("yatt_mm.rl.train", args.nproc, ["--config", args.config, *args.overrides])
    run = Run(cfg)
    if run.rank == 0:
        print(f"yatt-mm rl: {run.world} rank(s), DP {run.dp_size} x TP {run.world // run.dp_size}, "
              f"run dir {run.run_dir}", flush=True)
        if run.leader:
            print(run.phases.plan.describe(), flush=True)
    start = resume(run) if cfg.run.resume else 0
    if start == 0 and run.leader and run.eval_prompts is not None and cfg.eval.every:
        run.metrics.log(0, {**evaluate(run, -1)})
    for step in range(start, cfg.run.steps):
        m = rl_step(run, step)
        if cfg.run.checkpoint_every and (step + 1) % cfg.run.checkpoint_every == 0:
            # after the weight sync, nothing is in flight: snapshot now, write during the next rollout
            m.update(run.checkpointer.save(step + 1, run.trainer, run.controller, run.dp_rank))
        run.metrics.log(step + 1, m)
        if run.rank == 0:
            print(progress_line(step, cfg.run.steps, m), flush=True)
    finish(run)
    return 0


def check_placement(cfg: RLConfig) -> None:
    if cfg.run.placement == "partial":
        local = [wj.judge.name for wj in cfg.reward.judges if wj.judge.backend != "server"]
        if not cfg.reward.judges or local:
            raise config_utils.ConfigError(
                "run.placement=partial runs the rollout beside GenRM judges served by vLLM servers: "
                + (f"set backend: server for judge(s) {', '.join(local)}" if local else "configure reward.judges"))


def resume(run: Run) -> int:
    """Continue from the newest complete checkpoint in the run directory: trainer weights and
    optimizer, the engine's weights, each controller's data position and sampler buffer. Log
    lines of steps after the checkpoint (a crashed run's last steps) are dropped, so the
    metrics and the data lineage read as one run. Returns the step to start from."""
    ckpt = latest_complete(run.run_dir / "checkpoints", run.world)
    if ckpt is None:
        return 0
    step = load_trainer(ckpt, run.trainer, run.rank, run.world)
    weights = run.trainer.export_hf()  # collective over TP
    if run.leader:
        run.engine.update_weights(weights.items())
        load_controller(ckpt, run.controller, run.dp_rank)
        _drop_lines_after(run.run_dir / f"consumed_rank{run.rank}.jsonl", step)
    if run.rank == 0:
        _drop_lines_after(run.run_dir / "metrics.jsonl", step)
        print(f"resumed from {ckpt} (step {step})", flush=True)
    dist.barrier()
    return step


def _drop_lines_after(path: Path, step: int) -> None:
    if path.is_file():
        kept = [ln for ln in path.read_text().splitlines(keepends=True) if json.loads(ln)["step"] <= step]
        path.write_text("".join(kept))  # the open append-mode writers go on at the new end


def finish(run: Run) -> None:
    from models.hf_io import save_hf_dir

    run.checkpointer.wait()
    if run.cfg.run.save_final:
        weights = run.trainer.export_hf()
        if run.rank == 0:
            out = save_hf_dir(weights, run.policy_dir, run.run_dir / "final")
            print(f"trained policy written to {out}", flush=True)
    run.metrics.close()
    for _, judge, _ in run.judges:
        if getattr(judge, "server", None):
            judge.server.stop()
    dist.barrier()
    if run.engine is not None:
        # vLLM's shutdown destroys the default process group: only after our last collective
        run.engine.shutdown()


if __name__ == "__main__":
    raise SystemExit(main())
