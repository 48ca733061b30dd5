"""What every rule reward shares: the registry rules are found in by name, and `Malformed`, a
rule's 0 that the rewarder counts apart. Its own module so that rule modules (rules.py,
grounding.py) import it and not each other."""

from __future__ import annotations

from typing import Callable

from yatt_mm.registry import Registry

RuleFn = Callable[[str, str, dict], float]


class Malformed(float):
    """A rule's 0 for a response it cannot read (no box in a grounding answer, say): it scores 0
    like any miss, and the rewarder counts it apart (`reward/NAME_malformed`)."""

    def __new__(cls, _value: float = 0.0):  # the argument: pickle rebuilds it from its value
        return super().__new__(cls, 0.0)


RULES: Registry[RuleFn] = Registry("reward function")
rule = RULES.register
get_rule = RULES.get
