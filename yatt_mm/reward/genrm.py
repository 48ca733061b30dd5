"""GenRM: a generative judge VLM that reads the question, the media and a response, answers in
text, and is parsed into a score.

Two ways to run a judge, one interface (`score(items) -> list[JudgeScore]`, and the async
`score_one`, used to stream responses to the judge as they finish):
- `InProcessJudge`: an in-process vLLM engine (the rollout engine class, with the judge model);
- `ServerJudge`: a vLLM OpenAI-compatible server process (see `yatt_mm/engines/server.py`), reached by an
  async HTTP client with timeouts, bounded retries with backoff, and a counted fallback score.

A judge that fails or answers unparseably never fails a step: the item gets `fallback_score`
and the failure is counted by reason.
"""

from __future__ import annotations

import base64
import re
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from yatt_mm.loopback import KEY_ENV, check_served_host
from yatt_mm.reward.served import ServedClient

# The comparison at the heart of a reference-guided judge; the default template puts the question
# (and the media, as chat parts) before it. The tiny judge's warm start learns the comparison
# alone first (see yatt_mm/demo/warmstart.py).
COMPARE_TEMPLATE = "Reference answer: {answer}\nResponse: {response}\nCorrect? Reply 'Score: 1' or 'Score: 0'."
DEFAULT_TEMPLATE = "Question: {question}\n" + COMPARE_TEMPLATE


@dataclass
class JudgeConfig:
    name: str = "judge"  # the judge's reward-part name, also in metric keys (genrm/<name>/...)
    model: str = ""  # HF directory of the judge VLM
    backend: str = "inprocess"  # inprocess | server | module:function (yatt_mm/reward/judges.py)
    template: str = DEFAULT_TEMPLATE  # judge prompt; str.format fields {question}, {answer}, {response}
    parse: Literal["score", "yes_no"] = "score"  # score: one 'Score: x' in score_range; yes_no: yes=1, no=0
    score_range: tuple[float, float] = (0.0, 1.0)  # [lo, hi] of valid 'Score: x' values (parse=score)
    votes: int = 1  # k samples per response, averaged
    temperature: float = 0.7  # judge sampling temperature
    max_tokens: int = 16  # most tokens per judge answer
    fallback_score: float = 0.0  # score when no vote parses or the server fails (counted by reason)
    # server backend
    host: str = "127.0.0.1"  # where the judge server listens; any other than loopback needs an API key (api_key_env)
    port: int = 0  # 0: pick a free port
    timeout_s: float = 30.0  # HTTP timeout per request to the judge server, seconds
    retries: int = 2  # extra attempts after a failed request, before the fallback score
    backoff_s: float = 0.5  # wait before retry k (k = 0, 1, ...): backoff_s * 2**k seconds
    startup_timeout_s: float = 180.0  # seconds to wait for the judge server to become healthy
    devices: str = ""  # GPUs: CUDA_VISIBLE_DEVICES of the server (e.g. "6,7"); empty: inherited
    # partial colocation: responses sent to the server together, once the judge has none open
    # (more: fewer, fuller engine steps; fewer: judging starts sooner); the last ones at the end
    stream_batch: int = 8
    # CPU: torch threads of the server's processes (0: inherited). One, because partial colocation
    # pins the server to its share of the cores, and more threads than cores stall each kernel
    threads: int = 1
    server_per: Literal["node", "dp_group"] = "node"  # one server a node (its first controller starts it), or one per DP group
    gpu_memory_utilization: float = 0.3  # GPUs: the share of its GPU the judge's vLLM may take (server or in-process)
    # the environment variable that holds the judge server's API key: required when host is not a
    # loopback address, used whenever set (the server then refuses requests without it). The key
    # itself is never a setting, so it never reaches config.yaml or a metrics tracker
    api_key_env: str = KEY_ENV

    RANGES = {"score_range": "any", "votes": ">= 1", "temperature": ">= 0", "max_tokens": ">= 1",
              "fallback_score": "any", "port": "[0, 65535]", "timeout_s": "> 0", "retries": ">= 0", "backoff_s": ">= 0",
              "startup_timeout_s": "> 0", "stream_batch": ">= 1", "threads": ">= 0", "gpu_memory_utilization": "(0, 1)"}

    def validate(self) -> None:  # the backend's name is checked where the backends are (WeightedJudge)
        if len(self.score_range) != 2 or not self.score_range[0] < self.score_range[1]:
            raise ValueError(f"score_range must be [lo, hi] with lo < hi, got {list(self.score_range)}")
        if self.backend == "server":
            check_served_host(self.name, self.host, self.api_key_env)


