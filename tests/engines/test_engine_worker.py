"""The disaggregated placement's engine worker (yatt_mm/engines/worker.py): the tiny policy's
vLLM engine in a process of its own, reached from this one. It must be indistinguishable from the
in-process engine the other placements use: the same prompts, the same greedy tokens and
logprobs, the same streaming hand-overs, and after a weight update broadcast over its weights
group (gloo here), the same outputs as the in-process engine given the same weights; and with
partial rollout, weights that arrive mid-generation are taken between two engine steps."""

import random
import threading
import time

import pytest
import torch
from safetensors.torch import load_file

from dataio.synth import colour_image, moving_ball_video
from yatt_mm.engines.engine import EngineConfig, Request, SamplingConfig
from yatt_mm.engines.worker import EngineWorker, RemoteEngine


def _ask(part, question, **media):
    return Request([{"role": "user", "content": [{"type": part}, {"type": "text", "text": question}]}], **media)


def _greedy(engine, requests):
    result = engine.generate(requests, SamplingConfig(n=1, max_tokens=8, temperature=0.0))
    return [(g[0].token_ids, g[0].logprobs) for g in result.responses]


@pytest.fixture(scope="module")
def worker(tiny_policy, tmp_path_factory):
    w = EngineWorker({"rollout": EngineConfig(model=str(tiny_policy))}, tmp_path_factory.mktemp("worker") / "w.log")
    yield w
    w.close()
    assert w.proc.returncode == 0  # stopped when asked, not killed


def test_worker_engine_equals_the_in_process_one_before_and_after_a_weight_update(worker, rollout_engine, tiny_policy):
    remote = worker.engine("rollout")
    rng = random.Random(11)
    img, vid = colour_image(rng), moving_ball_video(rng)
    requests = [_ask("image", img.question, images=[img.image]), _ask("video", vid.question, videos=[vid.video])]
    assert [remote.prompt_text(r) for r in requests] == [rollout_engine.prompt_text(r) for r in requests]
    before = _greedy(remote, requests)
    assert before == _greedy(rollout_engine, requests)  # tokens and logprobs, exactly

    seen, finished = [], {}
    result = remote.generate(requests, SamplingConfig(n=3, max_tokens=6),
                             on_sample=lambda i, j, r: seen.append((i, j, r.token_ids)),
                             on_finished=lambda i, rs: finished.setdefault(i, []).append(rs))
    assert sorted((i, j) for i, j, _ in seen) == [(i, j) for i in range(2) for j in range(3)]
    assert {i: v[0] for i, v in finished.items()} == dict(enumerate(result.responses))
    assert all(result.responses[i][j].token_ids == ids for i, j, ids in seen)

    original, moved = _weights(tiny_policy, 0.02)
    try:
        info = remote.update_weights(moved.items())
        assert info["tensors"] == len(moved) and info["bytes"] == sum(v.numel() * v.element_size() for v in moved.values())
        rollout_engine.update_weights(moved.items())
        after = _greedy(remote, requests)
        assert after != before and after == _greedy(rollout_engine, requests)
    finally:  # the session's engine is shared: give it its weights back
        rollout_engine.update_weights(original.items())
        remote.update_weights(original.items())
    assert _greedy(remote, requests) == before


def test_a_failing_call_raises_with_the_workers_traceback_and_the_worker_lives_on(worker):
    with pytest.raises(RuntimeError, match="failed there:(.|\n)*KeyError: 'judge:nobody'"):
        RemoteEngine(worker, "judge:nobody").prompt_text(_ask("image", "?"))
    assert worker.pids and worker.engine("rollout").prompt_text(_ask("image", "?"))


def _weights(tiny_policy, scale: float) -> tuple[dict, dict]:
    original = {}
    for path in sorted(tiny_policy.glob("*.safetensors")):
        original |= load_file(path)
    gen = torch.Generator().manual_seed(0)
    moved = {k: v + scale * torch.randn(v.shape, generator=gen).to(v.dtype) if v.is_floating_point() else v
             for k, v in original.items()}
    return original, moved


