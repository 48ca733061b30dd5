"""All of a run's rewards in one place: rule functions and GenRM judges, combined by weight."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from collections import Counter

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from yatt_mm.engines.engine import Response
from yatt_mm.reward.genrm import JudgeItem, ServerJudge
from yatt_mm.reward.judges import Judges, WeightedJudge
from yatt_mm.reward.rules import Malformed, get_rule
from yatt_mm.reward.teacher import NAME, ServerTeacher, TeacherItem

if TYPE_CHECKING:
    from yatt_mm.rl.samples import Prompt


@dataclass
class RewardFunction:
    name: str = "exact_match"  # a registered rule (yatt_mm/reward/rules.py) or module:function
    weight: float = 1.0  # its share of the total reward (>= 0: every reward scores better answers higher)

    # the total is the weighted sum of rewards that all score a better answer higher (rules 0 or
    # 1, judges' verdicts): a negative weight would train towards what the reward calls wrong
    RANGES = {"weight": ">= 0"}

    def validate(self) -> None:
        get_rule(self.name)


@dataclass
class RewardConfig:
    functions: list[RewardFunction] = field(default_factory=lambda: [RewardFunction()])  # rule rewards
    judges: list[WeightedJudge] = field(default_factory=list)  # GenRM judges

    def validate(self) -> None:
        if not self.functions and not self.judges:
            raise ValueError("configure at least one of functions and judges")
        if all(part.weight == 0 for part in [*self.functions, *self.judges]):
            raise ValueError("every reward weight is 0, so every response's reward is 0 and no group ever trains: "
                             "give a function or a judge a weight > 0")


class Rewarder:
    def __init__(self, cfg: RewardConfig, judges: Judges, seed: int | None = None, teacher=None, prompt_ids=None):
        """`seed`: the run's sampling seed (rollout.sampling.seed); judges then sample their votes
        on each response from a seed of its own (`item`). `teacher`: on-policy distillation's
        (yatt_mm/reward/teacher.py), which scores each response's tokens beside the judges;
        `prompt_ids(request)`: the token ids the rollout engine generated from for a request."""
        self.seed = seed
        self.teacher = teacher
        self.prompt_ids = prompt_ids
        self.rules = [(f.name, get_rule(f.name), f.weight) for f in cfg.functions]  # fails early on a bad name
        self.judges = judges.entries
        if not self.rules and not self.judges:
            raise ValueError("reward: configure at least one function or judge")
        self._counts: Counter[str] = Counter()  # additive, so DP groups can sum them

    def score(self, prompts: list[Prompt], responses: list[list[Response]]) -> list[tuple[list[float], dict]]:
        """Per prompt: the total reward of each response, and each part by name."""
        judged = {}
        for name, judge, _ in self.judges:
            items = [self.item(p, j, r) for p, group in zip(prompts, responses) for j, r in enumerate(group)]
            scores = iter(judge.score(items)) if items else iter(())
            judged[name] = [[next(scores).score for _ in group] for group in responses]
        return self._combine(prompts, responses, judged)

    def teach(self, prompts: list[Prompt], responses: list[list[Response]]) -> None:
        """The teacher's logprobs of every response's tokens, into `response.teacher_logprobs`
        (None where it could not score one: counted in its stats)."""
        items = [self.teacher_item(ids, p, r) for p, group in zip(prompts, responses)
                 for ids in [self.prompt_ids(p.request())] for r in group]
        scores = iter(self.teacher.score(items) if items else ())
        for group in responses:
            for r in group:
                r.teacher_logprobs = next(scores).logprobs

    def teacher_item(self, prompt_ids: list[int], p: Prompt, r: Response) -> TeacherItem:
        return TeacherItem(list(prompt_ids), list(r.token_ids), p.images, p.videos)

    def stream(self, prompts: list[Prompt]) -> "RewardStream":
        """Scoring that starts while the rollout still runs: hand each prompt's responses to
        `add` as they finish (partial colocation)."""
        return RewardStream(self, prompts)

    def _combine(self, prompts, responses, judged: dict[str, list[list[float]]]) -> list[tuple[list[float], dict]]:
        parts: list[dict[str, list[float]]] = [{} for _ in prompts]
        for name, fn, _ in self.rules:
            for i, (p, group) in enumerate(zip(prompts, responses)):
                parts[i][name] = [fn(r.text, p.answer, p.metadata) for r in group]
        for name, scores in judged.items():
            for i, group_scores in enumerate(scores):
                parts[i][name] = group_scores
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
                self._counts[f"{name}/malformed"] += sum(isinstance(v, Malformed) for v in values)
            for judge, _, _ in self.judges:
                for rule, _, _ in self.rules:
                    self._counts[f"{judge}/agree_{rule}"] += sum(
                        (j >= 0.5) == (r >= 0.5) for j, r in zip(part[judge], part[rule]))

    def take_counts(self) -> dict[str, float]:
        """This step's additive counts (then reset) and the judges' running counts of scored and
        fallback items; the same keys on every DP group, so they can be summed across groups."""
        names = [n for n, _, _ in self.rules + self.judges]
        keys = [f"{n}/{s}" for n in names for s in ("sum", "n", "malformed")]
        keys += [f"{j}/agree_{r}" for j, _, _ in self.judges for r, _, _ in self.rules]
        out = {k: float(self._counts[k]) for k in keys}
        self._counts.clear()
        for name, judge, _ in self.judges:
            out.update(judge.stats.as_metrics(f"genrm/{name}"))
        if self.teacher is not None:
            out.update(self.teacher.stats.as_metrics("distill/teacher"))
        return out


    def item(self, p: Prompt, j: int, r: Response) -> JudgeItem:
        """What the judges see of prompt p's sample j, with the seed of their votes on it."""
        return JudgeItem(p.question, r.text, p.answer, p.images, p.videos, p.sampling_seed(self.seed, f"judge/{j}"))


