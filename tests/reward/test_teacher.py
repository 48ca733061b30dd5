"""On-policy distillation's teacher and signal, on real components: the teacher's logprobs of
responses the tiny policy sampled (an image prompt and a video prompt) equal transformers' for the
same tokens and media, a response it cannot score is counted and gets no signal, the per-token
advantage equals a hand computation, and the config refuses a teacher whose tokenizer is not the
student's before any rank starts. The teacher server (streaming, a kill mid-step):
tests/rl/test_distill_live.py."""

from __future__ import annotations

import json
import random
import shutil

import pytest
import torch

from dataio.synth import colour_image, moving_ball_video
from yatt_mm.engines.engine import SamplingConfig
from yatt_mm.engines.scoring import Scorer
from yatt_mm.reward.judges import Judges
from yatt_mm.reward.rewarder import RewardConfig, Rewarder
from yatt_mm.reward.teacher import DistillConfig, InProcessTeacher, TeacherItem
from yatt_mm.rl.advantages import distill_advantages
from yatt_mm.rl.samples import Prompt


def transformers_logprobs(model_dir, processor, engine, prompt: Prompt, response_ids: list[int]) -> torch.Tensor:
    """The logprob transformers' model gives each response token after the prompt and its media,
    the media preprocessed as the trainer's samples are (the rollout engine's processor_media)."""
    from transformers import AutoModelForImageTextToText

    from models.family import read_spec
    from models.inputs import VLMInputs

    model = _hf_model(model_dir, AutoModelForImageTextToText)
    request = prompt.request()
    batch = dict(processor(text=[engine.prompt_text(request)], return_tensors="pt", **engine.processor_media(request)))
    p = batch["input_ids"].shape[1]
    batch["input_ids"] = torch.cat([batch["input_ids"], torch.tensor([response_ids])], 1)
    batch["attention_mask"] = torch.ones_like(batch["input_ids"])
    if "mm_token_type_ids" in batch:  # which tokens are media: none of the response's
        batch["mm_token_type_ids"] = torch.nn.functional.pad(batch["mm_token_type_ids"], (0, len(response_ids)))
    # M-RoPE positions as vLLM and the trainer compute them (tests/dist/vlm_vs_vllm.py checks
    # they are vLLM's): transformers 5.19 starts the text after a Qwen2-VL video 2 positions
    # earlier (the temporal extent left out), which alone moved video logprobs by up to 0.09
    batch["position_ids"] = VLMInputs.from_processor(read_spec(model_dir), dict(batch)).position_ids
    with torch.no_grad():
        logits = model(**batch).logits.float()
    logprobs = torch.log_softmax(logits[0, p - 1:-1], -1)
    return logprobs.gather(-1, torch.tensor(response_ids)[:, None])[:, 0]


_MODELS: dict = {}


def _hf_model(model_dir, cls):
    if model_dir not in _MODELS:
        _MODELS[model_dir] = cls.from_pretrained(model_dir, dtype=torch.float32).eval()
    return _MODELS[model_dir]


def _prompts() -> list[Prompt]:
    rng = random.Random(0)
    image, video = colour_image(rng), moving_ball_video(rng)
    return [Prompt("image", image.question, image.answer, images=[image.image]),
            Prompt("video", video.question, video.answer, videos=[video.video])]


def _prompt_ids(engine):
    tokenizer = engine.tokenizer
    return lambda request: tokenizer.encode(engine.prompt_text(request), add_special_tokens=False)


def test_the_teachers_logprobs_of_sampled_responses_equal_transformers_for_the_same_tokens_and_media(rollout_engine):
    """The tiny policy as its own teacher: its responses to an image and a video prompt, scored
    in-process through the rewarder (the prompt's token ids as the rollout engine saw them, the
    media as it got them), against transformers' forward pass over the same tokens and media."""
    from transformers import AutoProcessor

    model_dir = rollout_engine.cfg.model
    teacher = InProcessTeacher(DistillConfig(teacher=model_dir), engine=Scorer(rollout_engine))
    rewarder = Rewarder(RewardConfig(), Judges(), teacher=teacher, prompt_ids=_prompt_ids(rollout_engine))
    prompts = _prompts()
    result = rollout_engine.generate([p.request() for p in prompts], SamplingConfig(n=2, max_tokens=12, seed=3))
    rewarder.teach(prompts, result.responses)
    processor = AutoProcessor.from_pretrained(model_dir)
    worst = 0.0
    for prompt, group in zip(prompts, result.responses):
        for response in group:
            assert response.token_ids and len(response.teacher_logprobs) == len(response.token_ids)
            theirs = transformers_logprobs(model_dir, processor, rollout_engine, prompt, response.token_ids)
            worst = max(worst, float((torch.tensor(response.teacher_logprobs) - theirs).abs().max()))
            # the teacher is the sampler here: its logprobs are vLLM's own sampled ones
            assert response.teacher_logprobs == pytest.approx(response.logprobs, abs=1e-4)
    print(f"teacher vs transformers, image and video responses: max |logprob diff| {worst:.2e}")
    assert worst < 1e-4  # measured 9.1e-6, fp32 both sides (the trainer/vLLM probe check's bound)
    assert teacher.stats.as_metrics("t") == {"t/scored": 4.0, "t/fallback": 0.0, **{
        f"t/fallback_{r}": 0.0 for r in ("unscorable", "mismatch", "timeout", "unreachable", "http")}}


