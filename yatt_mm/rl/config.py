"""The RL run's settings: one typed tree, read from YAML with key=value overrides. Each section
is the config of the component that uses it; this file holds the loop's own and the root."""

from __future__ import annotations

import time
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Literal

from dataio.index import check_shard_specs
from dataio.reader import DataConfig, check_metric_name
from models.family import family_of, read_spec
from models.lora import LoRAConfig
from models.lora import check_layout as check_lora_layout
from models.trainer import TrainerConfig
from yatt_mm.engines.engine import EngineConfig, SamplingConfig
from yatt_mm.metrics import MetricsConfig
from yatt_mm.reward.rewarder import RewardConfig
from yatt_mm.rl.algorithms import AlgorithmConfig
from yatt_mm.rl.dynamic_sampling import DynamicSamplingConfig
from yatt_mm.rl.split import SplitConfig


# The fewest tokens a rollout prompt can take: one question token, and one medium (the reader
# skips samples without media) of at least one token between its two vision markers
PROMPT_FLOOR = 4


@dataclass
class RunConfig:
    steps: int = 20  # RL steps
    seed: int = 0  # Megatron's RNG seed
    run_dir: str = ""  # metrics, timelines, checkpoints, the final policy; default: runs/NAME-TIME
    name: str = "rl"  # names the default run_dir
    controller: Literal["parallel", "single"] = "parallel"  # single: verl-like baseline, for benchmarks
    # partial: rollout beside server judges; disaggregated: each controller's rollout engine and
    # in-process judges in a worker process of their own, resident for the whole run
    # (rl/placement.py, engines/worker.py); what max_staleness > 0 runs on
    placement: Literal["full", "partial", "disaggregated"] = "full"
    # GPUs, placement disaggregated: CUDA_VISIBLE_DEVICES of each controller's engine worker, one entry
    # per controller of a node (DP group d takes entry d mod the count), e.g. ["6", "7"]; the trainer's
    # ranks use the others. Unused on CPU, where the OS shares the cores.
    rollout_devices: list[str] = field(default_factory=list)
    # 0: synchronous (each step samples with the weights it trains). k >= 1: each controller generates
    # step n+1's samples while step n trains (rl/rollout_ahead.py); a sample sampled more than k
    # policy versions before the weights that train it is dropped (rollout/stale_dropped), never trained
    max_staleness: int = 0
    # with max_staleness >= 1: the weights of step n reach the engine as soon as step n has trained,
    # also while step n+1's rollout generates; responses in flight go on with them, and count it
    # (rollout/partial_responses). Off: the rollout ends before the weights load
    partial_rollout: bool = False
    micro_batch_tokens: int = 4096  # per micro-batch: rows x longest row, or with packing the real tokens
    packing: bool = False  # samples concatenated into one row per micro-batch, attention per sample (models/packing.py)
    balance: bool = True  # move groups across DP ranks to even out their cost
    patch_weight: float = 1.0  # cost of a vision patch relative to a text token
    save_final: bool = True  # write the trained policy to RUN_DIR/final: an HF directory, with LoRA a PEFT adapter
    checkpoint_every: int = 0  # steps between asynchronous checkpoints (0: none); see rl/checkpoint.py
    keep_checkpoints: int = 2  # complete checkpoints kept on disk
    # torch_dist: the trainer's state (with LoRA the adapter's) as one Megatron-Core distributed
    # checkpoint, which any layout resumes directly (models/dist_ckpt.py); per_rank: each rank's own
    # file, another TP/PP/CP/EP size or optimizer setting converted once at resume
    checkpoint_format: Literal["torch_dist", "per_rank"] = "torch_dist"
    resume: bool = True  # continue from the newest complete checkpoint in run_dir, if there is one
    max_logprob_diff: float = 0.0  # stop when the trainer/vLLM logprob gap exceeds it (0: 0.1 where the trainer or the engine computes in bf16, else 1e-3)
    check_sync: bool = True  # after each weight sync, score vLLM's greedy answer to a probe prompt with the trainer

    RANGES = {"steps": ">= 1", "seed": ">= 0", "micro_batch_tokens": ">= 1", "patch_weight": ">= 0",
              "checkpoint_every": ">= 0", "keep_checkpoints": ">= 1", "max_logprob_diff": ">= 0",
              "max_staleness": ">= 0"}