class RewardStream:
    """The judges' requests for each response go out as the rollout hands it over (`add_sample`,
    as each sample finishes), from an event loop in a background thread, so the judge servers
    work while the rollout engine is still generating; `add` marks a prompt's responses complete,
    and `results()` waits for the last verdicts and combines as `score`.

    Responses go to a judge in batches (`_Dispatch`): vLLM runs a batch in a few engine steps,
    where requests trickling in one by one would cost it steps of one or two requests each, and
    on CPU an engine step costs about the same whatever it holds."""

    def __init__(self, rewarder: Rewarder, prompts: list[Prompt]):
        if any(not isinstance(judge, ServerJudge) for _, judge, _ in rewarder.judges):
            raise ValueError("streaming rewards need judges served by vLLM servers (judge.backend: server): "
                             "an in-process judge engine cannot run beside the in-process rollout engine")
        if rewarder.teacher is not None and not isinstance(rewarder.teacher, ServerTeacher):
            raise ValueError("streaming needs the distillation teacher served by a vLLM server "
                             "(algorithm.distill.backend: server)")
        self.rewarder, self.prompts = rewarder, prompts
        self.responses: list[list[Response] | None] = [None] * len(prompts)
        self.pending: dict[tuple[str, int, int], concurrent.futures.Future] = {}  # (judge, prompt, sample)
        self.sent: dict[tuple[int, int], float] = {}  # (prompt, sample) -> when it was handed to the judges
        self.asked: dict[tuple[str, int, int], float] = {}  # (judge, prompt, sample) -> when its request went out
        self.answered: dict[tuple[str, int, int], float] = {}  # (judge, prompt, sample) -> when its verdict came
        self.loop = asyncio.new_event_loop()
        self.dispatch = {name: _Dispatch(judge, self.asked, self.answered) for name, judge, _ in rewarder.judges}
        # the teacher's requests, on the same loop, timed apart from the judges' (its own spans)
        self.taught: dict[tuple[int, int], concurrent.futures.Future] = {}
        self.teacher_asked: dict[tuple, float] = {}
        self.teacher_answered: dict[tuple, float] = {}
        self.teacher = (_Dispatch(rewarder.teacher, self.teacher_asked, self.teacher_answered)
                        if rewarder.teacher is not None else None)
        self._prompt_ids: dict[int, list[int]] = {}
        self.teacher_logprobs: dict[tuple[int, int], list[float] | None] = {}  # (prompt, sample): results()
        self.thread = threading.Thread(target=self.loop.run_forever, name="reward-stream", daemon=True)
        self.thread.start()

    def add_sample(self, i: int, j: int, response: Response) -> None:
        """Sample j of prompt i is done: hand it to every judge now."""
        self.sent[(i, j)] = time.time()
        item = self.rewarder.item(self.prompts[i], j, response)
        for name in self.dispatch:
            key = (name, i, j)
            self.pending[key] = future = concurrent.futures.Future()
            self.loop.call_soon_threadsafe(self.dispatch[name].add, key, item, future)
        if self.teacher is not None:
            if i not in self._prompt_ids:  # once per prompt: its n responses share it
                self._prompt_ids[i] = self.rewarder.prompt_ids(self.prompts[i].request())
            taught = self.rewarder.teacher_item(self._prompt_ids[i], self.prompts[i], response)
            self.taught[(i, j)] = future = concurrent.futures.Future()
            self.loop.call_soon_threadsafe(self.teacher.add, (NAME, i, j), taught, future)

    def add(self, i: int, responses: list[Response]) -> None:
        """Prompt i's responses are all done (any not handed over one by one go now)."""
        self.responses[i] = responses
        for j, response in enumerate(responses):
            if (i, j) not in self.sent:
                self.add_sample(i, j, response)
        if all(r is not None for r in self.responses):  # nothing more will come: send what waits
            for dispatch in [*self.dispatch.values(), *([self.teacher] if self.teacher else [])]:
                self.loop.call_soon_threadsafe(dispatch.flush)

    def judge_spans(self) -> list[dict]:
        """Each (judge, prompt, sample): when its request went out and its verdict came (the
        judge's work), and when the rollout handed it over (`handed`: it may wait for a batch)."""
        return [{"judge": name, "prompt": i, "sample": j, "start": self.asked[(name, i, j)], "end": end,
                 "handed": self.sent[(i, j)]}
                for (name, i, j), end in sorted(self.answered.items(), key=lambda kv: kv[1])]

    def teach(self, responses: list[list[Response]]) -> None:
        """After `results()`: the teacher's logprobs into `responses` (the rollout's result, which
        an engine worker hands over as objects of its own, apart from those the stream saw)."""
        for (i, j), logprobs in self.teacher_logprobs.items():
            responses[i][j].teacher_logprobs = logprobs

    def teacher_spans(self) -> list[dict]:
        """Each (prompt, sample) the teacher scored: when its request went out and its answer came."""
        return [{"prompt": i, "sample": j, "start": self.teacher_asked[(n, i, j)], "end": end,
                 "handed": self.sent[(i, j)]}
                for (n, i, j), end in sorted(self.teacher_answered.items(), key=lambda kv: kv[1])]

    def results(self) -> list[tuple[list[float], dict]]:
        try:
            if any(r is None for r in self.responses):
                raise RuntimeError("the rollout finished without handing over every prompt's responses")
            judged = {name: [[self.pending[(name, i, j)].result().score for j in range(len(group))]
                             for i, group in enumerate(self.responses)]
                      for name, _, _ in self.rewarder.judges}
            self.teacher_logprobs = {key: future.result().logprobs for key, future in self.taught.items()}
        finally:
            clients = [judge for _, judge, _ in self.rewarder.judges] + ([self.rewarder.teacher] if self.teacher else [])
            for client in clients:  # the HTTP clients belong to this loop
                asyncio.run_coroutine_threadsafe(client.aclose(), self.loop).result()
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join()
            self.loop.close()
        return self.rewarder._combine(self.prompts, self.responses, judged)