def test_a_response_the_teacher_cannot_score_is_counted_and_gets_no_logprobs(rollout_engine):
    """One item longer than the teacher's context among scorable ones: it alone goes unscored,
    counted by reason; the others keep their logprobs."""
    teacher = InProcessTeacher(DistillConfig(teacher=rollout_engine.cfg.model), engine=Scorer(rollout_engine))
    prompt_ids = _prompt_ids(rollout_engine)(_prompts()[0].request())
    image = _prompts()[0].images
    items = [TeacherItem(prompt_ids, [11, 12, 13], image),
             TeacherItem(prompt_ids, [11] * (rollout_engine.cfg.max_model_len + 10), image),
             TeacherItem(prompt_ids, [14, 15], image)]
    scores = teacher.score(items)
    assert [s.failure for s in scores] == [None, "unscorable", None]
    assert scores[1].logprobs is None and len(scores[0].logprobs) == 3 and len(scores[2].logprobs) == 2
    metrics = teacher.stats.as_metrics("distill/teacher")
    assert metrics["distill/teacher/fallback_unscorable"] == 1.0 and metrics["distill/teacher/scored"] == 2.0


def test_the_distillation_advantage_equals_a_hand_computation():
    """Two responses of three tokens (the second cut to two), the teacher scoring the first only:
    each scored token's advantage is the reward's minus coef x (student - teacher logprob)."""
    student = torch.tensor([[-1.0, -0.5, -2.0], [-0.3, -0.2, 0.0]])
    teacher = torch.tensor([[-0.5, -1.5, -2.0], [0.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]])  # response 2: the teacher could not score it
    reward_adv = torch.tensor([0.7, -0.7])
    # by hand, coef 0.5: response 1's tokens: 0.7 - 0.5 * (-1 + 0.5), 0.7 - 0.5 * (-0.5 + 1.5), 0.7 - 0
    expected = torch.tensor([[0.95, 0.2, 0.7], [-0.7, -0.7, -0.7]])
    assert torch.allclose(distill_advantages(reward_adv, student, teacher, mask, 0.5, True), expected)
    # alone (pure distillation): the reward's advantage is not added
    alone = torch.tensor([[0.25, -0.5, 0.0], [0.0, 0.0, 0.0]])
    assert torch.allclose(distill_advantages(reward_adv, student, teacher, mask, 0.5, False), alone)
    # a per-token reward advantage (REINFORCE++) takes the same addition token by token
    per_token = reward_adv[:, None].expand(2, 3) * torch.tensor([[1.0, 2.0, 3.0]])
    assert torch.allclose(distill_advantages(per_token, student, teacher, mask, 0.5, True),
                          per_token + (alone - 0.0))


def _rl_config(*overrides: str):
    from yatt_mm.config import load
    from yatt_mm.rl.config import RLConfig

    return load(RLConfig, "configs/tiny_demo.yaml", ["reward.judges=[]", *overrides])


def test_a_teacher_with_another_tokenizer_is_refused_when_the_config_loads(tmp_path, tiny_policy):
    """The teacher scores the student's token ids: a teacher whose tokenizer maps one id to another
    token is refused by check_model (the launcher's, before any rank starts), naming the setting."""
    other = tmp_path / "other-teacher"
    shutil.copytree(tiny_policy, other)
    tokenizer = json.loads((other / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    first = next(iter(vocab))
    vocab["renamed-token"] = vocab.pop(first)
    (other / "tokenizer.json").write_text(json.dumps(tokenizer))
    cfg = _rl_config(f"policy.model={tiny_policy}", f"algorithm.distill.teacher={other}")
    with pytest.raises(ValueError, match="algorithm.distill.teacher=.*its tokenizer is not the student's"):
        cfg.check_model()
    cfg = _rl_config(f"policy.model={tiny_policy}", f"algorithm.distill.teacher={tiny_policy}")
    cfg.check_model()  # the same tokenizer: accepted


@pytest.mark.parametrize("overrides, message", [
    (["algorithm.distill.with_reward=false"], "set dynamic_sampling.enabled=false"),
    (["run.placement=partial"], "set algorithm.distill.backend=server"),
    (["algorithm.distill.coef=0"], "coef=0 gives the teacher's signal no weight"),
    (["rollout.engine.tools.names=[zoom]", "rollout.engine.tools.max_turns=2"], "multi-turn rollouts"),
    (["run.max_staleness=1", "run.placement=disaggregated"], "set run.max_staleness=0"),
])
def test_distillation_settings_that_cannot_run_are_refused_naming_the_fix(overrides, message):
    from yatt_mm.config import ConfigError

    with pytest.raises(ConfigError, match=message):
        _rl_config("algorithm.distill.teacher=tiny:policy", *overrides)


def test_pure_distillation_takes_groups_of_one_response():
    """No reward in the advantage: a group of one has its teacher's signal, so n=1 is accepted."""
    cfg = _rl_config("algorithm.distill.teacher=tiny:policy", "algorithm.distill.with_reward=false",
                     "dynamic_sampling.enabled=false", "rollout.sampling.n=1")
    assert cfg.rollout.sampling.n == 1
