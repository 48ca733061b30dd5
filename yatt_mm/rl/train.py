"""`yatt-mm rl`: the RL loop. One process per rank (torchrun); a DP group's model replica spans
TP x CP x PP ranks, and its first rank (TP, CP rank 0 of the first stage) is that group's
controller: it reads its own data, rolls out on its own vLLM engine, scores, and builds training
samples. Its peers, whichever parallelism made them, only receive the samples. Then all ranks
balance, train, and sync weights (rl/step.py).

    yatt-mm rl --config configs/tiny_demo.yaml --nproc 2 [key=value ...]
"""

from __future__ import annotations

import os
import sys
import uuid

import models  # noqa: F401 - CPU runtime hooks before anything imports torchvision or megatron
import torch
import torch.distributed as dist

from dataio.blend import BlendedReader, open_reader
from dataio.reader import DataConfig, DataReader
from models.hf_io import check_hf_dir, save_hf_dir
from models.lora import save_adapter_dir
from models.comm import comm, init_parallel
from models.trainer import BaseWithoutAdapter, ReferencePolicy, VLMTrainer
from yatt_mm.config import save
from yatt_mm.engines.engine import RolloutEngine
from yatt_mm.engines.worker import EngineWorker
from yatt_mm.launch import route_logs, run_command
from yatt_mm.metrics import MetricsWriter, Timeline
from yatt_mm.plot import plot_run
from yatt_mm.reward.genrm import InProcessJudge
from yatt_mm.reward.judges import build_judges
from yatt_mm.reward.rewarder import Rewarder
from yatt_mm.reward.teacher import InProcessTeacher, build_teacher
from yatt_mm.rl.actor import Actor
from yatt_mm.rl.checkpoint import Checkpointer, NoUsableCheckpoint
from yatt_mm.rl.layout import Layout
from yatt_mm.rl.config import RLConfig
from yatt_mm.rl.evaluation import read_held_out
from yatt_mm.rl.controller import Controller
from yatt_mm.rl.dynamic_sampling import DynamicSampler
from yatt_mm.rl.placement import PLANS, RESIDENT_ROLES, PhaseRunner
from yatt_mm.rl.rollouts import rollout_for
from yatt_mm.rl.samples import SampleBuilder
from yatt_mm.rl.split_runner import SplitRunner
from yatt_mm.rl.sources import ParallelSource, SingleControllerSource
from yatt_mm.rl.stats import progress_line
from yatt_mm.rl.step import evaluate, rl_step, serves_rollout, sync_weights


