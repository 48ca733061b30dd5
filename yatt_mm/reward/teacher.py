"""On-policy distillation's teacher: a larger model of the student's family, with the student's
tokenizer, that scores each response the student sampled with its own logprob of every sampled
token (vLLM's prompt logprobs over prompt + response, media included). The actor turns the
difference into a per-token advantage (yatt_mm/rl/advantages.py `distill_advantages`).

Served as the GenRM judges are (yatt_mm/reward/genrm.py), one interface, `score(items)` and the
async `score_one(item)` that streams responses to it as they finish:
- `InProcessTeacher`: a vLLM engine in the controller's process (or its engine worker);
- `ServerTeacher`: a vLLM server per node (yatt_mm/engines/server.py `TeacherServer`) reached
  over HTTP with timeouts and bounded retries, the server under the judge server's supervision.

A response the teacher cannot score gets no logprobs, so no distillation signal; it is counted by
reason (`distill/teacher/fallback_*`), never an exception.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from yatt_mm.engines.scoring import UNSCORED, ScoreRequest
from yatt_mm.loopback import KEY_ENV, check_served_host
from yatt_mm.reward.genrm import JudgeStats
from yatt_mm.reward.served import ServedClient

NAME = "teacher"  # the served model's name, and the metrics' (distill/teacher/...)
# why a response got no teacher logprobs: vLLM's refusals (UNSCORED) and the server's failures
TEACHER_FAILURES = UNSCORED + ("timeout", "unreachable", "http")


@dataclass
class DistillConfig:
    """On-policy distillation (docs/rl.md): the student samples, the teacher scores every sampled
    token, and each token's advantage gains coef x (teacher logprob - student logprob)."""

    teacher: str = ""  # HF directory of the teacher (tiny:KIND, warmstart:KIND too), the student's tokenizer; empty: off
    coef: float = 1.0  # weight of the per-token reverse-KL advantage
    with_reward: bool = True  # add the reward's advantage; false: pure distillation (the reward is only measured)
    backend: Literal["inprocess", "server"] = "inprocess"  # a vLLM engine in the controller's process, or a server
    # server backend (as a judge's: yatt_mm/reward/genrm.py JudgeConfig)
    host: str = "127.0.0.1"  # where the teacher server listens; any other than loopback needs an API key (api_key_env)
    port: int = 0  # 0: pick a free port
    timeout_s: float = 60.0  # HTTP timeout per request to the teacher server, seconds
    retries: int = 2  # extra attempts after a failed request, before the response goes unscored
    backoff_s: float = 0.5  # wait before retry k (k = 0, 1, ...): backoff_s * 2**k seconds
    startup_timeout_s: float = 180.0  # seconds to wait for the teacher server to become healthy
    devices: str = ""  # GPUs: CUDA_VISIBLE_DEVICES of the server (e.g. "7"); empty: inherited
    stream_batch: int = 8  # partial colocation: responses sent to the server together (as a judge's)
    threads: int = 1  # CPU: torch threads of the server's processes (0: inherited)
    server_per: Literal["node", "dp_group"] = "node"  # one server a node (its first controller starts it), or one per DP group
    gpu_memory_utilization: float = 0.3  # GPUs: the share of its GPU the teacher's vLLM may take (server or in-process)
    api_key_env: str = KEY_ENV  # the environment variable holding the server's API key (required off loopback)

    RANGES = {"coef": ">= 0", "port": "[0, 65535]", "timeout_s": "> 0", "retries": ">= 0", "backoff_s": ">= 0",
              "startup_timeout_s": "> 0", "stream_batch": ">= 1", "threads": ">= 0", "gpu_memory_utilization": "(0, 1)"}

    @property
    def active(self) -> bool:
        return bool(self.teacher)

    @property
    def name(self) -> str:  # the served model's name (yatt_mm/engines/server.py ServedModel)
        return NAME

    @property
    def model(self) -> str:
        return self.teacher

    def validate(self) -> None:
        if self.active and self.coef == 0:
            raise ValueError("coef=0 gives the teacher's signal no weight: set coef > 0 (1 is the reference's), or "
                             "teacher: '' to turn distillation off")
        if self.active and self.backend == "server":
            check_served_host(NAME, self.host, self.api_key_env, "teacher", "algorithm.distill.api_key_env")


