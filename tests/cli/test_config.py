from dataclasses import dataclass, field
from typing import Literal

import pytest

from yatt_mm.config import ConfigError, load, unranged


@dataclass
class Inner:
    n: int = 4
    temperature: float = 1.0
    mode: Literal["a", "b"] = "a"


@dataclass
class Root:
    name: str = "x"
    inner: Inner = field(default_factory=Inner)
    tags: list[str] = field(default_factory=list)


def test_yaml_and_overrides(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("name: run\ninner:\n  n: 8\n")
    cfg = load(Root, p, ["inner.temperature=2e-4", "tags=[a, b]", "inner.mode=b"])
    assert cfg.name == "run" and cfg.inner.n == 8 and cfg.inner.temperature == 2e-4  # YAML reads 2e-4 as text
    assert cfg.tags == ["a", "b"] and cfg.inner.mode == "b"


@pytest.mark.parametrize("override, message", [
    ("inner.temprature=0.5", "unknown setting 'inner.temprature'; did you mean 'temperature'"),
    ("innr.n=3", "unknown setting 'innr'; did you mean 'inner'"),
    ("inner.n=many", "inner.n: expected int"),
    ("inner.temperature=hot", "inner.temperature: expected float"),
    ("inner.mode=c", "inner.mode: 'c' is not one of 'a', 'b'"),
    ("inner", "must look like key=value"),
])
def test_mistakes_name_the_setting_and_the_fix(override, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace("[", r"\[")):
        load(Root, None, [override])


@dataclass
class Ranged:
    n: int = 4  # at least one
    share: float = 0.5  # a share that may be all
    seed: int | None = None  # optional
    sizes: list[int] = field(default_factory=lambda: [1])  # each in [1, 8)
    weight: float = 1.0  # any finite number

    RANGES = {"n": ">= 1", "share": "(0, 1]", "seed": ">= 0", "sizes": "[1, 8)", "weight": "any"}


@pytest.mark.parametrize("override, message", [
    ("n=0", "n must be >= 1, got 0"),
    ("share=0", "share must be in (0, 1], got 0.0"),
    ("share=1.01", "share must be in (0, 1], got 1.01"),
    ("seed=-1", "seed must be >= 0, got -1"),
    ("sizes=[1, 8]", "sizes must be in [1, 8), got [1, 8]"),
    ("weight=.inf", "weight must be a finite number, got inf"),
    ("share=.nan", "share must be in (0, 1], got nan"),
])
def test_ranges_name_the_setting_and_what_it_must_be(override, message):
    with pytest.raises(ConfigError) as e:
        load(Ranged, None, [override])
    assert str(e.value) == message
    assert load(Ranged, None, ["n=1", "share=1", "seed=null", "sizes=[1, 7]", "weight=-3"]).share == 1.0


def test_every_numeric_setting_needs_a_valid_range():
    @dataclass
    class Loose:
        a: int = 1  # ranged
        b: float | None = None  # not ranged
        c: dict[str, int] = field(default_factory=dict)  # not ranged
        d: str = ""  # not numeric
        RANGES = {"a": "=> 1", "e": ">= 0"}

    assert unranged(Loose) == ["b", "c", "a: range '=> 1': write >= 1, > 0, [0, 1), (0, 1] ... or any",
                               "e (in RANGES, not a setting)"]