@dataclass
class PolicyConfig:
    model: str = "tiny:policy"  # an HF Qwen2-VL directory, or tiny:KIND / warmstart:KIND (built by the launcher)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)  # Megatron trainer settings
    # LoRA (models/lora.py): with rank > 0 the base is frozen and low-rank adapters on the language
    # model's projections (and with vision_tower the tower's blocks) are trained; the KL's
    # reference is the base with the adapters off
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    # the vision tower and its merger frozen: no gradients, no optimizer state (with LoRA the whole base is)
    freeze_vision: bool = False


@dataclass
class RolloutConfig:
    prompts_per_step: int = 8  # valid groups per DP group per step
    engine: EngineConfig = field(default_factory=EngineConfig)  # the vLLM engine
    sampling: SamplingConfig = field(default_factory=SamplingConfig)  # responses per prompt, length, temperature

    RANGES = {"prompts_per_step": ">= 1"}


@dataclass
class SyncConfig:
    # the trainer's weights reach the engine in buckets of about this size, each gathered over TP,
    # renamed and loaded before the next is built: a sync holds one bucket beside the model
    bucket_mb: float = 512.0
    # with policy.lora: merged sends every weight, the adapted ones as W + alpha/r B A (the full
    # sync); adapter sends the adapter alone, gathered over TP and PP, which vLLM loads in place
    # as a PEFT adapter and samples with (models/lora.py, yatt_mm/engines/adapters.py)
    lora: Literal["merged", "adapter"] = "merged"

    RANGES = {"bucket_mb": "> 0"}


@dataclass
class ClusterConfig:
    """The cluster a recipe is written for. `yatt-mm plan --config RECIPE` plans on it (each of its
    flags overrides one figure); `yatt-mm rl` notes a launch of another shape. 0: not stated."""

    nodes: int = 0  # nodes; 0: not stated (yatt-mm plan: 1)
    gpus_per_node: int = 0  # GPUs (ranks) per node; 0: not stated (yatt-mm plan: 8)
    gpu_memory_gib: float = 0.0  # memory of one GPU, GiB; 0: not stated (yatt-mm plan: 80)
    host_memory_gib: float = 0.0  # host memory per node, GiB; 0: not stated (yatt-mm plan: host memory not checked)

    RANGES = {"nodes": ">= 0", "gpus_per_node": ">= 0", "gpu_memory_gib": ">= 0", "host_memory_gib": ">= 0"}

    def stated(self) -> dict[str, float]:
        """The figures the config states, by name (those not 0)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name)}


@dataclass
class EvalSet:
    """One named held-out benchmark (eval.sets); unset settings are eval's own."""

    name: str = ""  # its metric: eval/<name>/reward_mean
    shards: list[str] = field(default_factory=list)  # its held-out shards
    num_prompts: int | None = None  # per DP group; null: eval.num_prompts
    max_tokens: int | None = None  # longest answer; null: eval.max_tokens
    reward: str | None = None  # its rule reward; null: eval.reward
    samples: int | None = None  # answers per prompt; null: eval.samples
    temperature: float | None = None  # null: eval.temperature

    RANGES = {"num_prompts": ">= 1", "max_tokens": ">= 1", "samples": ">= 1", "temperature": ">= 0"}

    def validate(self) -> None:
        from yatt_mm.reward.rules import get_rule

        check_metric_name(self.name, "an eval set")
        if not self.shards:
            raise ValueError(f"eval set {self.name!r}: give its shards")
        if self.reward is not None:
            get_rule(self.reward)


