"""Held-out evaluation: each eval set's prompts, the policy's answers scored by the set's rule, and
the metrics. The RL loop runs it every `eval.every` steps on each DP group's share (rl/step.py);
`yatt-mm eval` runs it once on a saved policy in one process (`evaluate_policy`), with the same
prompts, seeds and metric names, and keeps every answer.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import models  # noqa: F401 - CPU runtime hooks before anything imports torchvision or megatron (yatt-mm eval)
from dataio.reader import DataConfig, DataReader
from models.lora import read_adapter_dir
from yatt_mm.engines.engine import Response, SamplingConfig
from yatt_mm.reward.rules import RuleFn, get_rule
from yatt_mm.rl.config import EvalSet, RLConfig
from yatt_mm.rl.samples import Prompt
from yatt_mm.rl.sources import to_prompt


@dataclass
class HeldOut:
    """One eval set as a DP group holds it (every setting filled in: EvalConfig.filled)."""

    spec: EvalSet
    rule: RuleFn
    prompts: list[Prompt]

    @property
    def sampling(self) -> SamplingConfig:
        return SamplingConfig(n=self.spec.samples, max_tokens=self.spec.max_tokens, temperature=self.spec.temperature)


def read_held_out(spec: EvalSet, data: DataConfig, dp_rank: int = 0, dp_size: int = 1) -> HeldOut:
    """This DP group's prompts of one eval set: the first num_prompts of its share, in order, read
    with the run's decoding settings in one pass at most (a share smaller than num_prompts is read
    whole, each prompt once; an empty one gives none)."""
    cfg = DataConfig(shards=spec.shards, shuffle=False, workers=data.workers, media=data.media,
                     video_isolation=data.video_isolation)
    reader = DataReader(cfg, dp_rank, dp_size)
    prompts: list[Prompt] = []
    try:
        for sample in reader.iter_epoch():
            if (prompt := to_prompt(sample)) is not None:
                prompts.append(prompt)
            if len(prompts) == spec.num_prompts:
                break
    finally:
        reader.close()
    return HeldOut(spec, get_rule(spec.reward), prompts)


def answer(engine, held: HeldOut, seed: int = 0) -> list[list[tuple[Response, float]]]:
    """Each prompt's answers with their scores: greedy, or `samples` of them seeded by `seed` and
    the prompt alone (the same draw at every eval: the curve moves with the weights)."""
    if not held.prompts:  # a DP group whose share of the set is empty
        return []
    sampling = held.sampling
    seeded = sampling.temperature > 0
    requests = [p.request(p.sampling_seed(seed, "eval") if seeded else None) for p in held.prompts]
    result = engine.generate(requests, sampling)
    return [[(r, held.rule(r.text, p.answer, p.metadata)) for r in rs] for p, rs in zip(held.prompts, result.responses)]


def counts(held: HeldOut, answers: list[list[tuple[Response, float]]]) -> dict[str, float]:
    """Additive counts of one set (summed over DP groups before `metrics`): over its prompts, the
    sums of the mean and of the best answer's score, and the number of prompts."""
    name = held.spec.name
    scores = [[s for _, s in a] for a in answers]
    return {f"{name}/mean": float(sum(sum(s) / len(s) for s in scores)),
            f"{name}/best": float(sum(max(s) for s in scores)), f"{name}/n": float(len(scores))}


def metrics(evals: list[HeldOut], total: dict[str, float]) -> dict[str, float]:
    """eval/reward_mean over every set's prompts; a named set's eval/<name>/reward_mean; with
    samples k > 1, eval[/<name>]/pass_at_k (the mean of each prompt's best answer)."""
    out = {"eval/reward_mean": sum(total[f"{h.spec.name}/mean"] for h in evals)
                               / max(sum(total[f"{h.spec.name}/n"] for h in evals), 1)}
    for held in evals:
        name = held.spec.name
        prompts = max(total[f"{name}/n"], 1)
        prefix = f"eval/{name}/" if name else "eval/"
        if name:
            out[f"{prefix}reward_mean"] = total[f"{name}/mean"] / prompts
        if held.spec.samples > 1:
            out[f"{prefix}pass_at_{held.spec.samples}"] = total[f"{name}/best"] / prompts
    return out


def evaluate_policy(cfg: RLConfig, out_dir: Path, dp_size: int = 1) -> dict[str, float]:
    """`yatt-mm eval`: every eval set of `cfg` (eval.every ignored) answered by cfg.policy.model (an
    HF directory, or a PEFT adapter directory served on its base) on one in-process engine (rollout.engine's settings); each set's prompts are those `dp_size` DP
    groups of a run read (their shares, together). Writes OUT/eval.json (the metrics) and
    OUT/answers.jsonl (a line per prompt: its set, key, reference, answers and scores; with tools,
    each answer's whole conversation)."""
    from yatt_mm.engines.engine import RolloutEngine
    from yatt_mm.launch import route_logs

    out_dir.mkdir(parents=True, exist_ok=True)
    route_logs(out_dir, 0)
    evals = []
    for spec in cfg.eval.filled():
        shares = [read_held_out(spec, cfg.data, rank, dp_size) for rank in range(dp_size)]
        evals.append(HeldOut(spec, shares[0].rule, [p for share in shares for p in share.prompts]))
    adapter = read_adapter_dir(cfg.policy.model)  # a LoRA run's final: its base, with the adapter on top
    cfg.rollout.engine.model = adapter["base_model_name_or_path"] if adapter else cfg.policy.model
    cfg.rollout.engine.lora_rank = adapter["r"] if adapter else 0
    cfg.rollout.engine.lora_vision_tower = bool(adapter) and "visual" in str(adapter.get("target_modules", ""))
    engine = RolloutEngine(cfg.rollout.engine)
    if adapter:
        engine.adapter.serve(engine.llm, cfg.policy.model)
    total: dict[str, float] = {}
    with open(out_dir / "answers.jsonl", "w") as lines:
        for held in evals:
            start = time.time()
            answers = answer(engine, held, cfg.eval.seed)
            total |= counts(held, answers)
            for p, a in zip(held.prompts, answers):
                line = {"set": held.spec.name, "key": p.key, "origin": p.origin, "reference": p.answer,
                        "answers": [r.text for r, _ in a], "scores": [s for _, s in a]}
                if engine.tools:  # multi-turn: each answer's whole conversation, the tools' replies included
                    line["conversations"] = [engine.tokenizer.decode(r.token_ids) for r, _ in a]
                lines.write(json.dumps(line) + "\n")
            reward = metrics([held], total)["eval/reward_mean"]
            print(f"eval {held.spec.name or 'eval.shards'}: {len(held.prompts)} prompts x {held.spec.samples}, "
                  f"reward {reward:.3f} ({held.spec.reward}), {time.time() - start:.1f}s", file=sys.stderr, flush=True)
    out = metrics(evals, total)
    (out_dir / "eval.json").write_text(json.dumps({"model": cfg.policy.model, **out}, indent=1) + "\n")
    return out