@dataclass
class TeacherItem:
    """One response to score: the prompt's token ids as the student's engine saw them (media
    placeholders unexpanded), the response's, and the prompt's media."""

    prompt_ids: list[int]
    response_ids: list[int]
    images: list[Any] = field(default_factory=list)
    videos: list[np.ndarray] = field(default_factory=list)

    def request(self) -> ScoreRequest:
        return ScoreRequest(self.prompt_ids + self.response_ids, len(self.response_ids), self.images, self.videos)


@dataclass
class TeacherScore:
    logprobs: list[float] | None  # the teacher's logprob of each response token; None: not scored
    failure: str | None = None  # why not


def _score(result: list[float] | str) -> TeacherScore:
    return TeacherScore(None, result) if isinstance(result, str) else TeacherScore(result)


class InProcessTeacher:
    def __init__(self, cfg: DistillConfig, engine=None, max_model_len: int = 2049):
        """`engine`: where the teacher runs, anything with `prompt_logprobs` (default: a vLLM
        engine of its own in this process; the disaggregated placement gives one in the
        controller's engine worker)."""
        from yatt_mm.engines.scoring import Scorer

        self.cfg = cfg
        if engine is None:
            from yatt_mm.engines.engine import RolloutEngine

            engine = Scorer(RolloutEngine(self.engine_config(cfg, max_model_len)))
        self.engine = engine
        self.stats = JudgeStats(TEACHER_FAILURES)

    @staticmethod
    def engine_config(cfg: DistillConfig, max_model_len: int):
        from yatt_mm.engines.engine import EngineConfig

        return EngineConfig(model=cfg.teacher, max_model_len=max_model_len,
                            gpu_memory_utilization=cfg.gpu_memory_utilization)

    def score(self, items: list[TeacherItem]) -> list[TeacherScore]:
        start = time.perf_counter()
        scores = [_score(r) for r in self.engine.prompt_logprobs([it.request() for it in items])]
        per_item = (time.perf_counter() - start) / max(len(items), 1)
        for s in scores:
            self.stats.add(s, per_item)
        return scores

    async def score_one(self, item: TeacherItem) -> TeacherScore:
        return self.score([item])[0]

    async def aclose(self) -> None:
        pass


def data_url_frames(video: np.ndarray) -> str:
    """A video as vLLM's server takes a sequence of frames ("video/jpeg": one base64 image per
    frame, comma separated; its decoder opens any image format): PNG, lossless, so the teacher
    server sees the frames the student saw. An mp4 (the judges' form) is lossy: it moved the
    teacher's logprobs of a video response by up to 3.4 nats against the in-process teacher's.
    Every frame is kept at RAW_VIDEO_FPS by the server's settings (engines/server.py TeacherServer)."""
    import base64
    import io

    from PIL import Image

    frames = []
    for frame in video:
        buf = io.BytesIO()
        Image.fromarray(np.asarray(frame, dtype=np.uint8)).save(buf, format="PNG")
        frames.append(base64.b64encode(buf.getvalue()).decode())
    return "data:video/jpeg;base64," + ",".join(frames)


