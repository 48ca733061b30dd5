"""The demo's SFT example builders (the warm starts), on the synthetic tasks of `dataio.synth`.

Named in an SFT config as `examples: yatt_mm.demo.examples:NAME`:
- `random_answer_example`: question -> a random answer of the sample's task (a uniformly drawn
  colour for a colour question): teaches the answer *format* only; scored against the true answers;
- `judge_example`: GenRM judge prompt (question, media, response, reference) -> 'Score: 1' or
  'Score: 0' by the rule `exact_match(response, answer)`; responses are the true answer or a wrong
  one of the same task, half each, and near misses (see `judge_response`);
- `judge_compare_example`: verdicts on text-only prompts holding just the reference and the
  response (`genrm.COMPARE_TEMPLATE`), true or wrong answers only: the judge's first stage.
"""

from __future__ import annotations

import random

from yatt_mm.reward.genrm import COMPARE_TEMPLATE, JudgeConfig, JudgeItem, judge_messages
from yatt_mm.reward.rules import exact_match
from yatt_mm.sft.examples import Example, answer_example, example_builder

# Answers of each synthetic task (dataio.synth), by the task name's last part: what a random or
# wrong answer of that task is drawn from.
TASK_CHOICES: dict[str, list[str]] = {
    "colour": ["blue", "green", "red", "yellow"],
    "direction": ["down", "left", "right", "up"],
    "count": ["1", "2", "3", "4", "5", "6"],
}


def task_choices(sample) -> list[str] | None:
    task = str(sample.metadata.get("task", ""))
    return TASK_CHOICES.get(task.rsplit("/", 1)[-1])


@example_builder(eval_with=answer_example)
def random_answer_example(sample, rng: random.Random) -> Example | str:
    choices = task_choices(sample)
    if not choices:
        return "no_answer_choices"
    ex = answer_example(sample, rng)
    ex.target = f"{rng.choice(choices)}<|im_end|>"
    return ex


def judge_response(answer: str, choices: list[str], rng: random.Random, near_misses: bool) -> str:
    """A response for the judge to grade: the true answer or a wrong one of the task, half each;
    with `near_misses`, a third of them instead look like an early policy's slips (a cut-off
    word, a doubled letter, two words run together, a capitalised answer), graded by the same
    rule, so the judge learns where the rule draws its line."""
    wrong = [c for c in choices if c != answer]
    if near_misses and rng.random() < 1 / 3:
        other = rng.choice(wrong or choices)
        return rng.choice([answer[:rng.randint(1, max(1, len(answer) - 1))], answer + answer[-1],
                           answer[:2] + other[2:], other[:2] + answer[2:], answer.capitalize()])
    return answer if rng.random() < 0.5 or not wrong else rng.choice(wrong)


@example_builder()
def judge_example(sample, rng: random.Random, compare_only: bool = False) -> Example | str:
    choices = task_choices(sample)
    if not choices:
        return "no_answer_choices"
    response = judge_response(sample.answer, choices, rng, near_misses=not compare_only)
    verdict = int(exact_match(response, sample.answer))
    if compare_only:  # text only: the reference and the response, no question, no media
        item, cfg = JudgeItem("", response, sample.answer), JudgeConfig(template=COMPARE_TEMPLATE)
    else:
        item, cfg = JudgeItem(sample.prompt, response, sample.answer, sample.images, sample.videos), JudgeConfig()
    return Example(sample.key, judge_messages(cfg, item), item.images, item.videos, f"Score: {verdict}<|im_end|>")


@example_builder()
def judge_compare_example(sample, rng: random.Random) -> Example | str:
    return judge_example(sample, rng, compare_only=True)


ZOOM_CALL = '<tool_call>{"name": "zoom"}</tool_call>'


@example_builder()
def zoom_example(sample, rng: random.Random) -> Example | str:
    """The tool-using policy's warm start (`warmstart:tools`, for multi-turn rollouts with the
    built-in `zoom` tool): half the examples teach the first turn (question -> a zoom call), half
    the second (question, the call, the tool's reply with the zoomed image -> the answer). The
    reply is the one `zoom` gives, rendered as the rollout engine renders it."""
    from yatt_mm.engines.tools import zoom

    if len(sample.images) != 1 or sample.videos:
        return "not_one_image"
    question = [{"type": "image"}, {"type": "text", "text": sample.prompt}]
    if rng.random() < 0.5:
        return Example(sample.key, [{"role": "user", "content": question}], sample.images, [], f"{ZOOM_CALL}<|im_end|>")
    reply = zoom(list(sample.images))
    messages = [{"role": "user", "content": question}, {"role": "assistant", "content": ZOOM_CALL},
                {"role": "user", "content": [{"type": "image"},
                                             {"type": "text", "text": f"<tool_response>\n{reply.text}\n</tool_response>"}]}]
    return Example(sample.key, messages, [*sample.images, *reply.images], [], f"{sample.answer}<|im_end|>")