class _Dispatch:
    """One judge's requests, in the stream's event loop: they wait until `judge.stream_batch`
    of them are there and the judge has none open, then go together; when the stream ends
    (`flush`), whatever waits goes."""

    def __init__(self, judge: ServerJudge, asked: dict, answered: dict):
        self.judge, self.asked, self.answered = judge, asked, answered
        self.batch = judge.cfg.stream_batch
        self.waiting: list[tuple[tuple, JudgeItem, concurrent.futures.Future]] = []
        self.open = 0
        self.flushing = False

    def add(self, key: tuple, item: JudgeItem, future: concurrent.futures.Future) -> None:
        self.waiting.append((key, item, future))
        if self.open == 0 and (len(self.waiting) >= self.batch or self.flushing):
            self._send_waiting()

    def flush(self) -> None:
        self.flushing = True
        if self.open == 0 and self.waiting:
            self._send_waiting()

    def _send_waiting(self) -> None:
        batch, self.waiting = self.waiting, []
        self.open += len(batch)
        now = time.time()
        for key, item, future in batch:
            self.asked[key] = now
            asyncio.ensure_future(self._one(key, item, future))

    async def _one(self, key: tuple, item: JudgeItem, future: concurrent.futures.Future) -> None:
        try:
            score = await self.judge.score_one(item)
            self.answered[key] = time.time()  # before the future completes: the waiter then sees the time
            future.set_result(score)
        except BaseException as e:  # noqa: BLE001 - handed to the waiter, which raises it
            future.set_exception(e)
        finally:
            self.open -= 1
            if self.open == 0 and self.waiting and (len(self.waiting) >= self.batch or self.flushing):
                self._send_waiting()


def reward_metrics(counts: dict[str, float], rule_names: list[str], judge_names: list[str]) -> dict[str, float]:
    """Summed counts -> per-part reward means and judge/rule agreement rates."""
    out = {k: v for k, v in counts.items() if k.startswith(("genrm/", "distill/"))}
    for name in rule_names + judge_names:
        n = counts.get(f"{name}/n", 0.0)
        if n:
            out[f"reward/{name}"] = counts[f"{name}/sum"] / n
            if counts.get(f"{name}/malformed"):  # responses the rule could not read (rules.Malformed)
                out[f"reward/{name}_malformed"] = counts[f"{name}/malformed"] / n
    for judge in judge_names:
        n = counts.get(f"{judge}/n", 0.0)
        for rule in rule_names:
            if n:
                out[f"genrm/{judge}/agreement_{rule}"] = counts[f"{judge}/agree_{rule}"] / n
    return out