@dataclass
class EvalConfig:
    every: int = 5  # steps; 0 disables
    shards: list[str] = field(default_factory=list)  # held-out data; empty: no eval (unless sets)
    num_prompts: int = 32  # per DP group
    max_tokens: int = 16  # longest answer
    reward: str = "exact_match"  # a rule reward, unfiltered
    # answers per prompt: above 1 (with temperature > 0) the reward is their mean (avg@k) and
    # pass_at_k the mean of each prompt's best answer (pass@k for a 0/1 rule)
    samples: int = 1
    temperature: float = 0.0  # 0: greedy
    seed: int = 0  # seeds sampled answers: a prompt draws the same at every eval, so curves move with the weights
    # several named held-out sets instead of shards, each with its own metric (eval/<name>/reward_mean)
    # and optionally its own num_prompts, max_tokens, reward, samples and temperature;
    # eval/reward_mean is over all of them
    sets: list[EvalSet] = field(default_factory=list)

    RANGES = {"every": ">= 0", "num_prompts": ">= 1", "max_tokens": ">= 1", "samples": ">= 1", "temperature": ">= 0",
              "seed": ">= 0"}

    def validate(self) -> None:
        from yatt_mm.reward.rules import get_rule

        get_rule(self.reward)
        if self.sets and self.shards:
            raise ValueError(f"eval.sets lists the held-out sets; eval.shards must then be empty, got {self.shards!r}")
        names = [s.name for s in self.sets]
        if len(set(names)) != len(names):
            raise ValueError(f"eval.sets: set names must differ, got {names}")
        for s in self.filled():
            if s.samples > 1 and s.temperature == 0:
                what = f"the temperature of eval set {s.name!r}" if s.name else "eval.temperature"
                raise ValueError(f"samples={s.samples} answers per prompt at temperature 0 are all the same greedy "
                                 f"answer: set {what} > 0 (e.g. 0.6), or samples: 1")

    def check_inputs(self) -> None:
        """The held-out sets' shards are there (FileNotFoundError naming the setting)."""
        if self.shards:
            check_shard_specs(self.shards, "eval.shards")
        for i, s in enumerate(self.sets):
            check_shard_specs(s.shards, f"eval.sets[{i}].shards")

    def active(self) -> list[EvalSet]:
        """The held-out sets with every setting filled in (eval.shards: one set named ""); none
        when eval is off."""
        return self.filled() if self.every else []

    def filled(self) -> list[EvalSet]:
        """The held-out sets with every setting filled in, whatever eval.every (yatt-mm eval)."""
        sets = self.sets or ([EvalSet(name="", shards=self.shards)] if self.shards else [])
        return [EvalSet(s.name, s.shards, s.num_prompts or self.num_prompts, s.max_tokens or self.max_tokens,
                        s.reward or self.reward, s.samples or self.samples,
                        self.temperature if s.temperature is None else s.temperature) for s in sets]


