"""Building a run's GenRM judges from config, and stopping them at the end.

How a judge runs is a plug-in chosen by `judge.backend`: `inprocess` (a vLLM engine in the
controller's process) and `server` (a vLLM OpenAI-compatible server process, which partial
colocation needs) are built in; `module:function` names anyone's own factory
`(JudgeConfig) -> judge`, where a judge has `score(items) -> list[JudgeScore]`, `stats`, and
optionally `engine` (memory the placement releases between phases) and `close()`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from yatt_mm.registry import Registry
from yatt_mm.reward.genrm import InProcessJudge, JudgeConfig, ServerJudge

JUDGES: Registry = Registry("judge backend")


@JUDGES.register("inprocess")
def in_process_judge(cfg: JudgeConfig) -> InProcessJudge:
    return InProcessJudge(cfg)


@JUDGES.register("server")
def served_judge(cfg: JudgeConfig) -> ServerJudge:
    from yatt_mm.engines.server import JudgeServer

    server = JudgeServer(cfg).start()
    return ServerJudge(cfg, server.base_url, server.model_name, server=server)


@dataclass
class WeightedJudge:
    judge: JudgeConfig = field(default_factory=JudgeConfig)  # the judge's model, prompt, votes and backend
    weight: float = 1.0  # its share of the total reward


@dataclass
class Judges:
    """A run's judges as (name, judge, weight), built once per rank."""

    entries: list[tuple[str, object, float]] = field(default_factory=list)

    @property
    def names(self) -> list[str]:
        return [name for name, _, _ in self.entries]

    def engines(self) -> list:
        """In-process engines: what the placement releases and acquires as the 'judge' role."""
        return [j.engine for _, j, _ in self.entries if getattr(j, "engine", None) is not None]

    def close(self) -> None:
        for _, judge, _ in self.entries:
            if hasattr(judge, "close"):
                judge.close()


def build_judges(weighted: list[WeightedJudge]) -> Judges:
    return Judges([(w.judge.name, JUDGES.get(w.judge.backend)(w.judge), w.weight) for w in weighted])
