"""Rule rewards: verifiable checks of a response against the sample's answer.

Chosen by name in config (`reward.functions: [{name: exact_match, weight: 1.0}]`). A rule is a
plain function `(response_text, answer, metadata) -> float`; `@rule("name")` registers one, and
`name: my_module:my_reward` uses anyone's own.
"""

from __future__ import annotations

import re
from typing import Callable

from yatt_mm.registry import Registry

RuleFn = Callable[[str, str, dict], float]
RULES: Registry[RuleFn] = Registry("reward function")
rule = RULES.register
get_rule = RULES.get

_ANSWER_TAG = re.compile(r"answer\s*(?:is)?\s*[:=]?\s*(.+)", re.IGNORECASE)
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def _normalise(text: str) -> str:
    return re.sub(r"[^a-z0-9.\- ]", "", text.lower()).strip()


def extract_answer(response: str) -> str:
    """The text after a final 'Answer:' if present, else the first line of the response."""
    matches = _ANSWER_TAG.findall(response)
    text = matches[-1] if matches else response.strip().split("\n", 1)[0]
    return _normalise(text)


@rule("exact_match")
def exact_match(response: str, answer: str, metadata: dict | None = None) -> float:
    """1 when the extracted answer's first word equals the expected answer."""
    got = extract_answer(response)
    want = _normalise(answer)
    return float(bool(want) and (got == want or got.split(" ", 1)[0] == want))


@rule("contains_answer")
def contains_answer(response: str, answer: str, metadata: dict | None = None) -> float:
    """1 when the expected answer appears as a whole word anywhere in the response. Lenient:
    good for tiny models early in training, when format has not been learnt yet."""
    want = _normalise(answer)
    return float(bool(want) and re.search(rf"\b{re.escape(want)}\b", _normalise(response)) is not None)


@rule("numeric_match")
def numeric_match(response: str, answer: str, metadata: dict | None = None) -> float:
    """1 when the last number in the response equals the expected number (1e-6 tolerance)."""
    nums = _NUMBER.findall(extract_answer(response)) or _NUMBER.findall(response)
    try:
        return float(bool(nums) and abs(float(nums[-1]) - float(answer)) < 1e-6)
    except ValueError:
        return 0.0


@rule("format")
def answer_format(response: str, answer: str, metadata: dict | None = None) -> float:
    """1 when the response ends with a line 'Answer: ...'."""
    lines = [ln for ln in response.strip().splitlines() if ln.strip()]
    return float(bool(lines) and lines[-1].strip().lower().startswith("answer:"))
