"""The controller on in-process fakes of nothing but the rollout engine's outputs: real prompts
and images, the real rewarder, dynamic sampler, sample builder (the tiny policy's processor) and
placement runner."""

from __future__ import annotations

import pytest
from PIL import Image

from yatt_mm.engines.engine import GenerationResult, Response, SamplingConfig
from yatt_mm.metrics import Timeline
from yatt_mm.reward.judges import Judges
from yatt_mm.reward.rewarder import RewardConfig, Rewarder
from yatt_mm.reward.rules import exact_match
from yatt_mm.rl.algorithms import AlgorithmConfig
from yatt_mm.rl.controller import Controller
from yatt_mm.rl.dynamic_sampling import DynamicSampler, DynamicSamplingConfig
from yatt_mm.rl.placement import PhaseRunner, full_colocation
from yatt_mm.rl.samples import Prompt, SampleBuilder
from yatt_mm.rl.config import EvalSet
from yatt_mm.rl.evaluation import HeldOut, metrics
from yatt_mm.rl.sources import PromptSource


class ScriptedEngine:
    """Answers each prompt with the texts its script gives for that prompt's key."""

    def __init__(self, tokenizer, script: dict[str, list[str]]):
        self.tokenizer, self.script, self.calls, self.seeds = tokenizer, script, [], []

    def prompt_text(self, request) -> str:
        return self.tokenizer.apply_chat_template(request.messages, tokenize=False, add_generation_prompt=True)

    def generate(self, requests, sampling: SamplingConfig, on_finished=None, on_sample=None) -> GenerationResult:
        self.calls.append(len(requests))
        self.seeds.append([r.seed for r in requests])
        keys = [r.messages[0]["content"][-1]["text"].split("#")[-1] for r in requests]
        responses = []
        for p, key in enumerate(keys):
            texts = self.script[key][: sampling.n]
            # like vLLM: an answer longer than the limit is cut there, finish reason "length"
            ids = [self.tokenizer.encode(t, add_special_tokens=False) for t in texts]
            cut = [i[: sampling.max_tokens] for i in ids]
            responses.append([Response(c, self.tokenizer.decode(c), [-0.5] * len(c),
                                       "length" if len(i) > sampling.max_tokens else "stop")
                              for i, c in zip(ids, cut)])
            for j, r in enumerate(responses[-1]):
                if on_sample is not None:
                    on_sample(p, j, r)
            if on_finished is not None:
                on_finished(p, responses[-1])
        return GenerationResult(responses, 0.01, 0, sum(len(r.token_ids) for g in responses for r in g))


class ListSource(PromptSource):
    def __init__(self, prompts):
        self.prompts = list(prompts)

    def take(self, n):
        out, self.prompts = self.prompts[:n], self.prompts[n:]
        return out


def _prompt(key: str, answer: str) -> Prompt:
    return Prompt(key, f"What colour is it? #{key}", answer, images=[Image.new("RGB", (56, 56), answer)])


@pytest.fixture(scope="module")
def processor(tiny_policy):
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(str(tiny_policy))


def _controller(processor, prompts, script, algorithm=None):
    engine = ScriptedEngine(processor.tokenizer, script)
    timeline = Timeline(0)
    phases = PhaseRunner(full_colocation(), {}, timeline)
    ctrl = Controller(ListSource(prompts), engine, Rewarder(RewardConfig(), Judges()),
                      DynamicSampler(DynamicSamplingConfig(max_waves=3, initial_valid_rate=1.0, oversample=1.0)),
                      SamplingConfig(n=4, max_tokens=4), SampleBuilder(processor, engine.prompt_text),
                      algorithm or AlgorithmConfig(), phases)
    return ctrl, engine, timeline


def test_step_keeps_groups_with_spread_and_draws_another_wave_for_the_rest(processor):
    prompts = [_prompt("a", "red"), _prompt("b", "blue"), _prompt("c", "green"), _prompt("d", "red")]
    script = {"a": ["red", "blue", "red", "red"],     # rewards 1 0 1 1: valid
              "b": ["blue", "blue", "blue", "blue"],  # all right: no spread, dropped
              "c": ["green", "red", "red", "red"],    # valid
              "d": ["red", "red", "blue", "blue"]}    # valid
    ctrl, engine, timeline = _controller(processor, prompts, script)
    groups, stats = ctrl.step(step=0, target=3)
    assert engine.calls[0] == 3 and len(engine.calls) == 2  # one group dropped: a second wave
    assert [g[0].group_id for g in groups] == ["a", "c", "d"]
    assert stats.responses == 16 and stats.reward_sum == 3 + 4 + 1 + 2 and stats.waves == 2
    assert stats.valid_generated == 3 and stats.padded == 0
    assert stats.reward_counts["exact_match/n"] == 16 and stats.reward_counts["exact_match/sum"] == 10
    # GRPO advantages within group a: (r - mean) / std, the wrong answer strongly negative
    adv = [s.advantage for s in groups[0]]
    assert adv[1] < 0 < adv[0] and sum(adv) == pytest.approx(0, abs=5e-7)  # measured 6.0e-8 (float32)
    # measured 1.0e-6 and 3.0e-6 off: the 1e-6 the std is padded with
    assert adv[0] == pytest.approx(0.5, abs=1e-5) and adv[1] == pytest.approx(-1.5, abs=1e-5)
    # each sample: the loss mask covers exactly the response tokens, with vLLM's logprobs there
    s = groups[0][1]
    n_resp = len(processor.tokenizer.encode("blue", add_special_tokens=False))
    assert int(s.loss_mask.sum()) == n_resp and float(s.rollout_logprobs.sum()) == pytest.approx(-0.5 * n_resp)
    assert {p["phase"] for p in timeline.spans} >= {"rollout", "reward", "prepare"}


