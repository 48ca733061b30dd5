"""Rule rewards: verifiable checks of a response against the sample's answer.

Chosen by name in config (`reward.functions: [{name: exact_match, weight: 1.0}]`). A rule is a
plain function `(response_text, answer, metadata) -> float`; `@rule("name")` registers one, and
`name: my_module:my_reward` uses anyone's own.
"""

from __future__ import annotations

import logging
import re
import threading

from yatt_mm.reward import grounding  # noqa: F401 - registers iou, giou and point_in_box
from yatt_mm.reward.rule_base import RULES, Malformed, RuleFn, get_rule, rule  # noqa: F401 - the rules' API

log = logging.getLogger(__name__)

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


# math_verify reads the end of a response, where its final answer is: sympy's time grows with
# what it is given, and outside the main thread (asynchronous RL's rollout thread) Math-Verify's
# own timeout (signal.alarm) cannot run
MATH_TAIL_CHARS = 2000
MATH_TIMEOUT_S = 5
_unparsed_references: set[str] = set()


@rule("math_verify")
def math_equivalent(response: str, answer: str, metadata: dict | None = None) -> float:
    """1 when the response's final answer equals the reference mathematically, by Hugging Face's
    Math-Verify: the last \\boxed{...} first, else LaTeX or a plain expression, compared with
    sympy (2\\sqrt{3} = \\sqrt{12}, 12.5 = 25/2 = \\frac{25}{2}; sets, intervals, units). For
    math answers (geometry3k, MathVista's free-form ones); choices and words: exact_match. A
    reference that does not parse as math scores every response 0, with a warning naming it."""
    from math_verify import parse, verify

    timeout = MATH_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None
    reference = answer if "$" in answer or "\\boxed" in answer else f"${answer}$"
    gold = parse(reference, parsing_timeout=timeout)
    if all(isinstance(g, str) for g in gold):  # parsed, it holds a sympy object beside its text
        if answer not in _unparsed_references and len(_unparsed_references) < 100:
            _unparsed_references.add(answer)
            log.warning("math_verify: the reference answer %r does not parse as math: its responses score 0 "
                        "(for choices and words use exact_match)", answer)
        return 0.0
    got = parse(response[-MATH_TAIL_CHARS:], parsing_timeout=timeout)
    return float(bool(got) and verify(gold, got, timeout_seconds=timeout))

