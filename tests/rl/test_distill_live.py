"""On-policy distillation's teacher served by a real vLLM server (yatt_mm/engines/server.py
TeacherServer, vLLM's tokens-in endpoint), one server start shared by the module: responses to an
image and a video prompt, streamed to it as they finish (or sent as one batch), get the logprobs
the in-process teacher gives them (which equal transformers': tests/reward/test_teacher.py); then controller steps in
partial colocation with the teacher beside the rollout, its server killed between two steps: the
step goes on, every response of it unscored and counted, and the samples built from it carry no
distillation signal."""

from __future__ import annotations

import random

import pytest
import torch

from dataio.synth import colour_image, moving_ball_video
from models.family import read_spec
from yatt_mm.engines.engine import SamplingConfig
from yatt_mm.engines.scoring import Scorer
from yatt_mm.metrics import Timeline
from yatt_mm.reward.judges import Judges
from yatt_mm.reward.rewarder import RewardConfig, Rewarder
from yatt_mm.reward.teacher import DistillConfig, InProcessTeacher, ServerTeacher, served_teacher
from yatt_mm.rl.algorithms import AlgorithmConfig
from yatt_mm.rl.controller import Controller
from yatt_mm.rl.dynamic_sampling import DynamicSampler, DynamicSamplingConfig
from yatt_mm.rl.placement import PhaseRunner, partial_colocation
from yatt_mm.rl.samples import Prompt, SampleBuilder, _collate
from yatt_mm.rl.sources import PromptSource

pytestmark = pytest.mark.slow  # a teacher server start (20-60 s) and a few steps


@pytest.fixture(scope="module")
def teacher(tiny_policy):
    """The tiny policy served as the teacher (it is also the student here: the module checks the
    serving, not the learning), stopped at the end of the module."""
    served = served_teacher(DistillConfig(teacher=str(tiny_policy), backend="server", timeout_s=10, retries=1,
                                          backoff_s=0.1), max_model_len=2049)
    try:
        yield served
    finally:
        served.close()


def _prompts(seed: int = 0) -> list[Prompt]:
    rng = random.Random(seed)
    image, video = colour_image(rng), moving_ball_video(rng)
    return [Prompt(f"image{seed}", image.question, image.answer, images=[image.image]),
            Prompt(f"video{seed}", video.question, video.answer, videos=[video.video])]


def _prompt_ids(engine):
    return lambda request: engine.tokenizer.encode(engine.prompt_text(request), add_special_tokens=False)


def test_a_teacher_server_scores_streamed_responses_as_the_in_process_teacher(rollout_engine, teacher):
    prompts = _prompts()
    result = rollout_engine.generate([p.request() for p in prompts], SamplingConfig(n=2, max_tokens=12, seed=5))
    local = InProcessTeacher(DistillConfig(teacher=rollout_engine.cfg.model), engine=Scorer(rollout_engine))
    Rewarder(RewardConfig(), Judges(), teacher=local, prompt_ids=_prompt_ids(rollout_engine)).teach(
        prompts, result.responses)
    expected = [[r.teacher_logprobs for r in group] for group in result.responses]
    for group in result.responses:
        for r in group:
            r.teacher_logprobs = None
    client = ServerTeacher(teacher.cfg, teacher.base_url)
    stream = Rewarder(RewardConfig(), Judges(), teacher=client, prompt_ids=_prompt_ids(rollout_engine)).stream(prompts)
    for i, group in enumerate(result.responses):  # as the rollout hands them over: one by one, then the prompt
        stream.add_sample(i, 0, group[0])
        stream.add(i, group)
    stream.results()
    stream.teach(result.responses)
    worst = 0.0
    for group, wanted in zip(result.responses, expected):
        for r, lp in zip(group, wanted):
            assert lp is not None and len(r.teacher_logprobs) == len(r.token_ids) == len(lp)
            worst = max(worst, float((torch.tensor(r.teacher_logprobs) - torch.tensor(lp)).abs().max()))
    print(f"teacher server vs in-process, image and video responses: max |logprob diff| {worst:.2e}")
    assert worst < 1e-4  # measured 1.2e-5 (fp32 both; an mp4 video instead of lossless frames: 3.4)
    # the same server scoring a whole wave at once (full colocation with a teacher server)
    batch = [[None] * len(group) for group in result.responses]
    for group in result.responses:
        for r in group:
            r.teacher_logprobs = None
    Rewarder(RewardConfig(), Judges(), teacher=ServerTeacher(teacher.cfg, teacher.base_url),
             prompt_ids=_prompt_ids(rollout_engine)).teach(prompts, result.responses)
    for i, (group, wanted) in enumerate(zip(result.responses, expected)):
        for j, (r, lp) in enumerate(zip(group, wanted)):
            batch[i][j] = float((torch.tensor(r.teacher_logprobs) - torch.tensor(lp)).abs().max())
    assert max(map(max, batch)) < 1e-4, batch
    spans = stream.teacher_spans()
    assert sorted((s["prompt"], s["sample"]) for s in spans) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert all(s["start"] <= s["end"] for s in spans)
    assert client.stats.scored == 4 and not client.stats.fallbacks


