"""The logprob a model gives each token of a sequence it did not sample: vLLM's prompt logprobs
of prompt + response, media included, in one forward pass (no generation beyond the one token
vLLM insists on). On-policy distillation's teacher scores the student's responses this way
(yatt_mm/reward/teacher.py), in-process here, or through a server's tokens-in endpoint.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from yatt_mm.engines.media import vllm_video


@dataclass
class ScoreRequest:
    """Token ids to score: a prompt as the chat template wrote it (each medium one placeholder,
    which vLLM expands as it did when the response was sampled), then the response; the last
    `response_tokens` of them are scored."""

    token_ids: list[int]
    response_tokens: int
    images: list[Any] = field(default_factory=list)
    videos: list[np.ndarray] = field(default_factory=list)


# Why a request got no logprobs. unscorable: vLLM refused it (longer than the context, media over
# the limit); mismatch: the scored tail is not the response's tokens (media expanded differently)
UNSCORED = ("unscorable", "mismatch")


def vllm_prompt(request: ScoreRequest, timed_videos: bool) -> dict[str, Any]:
    prompt: dict[str, Any] = {"prompt_token_ids": list(request.token_ids)}
    mm: dict[str, Any] = {}
    if request.images:
        mm["image"] = request.images if len(request.images) > 1 else request.images[0]
    if request.videos:
        videos = [vllm_video(v, timed_videos) for v in request.videos]
        mm["video"] = videos if len(videos) > 1 else videos[0]
    if mm:
        prompt["multi_modal_data"] = mm
    return prompt


def response_logprobs(prompt_token_ids: list[int], prompt_logprobs: list, request: ScoreRequest) -> list[float] | str:
    """The logprobs of the request's response tokens out of a scored prompt (vLLM's
    `prompt_logprobs`: None for the first token, then {token id: logprob} per position; keys may be
    strings, as a server's JSON gives them), or why there are none."""
    n = request.response_tokens
    if n == 0:
        return []
    ids, scored = list(prompt_token_ids[-n:]), prompt_logprobs[-n:]
    if ids != list(request.token_ids[-n:]) or len(scored) != n or any(d is None for d in scored):
        return "mismatch"
    out = []
    for d, t in zip(scored, ids):
        entry = d.get(t, d.get(str(t))) if isinstance(d, dict) else None
        if entry is None:
            return "mismatch"
        out.append(float(entry["logprob"] if isinstance(entry, dict) else entry.logprob))
    return out


def prompt_logprobs(engine, requests: list[ScoreRequest]) -> list[list[float] | str]:
    """Per request: the logprob of each of its response tokens under `engine`'s weights (a
    RolloutEngine), or why it could not be scored. A request vLLM refuses fails alone: the batch
    is then scored one request at a time."""
    from vllm import SamplingParams
    from vllm.exceptions import VLLMClientError

    if not requests:
        return []
    engine._require("all", "scoring")
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    try:
        outputs = engine.llm.generate([vllm_prompt(r, engine.timed_videos) for r in requests], params, use_tqdm=False)
    except (VLLMClientError, ValueError, TypeError):  # vLLM's refusals of one input (length, media) fail the call
        if len(requests) == 1:
            return ["unscorable"]
        return [score for r in requests for score in prompt_logprobs(engine, [r])]
    return [response_logprobs(out.prompt_token_ids, out.prompt_logprobs, r) for out, r in zip(outputs, requests)]


class Scorer:
    """A RolloutEngine that scores: `prompt_logprobs`, as an engine worker's engine has it
    (yatt_mm/engines/worker.py RemoteEngine), and the engine's own calls (the placement's release
    and acquire) passed through."""

    def __init__(self, engine):
        self.engine = engine

    def __getattr__(self, name: str):
        return getattr(self.engine, name)

    def prompt_logprobs(self, requests: list[ScoreRequest]) -> list[list[float] | str]:
        return prompt_logprobs(self.engine, requests)