class ServerTeacher(ServedClient):
    """Client of a teacher server: vLLM's tokens-in endpoint, the student's token ids and the
    media as data URLs, one forward pass with prompt logprobs. Every request has a timeout and
    bounded retries with exponential backoff; after that the response goes unscored, counted."""

    def __init__(self, cfg: DistillConfig, base_url: str, server=None):
        super().__init__(cfg, base_url, server)  # server: the TeacherServer this client owns, if any
        self.stats = JudgeStats(TEACHER_FAILURES)

    def _payload(self, item: TeacherItem) -> dict:
        parts = [{"type": "image_url", "url": self._image_url(im)} for im in item.images]
        parts += [{"type": "video_url", "url": data_url_frames(v)} for v in item.videos]
        payload = {"model": NAME, "token_ids": item.prompt_ids + item.response_ids, "return_token_ids": True,
                   "sampling_params": {"max_tokens": 1, "temperature": 0.0, "prompt_logprobs": 0}}
        if parts:
            payload["content_parts"] = parts
        return payload

    async def score_one(self, item: TeacherItem) -> TeacherScore:
        from yatt_mm.engines.scoring import response_logprobs

        def read(body: dict) -> TeacherScore:
            return _score(response_logprobs(body["prompt_token_ids"], body["prompt_logprobs"], item.request()))

        start = time.perf_counter()
        # 400: vLLM refused the request itself (too long, media over the limit): no retry helps
        result, failure = await self._post("/inference/v1/generate", self._payload(item), read, final=frozenset({400}))
        if result is None:
            result = TeacherScore(None, "unscorable" if failure == "http_400" else failure)
        self.stats.add(result, time.perf_counter() - start)
        return result


def served_teacher(cfg: DistillConfig, max_model_len: int = 2049) -> ServerTeacher:
    from yatt_mm.engines.server import TeacherServer

    server = TeacherServer(cfg, max_model_len=max_model_len).start()
    return ServerTeacher(cfg, server.base_url, server=server)


def build_teacher(cfg: DistillConfig, max_model_len: int, comm=None, engine_of=None):
    """The run's teacher on this rank, or None (distillation off, or a rank that never scores).
    As `build_judges` (yatt_mm/reward/judges.py): every rank calls it; an in-process teacher is a
    vLLM engine (whose creation is collective), a served one is shared by the node's controllers
    (one server a node or a DP group, started by the first controller there). `max_model_len`:
    the teacher's context, one token over the rollout engine's (it generates one token after the
    longest prompt + response the rollout can give)."""
    if not cfg.active:
        return None
    if cfg.backend == "inprocess":
        if engine_of is not None:
            return InProcessTeacher(cfg, engine=engine_of(cfg)) if comm is None or comm.leader else None
        return InProcessTeacher(cfg, max_model_len=max_model_len)
    if comm is None:
        return served_teacher(cfg, max_model_len)
    from yatt_mm.reward.judges import shared_server_judge

    return shared_server_judge(cfg, comm, start=lambda c: served_teacher(c, max_model_len),
                               connect=lambda url: ServerTeacher(cfg, url), what=NAME)


def check_teacher(teacher: str, student: str) -> None:
    """At config load, before any rank starts: the teacher is an HF directory of a family yatt-mm
    knows, whose tokenizer is the student's (the teacher scores the student's token ids, so each id
    must name the same token in both); ValueError naming the setting otherwise."""
    from models.family import family_for_dir

    family_for_dir(teacher)  # FileNotFoundError or ValueError (an unknown model_type), naming the directory
    if _vocab(teacher) != _vocab(student):
        raise ValueError(f"algorithm.distill.teacher={teacher}: its tokenizer is not the student's "
                         f"(policy.model={student}): the teacher scores the student's token ids, so both must map "
                         "every id to the same token; choose a teacher of the student's family and tokenizer")


def _vocab(model_dir: str) -> dict[str, int]:
    """The tokenizer's whole vocabulary, added tokens included (token -> id)."""
    from pathlib import Path

    path = Path(model_dir) / "tokenizer.json"
    if path.is_file():  # `tokenizers` alone: the launcher imports no transformers for this
        from tokenizers import Tokenizer

        return Tokenizer.from_file(str(path)).get_vocab(with_added_tokens=True)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir).get_vocab()
