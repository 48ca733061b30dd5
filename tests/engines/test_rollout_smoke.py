"""The tiny model in a real in-process vLLM engine: images, several images, a video."""

import random

from dataio.synth import colour_image, moving_ball_video
from yatt_mm.engines.engine import Request, SamplingConfig


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


def test_streaming_hands_over_each_prompt_once_with_the_same_responses(rollout_engine):
    """Partial colocation's hand-over: every prompt's responses reach the callback once, as the
    result has them, and greedy answers equal those of a plain (batch) generate."""
    rng = random.Random(5)
    samples = [colour_image(rng) for _ in range(3)]
    vid = moving_ball_video(rng)
    requests = [_ask("image", s.question, images=[s.image]) for s in samples]
    requests.append(_ask("video", vid.question, videos=[vid.video]))
    greedy = SamplingConfig(n=1, max_tokens=8, temperature=0.0)
    handed: dict[int, list] = {}
    streamed = rollout_engine.generate(requests, greedy, on_finished=lambda i, rs: handed.setdefault(i, []).append(rs))
    assert sorted(handed) == [0, 1, 2, 3] and all(len(v) == 1 for v in handed.values())
    assert [handed[i][0] for i in range(4)] == streamed.responses
    batch = rollout_engine.generate(requests, greedy)
    assert [[r.token_ids for r in g] for g in streamed.responses] == [[r.token_ids for r in g] for g in batch.responses]


def test_each_sample_is_handed_over_once_as_it_finishes_before_its_prompt_is(rollout_engine):
    """Partial colocation streams every sample to the judges the moment it is done, not when its
    prompt's last sample is: each (prompt, sample) reaches `on_sample` once, with what the result
    holds, and a prompt reaches `on_finished` only after all its samples did."""
    rng = random.Random(6)
    requests = [_ask("image", s.question, images=[s.image]) for s in (colour_image(rng) for _ in range(3))]
    events: list[tuple] = []
    result = rollout_engine.generate(requests, SamplingConfig(n=3, max_tokens=6, seed=3),
                                     on_finished=lambda i, rs: events.append(("prompt", i, rs)),
                                     on_sample=lambda i, j, r: events.append(("sample", i, j, r)))
    samples = [e for e in events if e[0] == "sample"]
    assert sorted((i, j) for _, i, j, _ in samples) == [(i, j) for i in range(3) for j in range(3)]
    assert all(r == result.responses[i][j] for _, i, j, r in samples)
    for k, event in enumerate(events):
        if event[0] == "prompt":
            _, i, responses = event
            assert responses == result.responses[i]
            assert {j for e in events[:k] if e[0] == "sample" and e[1] == i for j in [e[2]]} == {0, 1, 2}
    # seeded: the streamed samples are those of a plain generate with the same seed
    plain = rollout_engine.generate(requests, SamplingConfig(n=3, max_tokens=6, seed=3))
    assert [[r.token_ids for r in g] for g in plain.responses] == [[r.token_ids for r in g] for g in result.responses]


def test_a_prompts_short_samples_are_handed_over_while_its_long_ones_still_generate(rollout_engine, tiny_policy,
                                                                                   warm_policy):
    """The warm-started policy stops after a varying number of tokens: samples of one prompt end
    at different engine steps. Handed over as each ends, one prompt's samples are interleaved
    with other prompts' (vLLM's own n > 1 output would hand a prompt's samples over together).
    The session's engine runs the warm policy's weights for this test (a second engine in this
    process would, when freed, take vLLM's process groups down with it)."""
    from safetensors.torch import load_file

    rng = random.Random(8)
    requests = [_ask("image", s.question, images=[s.image]) for s in (colour_image(rng) for _ in range(4))]
    order: list[int] = []
    rollout_engine.update_weights(load_file(str(warm_policy / "model.safetensors")).items())
    try:
        result = rollout_engine.generate(requests, SamplingConfig(n=4, max_tokens=8, temperature=1.5, seed=5),
                                         on_sample=lambda i, j, r: order.append(i))
    finally:
        rollout_engine.update_weights(load_file(str(tiny_policy / "model.safetensors")).items())
    lengths = {len(r.token_ids) for g in result.responses for r in g}
    assert len(lengths) > 1, lengths  # the mix varies, or the test shows nothing
    runs = sum(1 for a, b in zip(order, order[1:]) if a != b) + 1  # stretches of one prompt's samples
    assert runs > len(requests), order  # some prompt's samples came apart, others' in between


def test_weight_sync_changes_outputs_and_restoring_restores_exactly(rollout_engine, tiny_policy):
    import torch
    from safetensors.torch import load_file

    img = colour_image(random.Random(5))
    request = [_ask("image", img.question, images=[img.image])]
    sampling = SamplingConfig(n=2, max_tokens=8, seed=11)
    before = rollout_engine.generate(request, sampling).responses[0]
    original = load_file(str(tiny_policy / "model.safetensors"))
    torch.manual_seed(0)
    perturbed = {k: v + 0.05 * torch.randn_like(v) for k, v in original.items()}
    try:
        info = rollout_engine.update_weights(perturbed.items())
        assert info["bytes"] == sum(v.numel() * 4 for v in original.values())
        changed = rollout_engine.generate(request, sampling).responses[0]
        assert [r.logprobs for r in changed] != [r.logprobs for r in before]
    finally:
        rollout_engine.update_weights(original.items())
    restored = rollout_engine.generate(request, sampling).responses[0]
    assert [r.token_ids for r in restored] == [r.token_ids for r in before]
    assert [r.logprobs for r in restored] == [r.logprobs for r in before]


def test_responses_never_hold_a_media_placeholder_token(rollout_engine, tiny_policy):
    """A policy samples its media placeholder tokens (image/video pad, vision start/end) now and
    then (the tiny one at temperature 2 often; a warm-started one early in RL did), and a
    response holding one could not be trained on. The engine keeps them out by default; its logprobs stay the raw ones (the
    trainer's), so the responses agree token for token with the unbiased engine's up to where
    that one drew a placeholder."""
    import json

    ids = json.loads((tiny_policy / "config.json").read_text())
    placeholders = {ids[k] for k in ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")}
    assert rollout_engine.no_media_tokens and set(rollout_engine.no_media_tokens) == placeholders
    rng = random.Random(5)
    requests = [_ask("image", c.question, images=[c.image]) for c in (colour_image(rng) for _ in range(8))]
    sampling = SamplingConfig(n=8, max_tokens=32, temperature=2.0, seed=11)
    kept_out = [r for g in rollout_engine.generate(requests, sampling).responses for r in g]
    bias, rollout_engine.no_media_tokens = rollout_engine.no_media_tokens, None
    try:
        free = [r for g in rollout_engine.generate(requests, sampling).responses for r in g]
    finally:
        rollout_engine.no_media_tokens = bias
    assert not [r.token_ids for r in kept_out if placeholders & set(r.token_ids)]
    drew = [r for r in free if placeholders & set(r.token_ids)]
    assert drew, "no placeholder drawn: the check above proves nothing"
    for a, b in zip(kept_out, free):
        first = next((i for i, t in enumerate(b.token_ids) if t in placeholders), len(b.token_ids))
        assert a.token_ids[:first] == b.token_ids[:first] and a.logprobs[:first] == b.logprobs[:first]
