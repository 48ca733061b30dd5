from dataclasses import dataclass, field
from typing import Literal

import pytest

from yatt_mm.config import ConfigError, load


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
