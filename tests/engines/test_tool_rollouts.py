"""Multi-turn rollouts in a real in-process vLLM engine: the tiny policy warm-started to call
`zoom` gets the tool's reply (text and the enlarged image) as its next turn and answers."""

import random
from contextlib import contextmanager

from dataio.synth import colour_image
from yatt_mm.engines.engine import Request, SamplingConfig


def _requests(n=4, seed=0):
    rng = random.Random(seed)
    samples = [colour_image(rng) for _ in range(n)]
    return [Request([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": s.question}]}],
                    images=[s.image], seed=100 + i) for i, s in enumerate(samples)], samples


@contextmanager
def _setting(cfg, name, value):
    old = getattr(cfg, name)
    setattr(cfg, name, value)
    try:
        yield
    finally:
        setattr(cfg, name, old)


def test_a_turn_that_calls_the_tool_gets_its_reply_and_the_answer_follows(tools_engine):
    requests, samples = _requests()
    sampling = SamplingConfig(n=3, max_tokens=40, temperature=1.0)
    streamed = {}
    result = tools_engine.generate(requests, sampling, on_sample=lambda i, j, r: streamed.setdefault((i, j), r))
    responses = [r for group in result.responses for r in group]
    multi = [r for r in responses if r.turns == 2]
    assert len(multi) >= len(responses) * 2 // 3  # the warm start calls the tool in most responses
    tok = tools_engine.tokenizer
    for r in multi:
        mask = r.tool_mask
        assert len(mask) == len(r.token_ids) == len(r.logprobs) and r.tool_calls == 1 and len(r.images) == 1
        # sampled turn, the reply, sampled turn: in that order, the reply with logprob 0
        first, last = mask.index(True), len(mask) - 1 - mask[::-1].index(True)
        assert not any(mask[:first]) and all(mask[first:last + 1]) and not any(mask[last + 1:])
        assert all(lp == 0.0 for lp, m in zip(r.logprobs, mask) if m) and all(lp <= 0 for lp in r.logprobs)
        reply = tok.decode(r.token_ids[first:last + 1])
        assert "<tool_response>\nzoomed into" in reply and reply.count("<|image_pad|>") == 1
        assert '<tool_call>{"name": "zoom"}</tool_call>' in tok.decode(r.token_ids[:first])
        assert r.text == tok.decode(r.token_ids[last + 1:], skip_special_tokens=True)  # the answer alone
        assert r.sampled_tokens == len(mask) - (last + 1 - first)
    # the answers read the zoomed image: mostly right
    right = sum(r.text.strip() == s.answer for group, s in zip(result.responses, samples) for r in group if r.turns == 2)
    assert right >= len(multi) // 2
    assert result.generated_tokens == sum(r.sampled_tokens for r in responses)
    # streamed: each sample once, when its whole conversation ended
    assert {k: v.token_ids for k, v in streamed.items()} == {
        (i, j): r.token_ids for i, g in enumerate(result.responses) for j, r in enumerate(g)}
    # seeded requests: the next turns too draw the same again
    again = tools_engine.generate(requests, sampling)
    assert [[r.token_ids for r in g] for g in again.responses] == [[r.token_ids for r in g] for g in result.responses]


def test_the_conversation_ends_at_max_turns_or_when_the_reply_would_not_fit(tools_engine):
    requests, _ = _requests(2, seed=1)
    sampling = SamplingConfig(n=1, max_tokens=40, temperature=0.0)
    with _setting(tools_engine.cfg.tools, "max_turns", 1):
        one = tools_engine.generate(requests, sampling)
    for r in (r for g in one.responses for r in g):
        assert r.turns == 1 and r.tool_mask is None and "<tool_call>" in r.text  # the call, unanswered
    prompt = one.prompt_tokens // len(requests)
    turn = len(one.responses[0][0].token_ids)
    with _setting(tools_engine.cfg, "max_model_len", prompt + turn + 20):  # the reply with its image: more
        cut = tools_engine.generate(requests, sampling)
    for r in (r for g in cut.responses for r in g):
        assert r.finish_reason == "length" and r.turns == 1 and r.tool_calls == 0 and not r.images
    full = tools_engine.generate(requests, sampling)
    assert all(r.turns == 2 and r.finish_reason == "stop" for g in full.responses for r in g)


def test_weights_loaded_between_two_engine_steps_mid_conversation(tools_engine):
    """Partial rollout loads new weights into a generation in flight. vLLM's reload empties the
    runner's encoder cache but not the scheduler's record of it: a tool reply's next turn (the
    prompt's image again) was scheduled as cached and the runner failed with "Encoder cache miss".
    Reloading the engine's own weights every few steps must change nothing."""
    from safetensors.torch import load_file

    weights = list(load_file(f"{tools_engine.cfg.model}/model.safetensors").items())
    requests, _ = _requests(4, seed=2)
    sampling = SamplingConfig(n=2, max_tokens=40, temperature=1.0)
    steps = []

    def reload_every_third_step():
        steps.append(len(steps))
        if len(steps) % 3:
            return False
        tools_engine.update_weights(weights, reset_caches=False)  # as the engine worker does mid-generation
        return True

    reloaded = tools_engine.generate(requests, sampling, between_steps=reload_every_third_step)
    tools_engine.reset_caches()
    plain = tools_engine.generate(requests, sampling)
    responses = [r for g in reloaded.responses for r in g]
    assert sum(r.turns == 2 for r in responses) >= len(responses) // 2  # the next turns ran after reloads
    assert all(r.weight_updates > 0 for r in responses)  # every conversation saw a reload
    assert [[r.token_ids for r in g] for g in reloaded.responses] == [[r.token_ids for r in g] for g in plain.responses]
