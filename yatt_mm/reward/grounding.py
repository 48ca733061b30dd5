"""Grounding rewards for vision-language models: a predicted box against the answer's (IoU and
GIoU), and a predicted point inside it (click tasks).

Boxes are [x1, y1, x2, y2] (top-left, bottom-right), either normalised to 0-1 or to 0-1000 (as
Qwen3-VL writes them); each box's own scale is read from its values (all within [0, 1]: 0-1,
else 0-1000), so a prediction and an answer may use different ones. The prediction is parsed
leniently from text: the last four numbers of the response ("[12, 40, 300, 310]", "(12,40),
(300,310)", "x1=12 y1=40 ..."); a point is its last two. A response with no such numbers, or a
degenerate box, scores 0 and is returned as `Malformed`, which the rewarder counts
(`reward/NAME_malformed`): never an exception; nor is an answer without a box (a warning).
"""

from __future__ import annotations

import logging
import re

from yatt_mm.reward.rule_base import Malformed, rule

log = logging.getLogger(__name__)
_unparsed_answers: set[str] = set()
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
Box = tuple[float, float, float, float]


def parse_numbers(text: str, count: int) -> list[float] | None:
    """The last `count` numbers of `text`, or None when it holds fewer."""
    values = [float(v) for v in _NUMBER.findall(text)]
    return values[-count:] if len(values) >= count else None


def normalise(values: list[float]) -> list[float]:
    """To 0-1: values all within [0, 1] are taken as 0-1 already, others as 0-1000."""
    return values if all(0.0 <= v <= 1.0 for v in values) else [v / 1000.0 for v in values]


def parse_box(text: str) -> Box | None:
    """A box from text, on the 0-1 scale, corners ordered; None if there is none or it has no
    area."""
    values = parse_numbers(text, 4)
    if values is None:
        return None
    x1, y1, x2, y2 = normalise(values)
    x1, x2 = sorted((x1, x2))
    y1, y2 = sorted((y1, y2))
    return (x1, y1, x2, y2) if x2 > x1 and y2 > y1 else None


def _area(b: Box) -> float:
    return max(b[2] - b[0], 0.0) * max(b[3] - b[1], 0.0)


def iou(a: Box, b: Box) -> float:
    inter = _area((max(a[0], b[0]), max(a[1], b[1]), min(a[2], b[2]), min(a[3], b[3])))
    union = _area(a) + _area(b) - inter
    return inter / union if union > 0 else 0.0


def giou(a: Box, b: Box) -> float:
    """Generalised IoU (Rezatofighi et al. 2019): IoU minus the share of the smallest enclosing
    box that neither covers, in [-1, 1]: a miss far away scores lower than a near miss."""
    hull = _area((min(a[0], b[0]), min(a[1], b[1]), max(a[2], b[2]), max(a[3], b[3])))
    inter = _area((max(a[0], b[0]), max(a[1], b[1]), min(a[2], b[2]), min(a[3], b[3])))
    union = _area(a) + _area(b) - inter
    return iou(a, b) - (hull - union) / hull if hull > 0 else 0.0


def _answer_box(answer: str) -> Box | None:
    """The reference box; None (its responses score 0, with a warning naming it, once) when the
    data's answer holds none: a sample's fault, not a reason to stop the run."""
    box = parse_box(answer)
    if box is None and answer not in _unparsed_answers and len(_unparsed_answers) < 100:
        _unparsed_answers.add(answer)
        log.warning("grounding reward: the answer %r holds no box [x1, y1, x2, y2]: its responses score 0", answer)
    return box


@rule("iou")
def iou_reward(response: str, answer: str, metadata: dict | None = None) -> float:
    """IoU of the response's box with the answer's, in [0, 1]."""
    pred, want = parse_box(response), _answer_box(answer)
    return Malformed() if pred is None else iou(pred, want) if want else 0.0


@rule("giou")
def giou_reward(response: str, answer: str, metadata: dict | None = None) -> float:
    """GIoU of the response's box with the answer's, rescaled from [-1, 1] to [0, 1]."""
    pred, want = parse_box(response), _answer_box(answer)
    return Malformed() if pred is None else (giou(pred, want) + 1) / 2 if want else 0.0


@rule("point_in_box")
def point_in_box(response: str, answer: str, metadata: dict | None = None) -> float:
    """1 when the response's point (its last two numbers, x then y) lies inside the answer's box."""
    values, want = parse_numbers(response, 2), _answer_box(answer)
    if values is None:
        return Malformed()
    if want is None:
        return 0.0
    x, y = normalise(values)
    return float(want[0] <= x <= want[2] and want[1] <= y <= want[3])