def test_partial_rollout_loads_weights_between_engine_steps_and_the_responses_say_so(worker, rollout_engine,
                                                                                    tiny_policy):
    """run.partial_rollout: weights pushed while a generation runs are loaded whole between two
    engine steps; the responses in flight go on with them (their first tokens are the old
    weights', later ones not) and count the update; the caches of the old weights are dropped
    once the generation ends."""
    remote = worker.engine("rollout")
    rng = random.Random(4)
    requests = [_ask("image", img.question, images=[img.image]) for img in (colour_image(rng), colour_image(rng))]
    long_greedy = SamplingConfig(n=1, max_tokens=1000, temperature=0.0)
    old = [g[0] for g in remote.generate(requests, long_greedy).responses]
    assert all(len(r.token_ids) > 100 and r.weight_updates == 0 for r in old)
    original, moved = _weights(tiny_policy, 0.02)
    worker.partial_rollout = True
    try:
        result = {}
        thread = threading.Thread(target=lambda: result.update(r=remote.generate(requests, long_greedy)))
        thread.start()
        time.sleep(0.5)  # the generation is under way (1000 steps take several seconds here, also under load)
        remote.update_weights(moved.items(), partial=True)
        remote.weights_loaded()
        thread.join()
        rollout_engine.update_weights(moved.items())
        for (response,), before in zip(result["r"].responses, old):
            assert response.weight_updates == 1
            same = next((k for k, pair in enumerate(zip(zip(response.token_ids, response.logprobs),
                                                         zip(before.token_ids, before.logprobs))) if pair[0] != pair[1]),
                        len(response.token_ids))
            assert 1 <= same < len(response.token_ids)  # begun on the old weights, gone on with others
        # the prefix cache holds the old weights' prompt: dropped, the next generation is the new weights' own
        assert _greedy(remote, requests) == _greedy(rollout_engine, requests)
    finally:
        worker.partial_rollout = False
        rollout_engine.update_weights(original.items())
        remote.update_weights(original.items())
        remote.weights_loaded()
    # the old weights back: the old responses again (their first 200 tokens: greedy decoding of the
    # same batch, so a prefix of the whole; a full-length rerun would double the test's cost)
    again = remote.generate(requests, SamplingConfig(n=1, max_tokens=200, temperature=0.0)).responses
    assert [(g[0].token_ids, g[0].logprobs) for g in again] == [(r.token_ids[:200], r.logprobs[:200]) for r in old]


def test_a_teacher_in_the_worker_scores_as_the_in_process_one(worker, rollout_engine):
    """The disaggregated placement's in-process distillation teacher sits in the engine worker
    (yatt_mm/rl/train.py): its prompt logprobs of an image and a video response, reached through
    the worker, are the in-process engine's exactly; a request over the context is unscored there
    too, alone."""
    from yatt_mm.engines.scoring import Scorer
    from yatt_mm.reward.teacher import DistillConfig, InProcessTeacher, TeacherItem

    rng = random.Random(12)
    img, vid = colour_image(rng), moving_ball_video(rng)
    requests = [_ask("image", img.question, images=[img.image]), _ask("video", vid.question, videos=[vid.video])]
    items = [TeacherItem(rollout_engine.tokenizer.encode(rollout_engine.prompt_text(r), add_special_tokens=False),
                         ids, r.images, r.videos) for r, (ids, _) in zip(requests, _greedy(rollout_engine, requests))]
    items.append(TeacherItem(items[0].prompt_ids, [11] * (rollout_engine.cfg.max_model_len + 10), items[0].images))
    cfg = DistillConfig(teacher=rollout_engine.cfg.model)
    remote = InProcessTeacher(cfg, engine=worker.engine("rollout")).score(items)
    local = InProcessTeacher(cfg, engine=Scorer(rollout_engine)).score(items)
    assert [s.logprobs for s in remote] == [s.logprobs for s in local]
    assert [s.failure for s in remote] == [None, None, "unscorable"]
    assert [len(s.logprobs) for s in remote[:2]] == [len(it.response_ids) for it in items[:2]] != [0, 0]