class Run:
    """Everything one rank holds for the run."""

    def __init__(self, cfg: RLConfig):
        from transformers import AutoProcessor

        self.cfg = cfg
        trainer_cfg = cfg.policy.trainer
        self.ranks = ranks = init_parallel(trainer_cfg.tensor_parallel, cfg.run.seed, trainer_cfg.pipeline_parallel,
                                           trainer_cfg.expert_parallel, trainer_cfg.context_parallel)
        self.run_dir = cfg.fix_run_dir()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if ranks.rank == 0:
            save(cfg, self.run_dir / "config.yaml")
        self.metrics = MetricsWriter(self.run_dir, ranks.rank, cfg.metrics.tensorboard, cfg.metrics.wandb, cfg, plot_run)
        self.timeline = Timeline(ranks.rank, self.run_dir / f"timeline_rank{ranks.rank}.jsonl")
        self.checkpointer = Checkpointer(self.run_dir / "checkpoints", ranks.rank, ranks.world,
                                         cfg.run.keep_checkpoints, attempt_id(), Layout(
                                             ranks.tp_size, ranks.cp_size, ranks.pp_size, ranks.ep_size,
                                             ranks.dp_size, trainer_cfg.distributed_optimizer),
                                         fmt=cfg.run.checkpoint_format)
        self.policy_dir = str(check_hf_dir(cfg.policy.model))
        self.trainer = VLMTrainer(self.policy_dir, cfg.policy.trainer, cfg.policy.lora, cfg.policy.freeze_vision)
        processor = AutoProcessor.from_pretrained(self.policy_dir)
        reference = None
        if cfg.algorithm.kl_coef > 0:  # LoRA: the base is the trainer's own model, adapters off
            reference = BaseWithoutAdapter(self.trainer) if self.trainer.lora is not None else \
                ReferencePolicy(self.policy_dir, cfg.policy.trainer)
        self.actor = Actor(self.trainer, cfg.algorithm, cfg.run.micro_batch_tokens, processor.tokenizer.pad_token_id,
                           cfg.run.max_logprob_diff, reference, cfg.run.packing)
        # Every rank starts its engines, TP peers, CP peers and later pipeline stages included:
        # vLLM inside torchrun ranks creates its process groups with collectives over all ranks.
        # With rollout.engine.tensor_parallel_size equal to the trainer's TP, one engine spans the
        # TP ranks of the controller's (CP rank 0, first stage: `serves_rollout`), its controller
        # leads, the peers replay; at 1, each rank has its own and only the controller's
        # generates. The trainer goes to the host first (on GPUs), so vLLM finds the memory share
        # it asks for.
        self.trainer.release()
        cfg.rollout.engine.model = self.policy_dir
        cfg.rollout.engine.lora_rank = cfg.policy.lora.rank if cfg.sync.lora == "adapter" else 0
        cfg.rollout.engine.lora_vision_tower = cfg.policy.lora.vision_tower and cfg.sync.lora == "adapter"
        cfg.rollout.engine.seed += ranks.dp_rank  # one sampling stream per DP group, shared by its TP ranks
        self.worker = None
        distill = cfg.algorithm.distill
        if cfg.run.placement == "disaggregated":
            self.engine, self.judges, self.teacher = self._engines_in_worker()
        else:
            self.engine = RolloutEngine(cfg.rollout.engine)
            if serves_rollout(ranks):  # the other engines (later stages, CP peers) never generate: nobody leads them
                self.engine.join(ranks.tp_cpu, ranks.leader_rank)
            self.judges = build_judges(cfg.reward.judges, ranks)
            self.teacher = build_teacher(distill, self.teacher_context(), ranks)
        self.rule_names = [f.name for f in cfg.reward.functions]
        resident = RESIDENT_ROLES.get(cfg.run.placement, ())  # never released: not the runner's to move
        roles = {"rollout": [self.engine], "judge": self.judges.engines(), "train": [self.trainer],
                 "teacher": [self.teacher.engine] if isinstance(self.teacher, InProcessTeacher) else []}
        self.phases = PhaseRunner(PLANS[cfg.run.placement](distill.active),
                                  {k: v for k, v in roles.items() if k not in resident}, self.timeline,
                                  released=("train",))
        self.phases.split = SplitRunner(cfg.split, cfg.run.placement, self.judges, self.timeline, self.teacher)
        self.controller, self.evals = None, []
        if ranks.leader:
            self.controller = self._controller(SampleBuilder(processor, self.engine.prompt_text, self.engine.processor_media))
            self.evals = [read_held_out(s, cfg.data, ranks.dp_rank, ranks.dp_size) for s in cfg.eval.active()]
            firsts = [h.prompts[0] for h in self.evals if h.prompts]
            self.controller.probe_prompt = firsts[0] if firsts else None

    def teacher_context(self) -> int:
        """The teacher's context: one token over the rollout engine's, as it generates one token
        after the longest prompt + response the rollout can give."""
        return self.cfg.rollout.engine.max_model_len + 1

    def _engines_in_worker(self):
        """The disaggregated placement: the controller's rollout engine, in-process judges and
        in-process teacher in a worker process of its own (yatt_mm/engines/worker.py); its peers
        hold no engine."""
        cfg, ranks = self.cfg, self.ranks
        distill = cfg.algorithm.distill
        if ranks.leader:
            devices = cfg.run.rollout_devices
            engines = {"rollout": cfg.rollout.engine} | {
                f"judge:{w.judge.name}": InProcessJudge.engine_config(w.judge)
                for w in cfg.reward.judges if w.judge.backend == "inprocess"}
            if distill.active and distill.backend == "inprocess":
                engines["teacher"] = InProcessTeacher.engine_config(distill, self.teacher_context())
            self.worker = EngineWorker(engines, self.run_dir / "logs" / f"engine_worker_rank{ranks.rank}.log",
                                       devices[ranks.dp_rank % len(devices)] if devices else "")
            self.worker.partial_rollout = cfg.run.partial_rollout
        engine = self.worker.engine("rollout") if self.worker else None
        judges = build_judges(cfg.reward.judges, ranks, engine_of=lambda j: self.worker.engine(f"judge:{j.name}"))
        teacher = build_teacher(distill, self.teacher_context(), ranks, engine_of=lambda _: self.worker.engine("teacher"))
        return engine, judges, teacher

    def _reader(self, data: DataConfig, dp_rank: int, dp_size: int) -> DataReader | BlendedReader:
        if data.quarantine_log is None:
            data.quarantine_log = str(self.run_dir / f"quarantine_rank{self.ranks.dp_rank}.jsonl")
        return open_reader(data, dp_rank, dp_size, budget=self._budget(data))

    def _budget(self, data: DataConfig):
        """How data.max_sample_tokens counts a sample: the policy's media sizes and the response
        limit (rollout.sampling.max_tokens) kept free; None when off."""
        if not data.max_sample_tokens:
            return None
        from dataio.budget import TokenBudget
        from models.family import family_of

        spec = self.trainer.spec
        return TokenBudget(data.max_sample_tokens, response_tokens=self.cfg.rollout.sampling.max_tokens,
                           factor=family_of(spec).media_factor(spec), temporal_patch_size=spec.temporal_patch_size)

    def _controller(self, builder: SampleBuilder) -> Controller:
        cfg, ranks = self.cfg, self.ranks
        if cfg.run.controller == "single":  # rank 0 reads the whole dataset for every group
            reader = self._reader(cfg.data, 0, 1) if ranks.dp_rank == 0 else None
            source = SingleControllerSource(reader, ranks.dp_rank, ranks.dp_size, ranks.leaders_cpu,
                                            [s.name for s in cfg.data.blend])
        else:
            source = ParallelSource(self._reader(cfg.data, ranks.dp_rank, ranks.dp_size))
        tokenizer = builder.processor.tokenizer  # the token ids the rollout engine generated from, for the teacher
        rewarder = Rewarder(cfg.reward, self.judges, cfg.rollout.sampling.seed, self.teacher,
                            lambda request: tokenizer.encode(self.engine.prompt_text(request), add_special_tokens=False))
        return Controller(source, self.engine, rewarder, DynamicSampler(cfg.dynamic_sampling), cfg.rollout.sampling,
                          builder, cfg.algorithm, self.phases, cfg.run.max_staleness)


