"""All of a run's rewards in one place: rule functions and GenRM judges, combined by weight."""

from __future__ import annotations

from yatt_mm.reward.genrm import InProcessJudge, JudgeItem, ServerJudge
from yatt_mm.reward.rules import get_rule
from yatt_mm.rl.config import RewardConfig
from yatt_mm.rl.samples import Prompt
from yatt_mm.rollout.engine import Response


class Rewarder:
    def __init__(self, cfg: RewardConfig, judges: list[tuple[str, InProcessJudge | ServerJudge, float]]):
        self.rules = [(f.name, get_rule(f.name), f.weight) for f in cfg.functions]  # fails early on a bad name
        self.judges = judges
        if not self.rules and not self.judges:
            raise ValueError("reward: configure at least one function or judge")

    def score(self, prompts: list[Prompt], responses: list[list[Response]]) -> list[tuple[list[float], dict]]:
        """Per prompt: the total reward of each response, and each part by name."""
        parts: list[dict[str, list[float]]] = [{} for _ in prompts]
        for name, fn, _ in self.rules:
            for i, (p, group) in enumerate(zip(prompts, responses)):
                parts[i][name] = [fn(r.text, p.answer, p.metadata) for r in group]
        for name, judge, _ in self.judges:
            items = [JudgeItem(p.question, r.text, p.answer, p.images, p.videos)
                     for p, group in zip(prompts, responses) for r in group]
            scores = iter(judge.score(items)) if items else iter(())
            for i, group in enumerate(responses):
                parts[i][name] = [next(scores).score for _ in group]
        weights = {name: w for name, _, w in self.rules} | {name: w for name, _, w in self.judges}
        totals = [[sum(weights[k] * v[j] for k, v in part.items()) for j in range(len(group))]
                  for part, group in zip(parts, responses)]
        return list(zip(totals, parts))

    def metrics(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for name, judge, _ in self.judges:
            out.update(judge.stats.as_metrics(f"genrm/{name}"))
        return out