def test_truncated_answers_get_dapos_soft_penalty_and_leave_the_loss(processor):
    """Answers cut at the 4-token limit: DAPO's soft penalty (full at the limit) lowers their
    reward before dynamic sampling and the advantages see it, and overlong.filter keeps them out
    of the loss; the rollout metrics count them."""
    long = "blue blue blue blue blue blue"  # wrong, and cut
    assert len(processor.tokenizer.encode(long, add_special_tokens=False)) > 4
    blue = len(processor.tokenizer.encode("blue", add_special_tokens=False))  # within the buffer from 3 tokens
    algorithm = AlgorithmConfig()
    algorithm.overlong.filter = True
    algorithm.overlong.soft_penalty.buffer, algorithm.overlong.soft_penalty.penalty = 2, 0.5
    ctrl, _, _ = _controller(processor, [_prompt("a", "red")], {"a": ["red", long, "blue", long]}, algorithm)
    groups, stats = ctrl.step(step=0, target=1)
    (samples,) = groups
    assert [s.truncated for s in samples] == [False, True, False, True]
    assert [s.filtered for s in samples] == [False, True, False, True]  # truncated: out of the loss
    assert not any(s.masked for s in samples)  # but in their group (its baseline), not padding
    # exact match, minus 0.5 at the limit and linearly less over the 2 tokens before it
    assert [s.reward for s in samples] == [1.0, -0.5, -max(blue - 2, 0) / 2 * 0.5, -0.5]
    assert samples[1].advantage < samples[2].advantage < samples[0].advantage  # the penalty reached them
    assert samples[1].advantage == samples[3].advantage
    metrics = stats.metrics(["exact_match"], [])
    assert metrics["rollout/truncated_rate"] == 0.5
    assert metrics["rollout/overlong_penalty"] == pytest.approx((-1.0 - max(blue - 2, 0) / 4) / 4)


def test_starved_step_pads_with_masked_groups(processor):
    prompts = [_prompt(k, "red") for k in "abcdef"]
    script = {k: ["red"] * 4 for k in "abcdef"}  # always right: nothing to learn
    ctrl, _, _ = _controller(processor, prompts, script)
    groups, stats = ctrl.step(step=0, target=2)
    assert len(groups) == 2 and stats.padded == 2
    assert all(s.masked and s.advantage == 0 for g in groups for s in g)


def test_evaluate_scores_greedy_or_k_sampled_answers_with_the_rule(processor):
    prompts = [_prompt("a", "red"), _prompt("b", "blue")]
    ctrl, _, timeline = _controller(processor, [], {"a": ["red", "blue", "red"], "b": ["green", "blue", "green"]})
    greedy = HeldOut(EvalSet("", ["x"], 2, 4, "exact_match", 1, 0.0), exact_match, prompts)
    assert ctrl.evaluate(greedy, step=0) == {"/mean": 1.0, "/best": 1.0, "/n": 2.0}
    assert any(p["phase"] == "eval" for p in timeline.spans)
    # 3 answers each: the sums over prompts of the mean (2/3 + 1/3) and of the best (1 + 1)
    sampled = HeldOut(EvalSet("geo", ["x"], 2, 4, "exact_match", 3, 1.0), exact_match, prompts)
    assert ctrl.evaluate(sampled, step=0) == {"geo/mean": pytest.approx(1.0), "geo/best": 2.0, "geo/n": 2.0}
    m = metrics([greedy, sampled], {"/mean": 1.0, "/best": 1.0, "/n": 2.0, "geo/mean": 1.0, "geo/best": 2.0, "geo/n": 2.0})
    assert m == {"eval/reward_mean": 0.5, "eval/geo/reward_mean": 0.5, "eval/geo/pass_at_3": 1.0}
    # greedy asks for no seed; sampled answers are seeded by the prompt alone: the same draw at every eval
    ctrl.evaluate(sampled, step=5)
    no_seed, first, again = ctrl.engine.seeds
    assert no_seed == [None, None] and None not in first and len(set(first)) == 2 and again == first