class Prompts(PromptSource):
    def __init__(self):
        self.n = 0

    def take(self, n):
        self.n += 1
        return [p for k in range(n // 2) for p in _prompts(100 * self.n + k)]


def test_a_teacher_server_killed_between_steps_is_counted_and_the_steps_go_on(rollout_engine, teacher):
    """Last in the module: kill -9 of the server's API process between two controller steps."""
    import psutil
    from transformers import AutoProcessor

    client = ServerTeacher(teacher.cfg, teacher.base_url, server=teacher.server)
    rewarder = Rewarder(RewardConfig(), Judges(), teacher=client, prompt_ids=_prompt_ids(rollout_engine))
    timeline = Timeline(0)
    phases = PhaseRunner(partial_colocation(teacher=True), {}, timeline)
    processor = AutoProcessor.from_pretrained(rollout_engine.cfg.model)
    builder = SampleBuilder(processor, rollout_engine.prompt_text, rollout_engine.processor_media)
    ctrl = Controller(Prompts(), rollout_engine, rewarder, DynamicSampler(DynamicSamplingConfig(enabled=False)),
                      SamplingConfig(n=2, max_tokens=8), builder, AlgorithmConfig(), phases)

    def scored(samples) -> list[bool]:
        return [s.teacher_logprobs is not None for group in samples for s in group]

    def collated(samples):
        return _collate([s for group in samples for s in group], read_spec(rollout_engine.cfg.model), 0).extra

    before, counted = ctrl.step(0, 2)
    assert scored(before) == [True] * 4 and counted.reward_counts["distill/teacher/scored"] == 4.0
    assert [s["phase"] for s in timeline.spans].count("teacher") == 4
    # the teacher is the sampler here: at every response token its logprob is vLLM's sampled one
    batch = collated(before)
    assert torch.equal(batch["distill_mask"], batch["response_mask"]) and batch["distill_mask"].sum() > 0
    gap = ((batch["teacher_logprobs"] - batch["rollout_logprobs"]).abs() * batch["distill_mask"]).max()
    assert gap < 1e-4, gap
    (api,) = psutil.Process(teacher.server.proc.pid).children()  # the supervisor's one child
    api.kill()
    after, counted = ctrl.step(1, 2)  # the step goes on
    assert scored(after) == [False] * 4
    assert counted.reward_counts["distill/teacher/scored"] == 4.0  # running counts: step 0's
    assert counted.reward_counts["distill/teacher/fallback_unreachable"] == 4.0
    assert counted.reward_counts["distill/teacher/fallback"] == 4.0
    batch = collated(after)  # no distillation signal: the actor adds nothing to these responses
    assert batch["distill_mask"].sum() == 0 and batch["response_mask"].sum() > 0
