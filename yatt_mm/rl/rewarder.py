"""All of a run's rewards in one place: rule functions and GenRM judges, combined by weight."""

from __future__ import annotations

from collections import Counter

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
        self._counts: Counter[str] = Counter()  # additive, so DP groups can sum them

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
        self._count(parts)
        return list(zip(totals, parts))

    def _count(self, parts: list[dict[str, list[float]]]) -> None:
        """Each part's sum, and how often each judge's verdict (score >= 0.5) matches each rule's:
        a judge that drifts from the verifiable rewards shows up in the metrics."""
        for part in parts:
            for name, values in part.items():
                self._counts[f"{name}/sum"] += sum(values)
                self._counts[f"{name}/n"] += len(values)
            for judge, _, _ in self.judges:
                for rule, _, _ in self.rules:
                    self._counts[f"{judge}/agree_{rule}"] += sum(
                        (j >= 0.5) == (r >= 0.5) for j, r in zip(part[judge], part[rule]))

    def take_counts(self) -> dict[str, float]:
        """This step's additive counts (then reset) and the judges' running counts of scored and
        fallback items; the same keys on every DP group, so they can be summed across groups."""
        names = [n for n, _, _ in self.rules + self.judges]
        keys = [f"{n}/{s}" for n in names for s in ("sum", "n")]
        keys += [f"{j}/agree_{r}" for j, _, _ in self.judges for r, _, _ in self.rules]
        out = {k: float(self._counts[k]) for k in keys}
        self._counts.clear()
        for name, judge, _ in self.judges:
            out[f"genrm/{name}/scored"] = float(judge.stats.scored)
            out[f"genrm/{name}/fallback"] = float(sum(judge.stats.fallbacks.values()))
        return out


def reward_metrics(counts: dict[str, float], rule_names: list[str], judge_names: list[str]) -> dict[str, float]:
    """Summed counts -> per-part reward means and judge/rule agreement rates."""
    out = {k: v for k, v in counts.items() if k.startswith("genrm/")}
    for name in rule_names + judge_names:
        n = counts.get(f"{name}/n", 0.0)
        if n:
            out[f"reward/{name}"] = counts[f"{name}/sum"] / n
    for judge in judge_names:
        n = counts.get(f"{judge}/n", 0.0)
        for rule in rule_names:
            if n:
                out[f"genrm/{judge}/agreement_{rule}"] = counts[f"{judge}/agree_{rule}"] / n
    return out