@dataclass
class JudgeItem:
    question: str
    response: str
    answer: str = ""
    images: list[Any] = field(default_factory=list)  # PIL images
    videos: list[np.ndarray] = field(default_factory=list)  # uint8 [T, H, W, 3]
    seed: int | None = None  # the votes' sampling seed (vote v: seed + v); None: unseeded


@dataclass
class JudgeScore:
    score: float
    parsed_votes: int  # votes that parsed; 0 means the fallback was used
    failure: str | None = None  # reason when the fallback was used
    texts: list[str] = field(default_factory=list)


_SCORE = re.compile(r"score\s*[:=]\s*(-?\d+(?:\.\d+)?)", re.IGNORECASE)
_YES_NO_PHRASE = re.compile(r"correct\s*\(yes/no\)\s*\?", re.IGNORECASE)
_YES_NO = re.compile(r"\b(yes|no)\b", re.IGNORECASE)


def parse_verdict(text: str, how: str = "score", score_range: tuple[float, float] = (0.0, 1.0)) -> float | None:
    """The judge's score, or None when the text does not state exactly one valid verdict.

    score: every 'Score: x' in the text must agree and lie in `score_range` (a judge that says
    two different scores has not decided). yes_no: the first yes/no after the phrase
    'correct (Yes/No)?' (or anywhere, when the phrase is absent) gives 1 or 0."""
    if not text or not text.strip():
        return None
    if how == "score":
        values = {float(v) for v in _SCORE.findall(text)}
        if len(values) != 1:
            return None
        (value,) = values
        lo, hi = score_range
        return value if lo <= value <= hi else None
    if how == "yes_no":
        phrase = _YES_NO_PHRASE.search(text)
        tail = text[phrase.end():] if phrase else text
        m = _YES_NO.search(tail)
        return None if m is None else float(m.group(1).lower() == "yes")
    raise ValueError(f"unknown judge parse mode {how!r}; choose score or yes_no")


def judge_messages(cfg: JudgeConfig, item: JudgeItem) -> list[dict]:
    text = cfg.template.format(question=item.question, answer=item.answer, response=item.response)
    parts = [{"type": "image"} for _ in item.images] + [{"type": "video"} for _ in item.videos]
    return [{"role": "user", "content": parts + [{"type": "text", "text": text}]}]


def aggregate_votes(cfg: JudgeConfig, texts: list[str], failure: str | None = None) -> JudgeScore:
    scores = [s for s in (parse_verdict(t, cfg.parse, cfg.score_range) for t in texts) if s is not None]
    if not scores:
        return JudgeScore(cfg.fallback_score, 0, failure or "unparseable", texts)
    return JudgeScore(sum(scores) / len(scores), len(scores), None, texts)


# Why an item got the fallback score, as JudgeStats reports it.
FALLBACK_REASONS = ("unparseable", "timeout", "unreachable", "http")


class JudgeStats:
    """Counts the judge's outcomes for metrics: scored, fallback by reason, latency. `reasons`:
    the reasons reported under keys of their own (a distillation teacher has others)."""

    def __init__(self, reasons: tuple[str, ...] = FALLBACK_REASONS) -> None:
        self.reasons = reasons
        self.scored = 0
        self.fallbacks: Counter[str] = Counter()
        self.seconds = 0.0

    def add(self, result: JudgeScore, seconds: float) -> None:
        self.seconds += seconds
        if result.failure:
            self.fallbacks[result.failure] += 1
        else:
            self.scored += 1

    def as_metrics(self, prefix: str) -> dict[str, float]:
        """Running counts under fixed keys (the same on every rank, so they can be summed):
        scored, fallback, and fallback by reason (http_503 and the like count as "http")."""
        out = {f"{prefix}/scored": float(self.scored), f"{prefix}/fallback": float(sum(self.fallbacks.values()))}
        for reason in self.reasons:
            out[f"{prefix}/fallback_{reason}"] = float(
                sum(v for k, v in self.fallbacks.items() if k == reason or k.startswith(f"{reason}_")))
        return out


