"""The tiny model in a real in-process vLLM engine: images, several images, a video."""

import random

from dataio.synth import colour_image, moving_ball_video
from yatt_mm.rollout.engine import Request, SamplingConfig


def _ask(part, question, **media):
    content = [{"type": part} for _ in range(max(len(media.get("images", [])), 1))] + [
        {"type": "text", "text": question}
    ]
    return Request([{"role": "user", "content": content}], **media)


def test_generates_from_image_video_and_two_images(rollout_engine):
    rng = random.Random(0)
    img, img2, vid = colour_image(rng), colour_image(rng), moving_ball_video(rng)
    requests = [
        _ask("image", img.question, images=[img.image]),
        _ask("video", vid.question, videos=[vid.video]),
        _ask("image", "Which is red?", images=[img.image, img2.image]),
    ]
    result = rollout_engine.generate(requests, SamplingConfig(n=3, max_tokens=12, seed=0))
    assert [len(g) for g in result.responses] == [3, 3, 3]
    for group in result.responses:
        for r in group:
            assert 0 < len(r.token_ids) <= 12
            assert len(r.logprobs) == len(r.token_ids)  # one logprob per generated token
            assert all(lp <= 0.0 for lp in r.logprobs)
            assert r.finish_reason in ("length", "stop")
    assert result.generated_tokens == sum(len(r.token_ids) for g in result.responses for r in g)
    # the media reach the model: the same question about another image gives other outputs
    other = rollout_engine.generate([_ask("image", img.question, images=[img2.image])],
                                    SamplingConfig(n=3, max_tokens=12, seed=0))
    assert other.responses[0][0].logprobs != result.responses[0][0].logprobs


def test_seeded_sampling_reproduces(rollout_engine):
    vid = moving_ball_video(random.Random(3))
    request = _ask("video", vid.question, videos=[vid.video])
    a = rollout_engine.generate([request], SamplingConfig(n=2, max_tokens=10, seed=7))
    b = rollout_engine.generate([request], SamplingConfig(n=2, max_tokens=10, seed=7))
    assert [r.token_ids for r in a.responses[0]] == [r.token_ids for r in b.responses[0]]
    assert [r.logprobs for r in a.responses[0]] == [r.logprobs for r in b.responses[0]]