@dataclass
class RLConfig:
    run: RunConfig = field(default_factory=RunConfig)  # the loop: steps, placement, checkpoints
    data: DataConfig = field(default_factory=DataConfig)  # training shards and how each DP group reads them
    policy: PolicyConfig = field(default_factory=PolicyConfig)  # the model trained
    rollout: RolloutConfig = field(default_factory=RolloutConfig)  # generation on vLLM
    reward: RewardConfig = field(default_factory=RewardConfig)  # rule rewards and GenRM judges
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)  # advantages and the policy loss
    dynamic_sampling: DynamicSamplingConfig = field(default_factory=DynamicSamplingConfig)  # valid groups only
    sync: SyncConfig = field(default_factory=SyncConfig)  # trainer -> rollout engine weight sync
    eval: EvalConfig = field(default_factory=EvalConfig)  # held-out reward: greedy, or k sampled answers
    split: SplitConfig = field(default_factory=SplitConfig)  # how the phases' roles share a node's devices (rl/split.py)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)  # TensorBoard and Weights & Biases beside metrics.jsonl
    cluster: ClusterConfig = field(default_factory=ClusterConfig)  # the cluster the config is written for: what yatt-mm plan plans on

    def validate(self) -> None:
        if not self.algorithm.loss_norm_tokens:  # Dr. GRPO's constant: the longest response the rollout may give
            self.algorithm.loss_norm_tokens = self.rollout.sampling.max_tokens
        self._check_gpu_shares()
        self._check_rollout_parallel()
        self._check_staleness()
        self._check_context()
        self._check_batch()
        self._check_lora()
        if self.rollout.engine.tools.active and self.algorithm.overlong.soft_penalty.buffer:
            raise ValueError("algorithm.overlong.soft_penalty measures a response against rollout.sampling.max_tokens, "
                             "which multi-turn rollouts (rollout.engine.tools) apply per turn: set its buffer to 0 "
                             "(overlong.filter works: it masks responses cut off)")
        self._check_distill()
        if self.rollout.engine.media_tokens_in_responses:
            raise ValueError("rollout.engine.media_tokens_in_responses=true lets responses hold media placeholder "
                             "tokens, which the trainer cannot train on (its positions and vision features would "
                             "look for a medium behind each): set it to false")
        if self.run.placement == "partial":
            local = [wj.judge.name for wj in self.reward.judges if wj.judge.backend != "server"]
            distill = self.algorithm.distill
            if distill.active and distill.backend != "server":
                raise ValueError("run.placement=partial scores responses beside the rollout on vLLM servers: set "
                                 "algorithm.distill.backend=server")
            if not (self.reward.judges or distill.active) or local:
                raise ValueError(
                    "run.placement=partial runs the rollout beside GenRM judges served by vLLM servers: "
                    + (f"set backend: server for judge(s) {', '.join(local)}" if local else "configure reward.judges"))

    def _check_lora(self) -> None:
        from yatt_mm.engines.adapters import VLLM_MAX_LORA_RANKS

        lora = self.policy.lora
        if lora.vision_tower and not lora.rank:
            raise ValueError("policy.lora.vision_tower=true puts adapters on the vision tower, but policy.lora.rank is "
                             "0 (no LoRA): set policy.lora.rank")
        if lora.vision_tower and self.policy.freeze_vision:
            raise ValueError("policy.freeze_vision=true freezes the vision tower, and policy.lora.vision_tower=true "
                             "trains adapters on it: choose one")
        if self.sync.lora != "adapter":
            return
        rank = self.policy.lora.rank
        if not rank:
            raise ValueError("sync.lora=adapter sends the LoRA adapter alone, but policy.lora.rank is 0 (no adapter): "
                             "set policy.lora.rank, or sync.lora=merged")
        if rank > VLLM_MAX_LORA_RANKS[-1]:
            raise ValueError(f"sync.lora=adapter: vLLM serves adapters of rank <= {VLLM_MAX_LORA_RANKS[-1]}, "
                             f"policy.lora.rank is {rank}: lower it, or sync.lora=merged")

    def _check_distill(self) -> None:
        """On-policy distillation's settings that only the whole config can judge."""
        distill = self.algorithm.distill
        if not distill.active:
            return
        if any(wj.judge.name == distill.name for wj in self.reward.judges):
            raise ValueError(f"reward.judges: a judge named '{distill.name}' would share its metrics and its plan "
                             "lines with the distillation teacher (algorithm.distill): rename the judge")
        if self.rollout.engine.tools.active:
            raise ValueError("algorithm.distill: the teacher scores single-turn responses; multi-turn rollouts "
                             "(rollout.engine.tools) are not supported with it: set rollout.engine.tools.names=[] or "
                             "algorithm.distill.teacher=''")
        if self.run.max_staleness > 0:  # it ran, but its held-out reward fell: refused until that is understood
            raise ValueError("algorithm.distill with asynchronous RL (run.max_staleness > 0) is not supported yet: "
                             "set run.max_staleness=0 (docs/distillation.md)")
        ds = self.dynamic_sampling
        if not distill.with_reward and ds.enabled and ds.filter == "reward_spread":
            raise ValueError("algorithm.distill.with_reward=false trains on the teacher's signal alone, which every "
                             "group carries, but dynamic sampling would leave out (or mask) the groups whose rewards "
                             "are all equal: set dynamic_sampling.enabled=false")

    def _check_context(self) -> None:
        """A prompt and its response share the engine's context (rollout.engine.max_model_len),
        prompt first: a response limit must leave the prompt room. A prompt holds at least a
        question token and one medium (a sample without media is skipped) of at least one
        token between its two vision markers: PROMPT_FLOOR tokens, less than any real prompt
        takes, so no config that can run is refused. With data.max_sample_tokens the reader
        admits samples of up to that many tokens, response limit included (dataio/budget.py):
        the engine must hold such a sample, and the budget must leave a prompt room after the
        response limit, counted as the reader counts it (its chat-template allowance too)."""
        from dataio.budget import TEMPLATE_TOKENS

        context = self.rollout.engine.max_model_len
        limits = {"rollout.sampling.max_tokens": self.rollout.sampling.max_tokens}
        if self.eval.every:  # the held-out answers come from the same engine
            limits["eval.max_tokens"] = self.eval.max_tokens
            limits |= {f"eval.sets[{i}].max_tokens": s.max_tokens for i, s in enumerate(self.eval.sets) if s.max_tokens}
        for name, limit in limits.items():
            if limit > context - PROMPT_FLOOR:
                raise ValueError(f"{name}={limit} leaves a prompt no room in rollout.engine.max_model_len={context} "
                                 f"(prompt and response share it, and a prompt with its media takes at least "
                                 f"{PROMPT_FLOOR} tokens): set {name} <= {context - PROMPT_FLOOR}, or raise "
                                 "rollout.engine.max_model_len")
        budget, limit = self.data.max_sample_tokens, self.rollout.sampling.max_tokens
        if budget and budget > context:
            raise ValueError(f"data.max_sample_tokens={budget} admits samples (prompt, media and the response limit) "
                             f"that rollout.engine.max_model_len={context} cannot hold: set data.max_sample_tokens "
                             f"<= {context}, or raise max_model_len")
        if budget and limit + TEMPLATE_TOKENS + PROMPT_FLOOR > budget:
            raise ValueError(f"rollout.sampling.max_tokens={limit} leaves no prompt budget in data.max_sample_tokens="
                             f"{budget} (the budget counts the response limit, a {TEMPLATE_TOKENS}-token chat template "
                             "and the prompt with its media): every sample would be skipped as over_token_budget; set "
                             f"max_tokens <= {budget - TEMPLATE_TOKENS - PROMPT_FLOOR}, or raise "
                             "data.max_sample_tokens")

    def _check_batch(self) -> None:
        """Batch settings a step can meet: each DP group's step has rollout.prompts_per_step
        groups of rollout.sampling.n responses; the mini-batches split them, group by group."""
        groups, n = self.rollout.prompts_per_step, self.rollout.sampling.n
        if self.algorithm.mini_batches > groups:
            raise ValueError(f"algorithm.mini_batches={self.algorithm.mini_batches} splits each DP group's step into "
                             f"mini-batches of whole groups, but a step has rollout.prompts_per_step={groups} groups: "
                             f"the extra optimizer steps would have nothing to train on; set mini_batches <= {groups}, "
                             "or raise prompts_per_step")
        pure_distillation = self.algorithm.distill.active and not self.algorithm.distill.with_reward
        if n == 1 and self.algorithm.advantage != "reinforce_pp" and not pure_distillation:
            raise ValueError(f"rollout.sampling.n=1: algorithm.advantage={self.algorithm.advantage} measures a "
                             "response against the other responses to its prompt, and a group of one has none (its "
                             "advantage is always 0): set n >= 2, or algorithm.advantage=reinforce_pp")
        ds = self.dynamic_sampling
        if n == 1 and ds.enabled and ds.filter == "reward_spread":
            raise ValueError("rollout.sampling.n=1: dynamic sampling keeps groups whose rewards differ, which a group "
                             "of one response never does (every step would be padded with masked groups): set n >= 2, "
                             "or dynamic_sampling.enabled=false")
        if ds.enabled and ds.max_waves * ds.max_wave_groups < groups:
            raise ValueError(f"dynamic_sampling: max_waves={ds.max_waves} waves of at most max_wave_groups="
                             f"{ds.max_wave_groups} groups cannot fill a step of rollout.prompts_per_step={groups} "
                             f"groups: raise max_wave_groups to >= {-(-groups // ds.max_waves)} or max_waves")

    def _check_staleness(self) -> None:
        """Generating ahead runs the controller's rollout in a thread of its rank while the trainer
        trains (rl/rollout_ahead.py): it needs the rollout engine and judges resident in a worker
        of their own (one process: one engine rank) and a controller whose reads need no other rank."""
        k = self.run.max_staleness
        if self.run.placement == "disaggregated":
            self._check_engine_workers()
        if not k:
            if self.run.partial_rollout:
                raise ValueError("run.partial_rollout loads new weights into a rollout running ahead: it needs "
                                 "run.max_staleness >= 1 (now 0)")
            return
        if self.run.placement != "disaggregated":
            raise ValueError(f"run.max_staleness={k} generates the next step while this one trains, beside the "
                             f"trainer: set run.placement=disaggregated (now {self.run.placement})")
        if self.run.controller != "parallel":
            raise ValueError(f"run.max_staleness={k} needs run.controller=parallel: the single controller's reads "
                             "are collectives, which a rollout running beside training cannot join")

    def _check_engine_workers(self) -> None:
        """Each controller's engines in one worker process (engines/worker.py): one engine rank,
        and on GPUs GPUs of its own."""
        from models.runtime import has_gpu

        if self.rollout.engine.tensor_parallel_size > 1:
            raise ValueError(f"run.placement=disaggregated runs each controller's engine in one worker process: "
                             f"set rollout.engine.tensor_parallel_size=1 (now "
                             f"{self.rollout.engine.tensor_parallel_size})")
        if has_gpu() and not self.run.rollout_devices:
            raise ValueError("run.placement=disaggregated on GPUs: give each controller's engine worker GPUs of its "
                             "own with run.rollout_devices (one CUDA_VISIBLE_DEVICES entry per controller of a node)")

    def _check_gpu_shares(self, limit: float = 0.95) -> None:
        """On GPUs every vLLM engine takes its share of the GPU when it starts, and a rank's
        engines all start (the trainer already on the host) before any of them sleeps: the
        rollout engine, the in-process judges, and a judge server left on the rank's GPUs
        (no judge.devices) must fit together."""
        shares = {"rollout.engine": self.rollout.engine.gpu_memory_utilization}
        for wj in self.reward.judges:
            if wj.judge.backend == "inprocess" or (wj.judge.backend == "server" and not wj.judge.devices):
                shares[f"judge {wj.judge.name}"] = wj.judge.gpu_memory_utilization
        distill = self.algorithm.distill
        if distill.active and (distill.backend == "inprocess" or not distill.devices):
            shares["algorithm.distill (the teacher)"] = distill.gpu_memory_utilization
        if sum(shares.values()) > limit:
            raise ValueError(f"vLLM GPU memory shares on one GPU add up to {sum(shares.values()):.2f} > {limit} ("
                             + ", ".join(f"{k} {v}" for k, v in shares.items()) + "): lower a gpu_memory_utilization "
                             "or give server judges their own GPUs (judge.devices)")

    def _check_rollout_parallel(self) -> None:
        tp, trainer_tp = self.rollout.engine.tensor_parallel_size, self.policy.trainer.tensor_parallel
        if tp not in (1, trainer_tp):
            raise ValueError(f"rollout.engine.tensor_parallel_size={tp}: an engine spans 1 rank or the ranks of one "
                             f"DP group (policy.trainer.tensor_parallel={trainer_tp})")
        local = [wj.judge.name for wj in self.reward.judges if wj.judge.backend == "inprocess"]
        if self.algorithm.distill.active and self.algorithm.distill.backend == "inprocess":
            local.append("the distillation teacher (algorithm.distill)")
        if tp > 1 and local:
            raise ValueError(f"rollout.engine.tensor_parallel_size={tp}: vLLM holds one tensor-parallel layout per "
                             f"process, so in-process judges ({', '.join(local)}) cannot sit beside it; "
                             "set their backend: server")

    def check_world(self, world_size: int) -> None:
        self.policy.trainer.check_world(world_size, "policy.trainer")

    def check_inputs(self) -> None:
        """Before any rank starts: the training data and the held-out sets the run reads are
        there (FileNotFoundError naming the setting)."""
        self.data.check_inputs("data")
        if self.eval.every:
            self.eval.check_inputs()

    def check_model(self) -> None:
        """After resolve_models: the policy splits into the trainer's TP x PP layout, and media
        are sized for it (data.media.factor 0: the policy's patch x merge); routing replay has a
        mixture-of-experts policy."""
        from yatt_mm.engines.media import media_for_model

        self.policy.trainer.check_model(self.policy.model, "policy.trainer")
        check_lora_layout(self.policy.lora, family_of(read_spec(self.policy.model)), self.policy.trainer)
        if self.sync.lora == "adapter":
            from yatt_mm.engines.adapters import check_adapter_serving

            check_adapter_serving(self.policy.model)
        self.algorithm.check_model(bool(getattr(read_spec(self.policy.model), "num_experts", 0)), self.policy.model)
        self.data.media = media_for_model(self.data.media, self.policy.model, "data.media.factor")
        if self.algorithm.distill.active:
            from yatt_mm.reward.teacher import check_teacher

            check_teacher(self.algorithm.distill.teacher, self.policy.model)

    def resolve_models(self, resolve) -> None:
        """Replace model names (tiny:, warmstart:) by directories; `resolve(name, data_shards)`."""
        self.policy.model = resolve(self.policy.model, self.data.all_shards())
        for wj in self.reward.judges:
            if wj.judge.model:
                wj.judge.model = resolve(wj.judge.model, self.data.all_shards())
        if self.algorithm.distill.teacher:
            self.algorithm.distill.teacher = resolve(self.algorithm.distill.teacher, self.data.all_shards())

    def fix_run_dir(self) -> Path:
        self.run.run_dir = self.run.run_dir or f"runs/{self.run.name}-{time.strftime('%Y%m%d-%H%M%S')}"
        return Path(self.run.run_dir)