class InProcessJudge:
    def __init__(self, cfg: JudgeConfig, engine=None):
        """`engine`: where the judge generates (default: a vLLM engine of its own, in this
        process; the disaggregated placement gives one in the controller's engine worker)."""
        from yatt_mm.engines.engine import RolloutEngine

        self.cfg = cfg
        self.engine = engine or RolloutEngine(self.engine_config(cfg))
        self.stats = JudgeStats()

    @staticmethod
    def engine_config(cfg: JudgeConfig):
        from yatt_mm.engines.engine import EngineConfig

        return EngineConfig(model=cfg.model, gpu_memory_utilization=cfg.gpu_memory_utilization)

    def score(self, items: list[JudgeItem]) -> list[JudgeScore]:
        from yatt_mm.engines.engine import Request, SamplingConfig

        start = time.perf_counter()
        requests = [Request(judge_messages(self.cfg, it), images=it.images, videos=it.videos, seed=it.seed)
                    for it in items]
        sampling = SamplingConfig(n=self.cfg.votes, max_tokens=self.cfg.max_tokens,
                                  temperature=self.cfg.temperature, seed=None)
        result = self.engine.generate(requests, sampling)
        scores = [aggregate_votes(self.cfg, [r.text for r in group]) for group in result.responses]
        per_item = (time.perf_counter() - start) / max(len(items), 1)
        for s in scores:
            self.stats.add(s, per_item)
        return scores

    async def score_one(self, item: JudgeItem) -> JudgeScore:
        return self.score([item])[0]


def _data_url_video(video: np.ndarray) -> str:
    import cv2  # vLLM's own video decoder; present wherever vLLM is

    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as tmp:
        path = str(Path(tmp) / "clip.mp4")
        t, h, w, _ = video.shape
        writer = cv2.VideoWriter(path, cv2.VideoWriter_fourcc(*"mp4v"), 4.0, (w, h))
        for frame in video:
            writer.write(cv2.cvtColor(frame, cv2.COLOR_RGB2BGR))
        writer.release()
        data = Path(path).read_bytes()
    return "data:video/mp4;base64," + base64.b64encode(data).decode()


class ServerJudge(ServedClient):
    """Client of a vLLM OpenAI-compatible server. Every request has a timeout and bounded retries
    with exponential backoff; after that the item gets the fallback score, counted by reason."""

    def __init__(self, cfg: JudgeConfig, base_url: str, model_name: str, server=None):
        super().__init__(cfg, base_url, server)  # server: the JudgeServer this client owns, if any
        self.model_name = model_name
        self.stats = JudgeStats()

    def _payload(self, item: JudgeItem) -> dict:
        text = judge_messages(self.cfg, item)[0]["content"][-1]["text"]
        content: list[dict] = [{"type": "image_url", "image_url": {"url": self._image_url(im)}} for im in item.images]
        content += [{"type": "video_url", "video_url": {"url": _data_url_video(v)}} for v in item.videos]
        content.append({"type": "text", "text": text})
        payload = {
            "model": self.model_name,
            "messages": [{"role": "user", "content": content}],
            "n": self.cfg.votes,
            "max_tokens": self.cfg.max_tokens,
            "temperature": self.cfg.temperature,
        }
        if item.seed is not None:
            payload["seed"] = item.seed  # vote v: seed + v, as in-process
        return payload

    async def score_one(self, item: JudgeItem) -> JudgeScore:
        def read(body: dict) -> JudgeScore:
            return aggregate_votes(self.cfg, [c["message"]["content"] or "" for c in body["choices"]])

        start = time.perf_counter()
        result, failure = await self._post("/v1/chat/completions", self._payload(item), read)
        if result is None:
            result = JudgeScore(self.cfg.fallback_score, 0, failure)
        self.stats.add(result, time.perf_counter() - start)
        return result
