"""The RL run's settings: one typed tree, read from YAML with key=value overrides."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from dataio.reader import DataConfig
from models.trainer import TrainerConfig
from yatt_mm.algorithms import AlgorithmConfig
from yatt_mm.dynamic_sampling import DynamicSamplingConfig
from yatt_mm.reward.genrm import JudgeConfig
from yatt_mm.rollout.engine import EngineConfig, SamplingConfig


@dataclass
class RunConfig:
    steps: int = 20
    seed: int = 0
    run_dir: str = ""  # default: runs/NAME-TIME
    name: str = "rl"
    controller: Literal["parallel", "single"] = "parallel"  # single: verl-like baseline, for benchmarks
    placement: Literal["full", "partial"] = "full"  # partial: rollout beside server judges (rl/placement.py)
    micro_batch_tokens: int = 4096  # rows x longest row per micro-batch
    balance: bool = True  # move groups across DP ranks to even out their cost
    patch_weight: float = 1.0  # cost of a vision patch relative to a text token
    save_final: bool = True  # write the trained policy as an HF directory at the end
    checkpoint_every: int = 0  # steps between asynchronous checkpoints (0: none); see rl/checkpoint.py
    keep_checkpoints: int = 2  # complete checkpoints kept on disk
    resume: bool = True  # continue from the newest complete checkpoint in run_dir, if there is one


@dataclass
class PolicyConfig:
    model: str = "tiny:policy"  # an HF Qwen2-VL directory, or tiny:policy / tiny:judge
    trainer: TrainerConfig = field(default_factory=TrainerConfig)


@dataclass
class RolloutConfig:
    prompts_per_step: int = 8  # valid groups per DP group per step
    engine: EngineConfig = field(default_factory=EngineConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)


@dataclass
class RewardFunction:
    name: str = "exact_match"
    weight: float = 1.0


@dataclass
class WeightedJudge:
    judge: JudgeConfig = field(default_factory=JudgeConfig)
    weight: float = 1.0


@dataclass
class RewardConfig:
    functions: list[RewardFunction] = field(default_factory=lambda: [RewardFunction()])
    judges: list[WeightedJudge] = field(default_factory=list)


@dataclass
class EvalConfig:
    every: int = 5  # steps; 0 disables
    shards: list[str] = field(default_factory=list)  # held-out data; empty: no eval
    num_prompts: int = 32  # per DP group
    max_tokens: int = 16
    reward: str = "exact_match"  # a rule reward, unfiltered and greedy


@dataclass
class RLConfig:
    run: RunConfig = field(default_factory=RunConfig)
    data: DataConfig = field(default_factory=DataConfig)
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    dynamic_sampling: DynamicSamplingConfig = field(default_factory=DynamicSamplingConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)


def resolve_model(name: str, data_shards: list[str] | None = None) -> str:
    """`tiny:KIND` builds (or reuses) the offline tiny model; `warmstart:KIND` the tiny model
    after its short, cached SFT on the run's first data directory (yatt_mm/warmstart.py);
    anything else is an HF directory."""
    from pathlib import Path

    if name.startswith("tiny:"):
        from models.tiny import tiny_model_dir

        return str(tiny_model_dir(name.split(":", 1)[1]))
    if name.startswith("warmstart:"):
        from yatt_mm.warmstart import warm_start

        if not data_shards:
            raise ValueError(f"{name}: a warm start trains on the run's data, but data.shards is empty")
        return str(warm_start(name.split(":", 1)[1], data_shards[0]))
    if not (Path(name) / "config.json").is_file():
        raise FileNotFoundError(f"policy.model: {name} is not an HF model directory (no config.json); "
                                "use tiny:policy for the built-in tiny model")
    return name


def prebuild_models(cfg: RLConfig) -> dict[str, str]:
    """Build (or find) every `tiny:`/`warmstart:` model the config names (policy and judges),
    once, in this process: call it before starting the ranks, so that they only read a finished
    cache instead of building the same model at once. Returns name -> directory."""
    names = [cfg.policy.model] + [wj.judge.model for wj in cfg.reward.judges]
    return {n: resolve_model(n, cfg.data.shards) for n in dict.fromkeys(names) if n.startswith(("tiny:", "warmstart:"))}