def attempt_id() -> str:
    """One id per launch of the run, the same on every rank: checkpoint markers carry it."""
    ident = torch.zeros(16, dtype=torch.uint8)
    if dist.get_rank() == 0:
        ident[:] = torch.frombuffer(bytearray(uuid.uuid4().bytes), dtype=torch.uint8)
    dist.broadcast(ident, src=0, group=comm().world_cpu)
    return bytes(ident.tolist()).hex()


def train(cfg: RLConfig) -> int:
    route_logs(cfg.fix_run_dir(), int(os.environ.get("RANK", 0)))
    run = Run(cfg)
    if run.ranks.rank == 0:
        print(f"yatt-mm rl: {run.ranks.world} rank(s), DP {run.ranks.dp_size} x TP {run.ranks.tp_size} x PP "
              f"{run.ranks.pp_size} x CP {run.ranks.cp_size}"
              + (f", EP {run.ranks.ep_size}" if run.ranks.ep_size > 1 else "") + ", rollout engines of "
              f"{cfg.rollout.engine.tensor_parallel_size} rank(s), run dir {run.run_dir}\n"
              f"{run.phases.plan.describe()}", flush=True)
    try:
        start = resume(run) if cfg.run.resume else 0
    except NoUsableCheckpoint as e:  # every rank agreed on it: all stop, with one line instead of a traceback
        if run.ranks.rank == 0:
            print(f"yatt-mm rl: {e}", file=sys.stderr, flush=True)
        shut_down(run)
        return 2
    if start == 0 and (m := evaluate(run, -1)):
        run.metrics.log(0, m)
    rollout = rollout_for(run)  # generated in the step, or a step ahead (run.max_staleness)
    for step in range(start, cfg.run.steps):
        m = rl_step(run, step, rollout)
        run.metrics.log(step + 1, m)
        if run.ranks.rank == 0:
            print(progress_line(step, cfg.run.steps, m), flush=True)
    finish(run)
    return 0


def resume(run: Run) -> int:
    # rank 0 trims every log, the lineage of DP groups this run may no longer have too
    logs = [run.run_dir / "metrics.jsonl", *sorted(run.run_dir.glob("consumed_rank*.jsonl"))] \
        if run.ranks.rank == 0 else []
    # with policy.trainer.offload the trainer waits on the host from the start: a checkpoint loads into
    # its own storage, so it comes back for the load and goes again before the sync's phase takes it
    released = run.trainer.offloaded
    run.trainer.acquire()

    def sync() -> None:
        if released:
            run.trainer.release()
        sync_weights(run, -1)

    step = run.checkpointer.resume(run.trainer, run.controller, run.ranks.dp_rank, sync, logs, group=run.ranks.world_cpu)
    if released and not run.trainer.offloaded:  # no checkpoint: nothing was loaded, nothing synced
        run.trainer.release()
    if run.controller is not None:
        run.controller.policy_version = step  # the engine now holds the weights of `step` steps
    dist.barrier(group=run.ranks.world_cpu)
    return step


def finish(run: Run) -> None:
    run.checkpointer.wait()
    if run.cfg.run.save_final:
        run.trainer.acquire("weights")  # back from the host if the last phase released it
        if run.trainer.lora is not None:  # a PEFT adapter directory of the base (peft and vLLM load it)
            adapter = run.trainer.export_adapter()  # collective over TP and PP
            if run.ranks.rank == 0:
                out = save_adapter_dir(adapter, run.trainer.adapter_config(), run.run_dir / "final")
                print(f"trained LoRA adapter written to {out} (base: {run.policy_dir})", flush=True)
        else:
            weights = run.trainer.export_hf()  # collective over TP
            if run.ranks.rank == 0:
                print(f"trained policy written to {save_hf_dir(weights, run.policy_dir, run.run_dir / 'final')}",
                      flush=True)
    shut_down(run)


def shut_down(run: Run) -> None:
    """Close the metrics, the judges and the engines: at the end, or when the run cannot start."""
    run.metrics.close()
    run.judges.close()
    if run.teacher is not None and hasattr(run.teacher, "close"):
        run.teacher.close()
    dist.barrier(group=run.ranks.world_cpu)
    if run.worker is not None:
        run.worker.close()
    elif run.engine is not None:  # vLLM's shutdown destroys the default process group: only after our last collective
        run.engine.shutdown()


def main(argv: list[str] | None = None) -> int:
    return run_command("yatt-mm rl", RLConfig, "yatt_mm.rl.train", train, argv)


if __name__ == "__main__":
    sys.exit(main())
