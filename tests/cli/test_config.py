from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import pytest

from yatt_mm.config import ConfigError, describe, load, unranged
from yatt_mm.rl.config import RLConfig


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


# ---------------------------------------------------------------- list items: name[N] in overrides

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "configs/tiny_demo.yaml"  # reward.judges: one GenRM; reward.functions: exact_match


@dataclass
class Source:
    name: str = ""  # names it
    weight: float = 1.0  # its share


@dataclass
class Listed:
    sources: list[Source] = field(default_factory=lambda: [Source("a"), Source("b")])
    inner: Inner = field(default_factory=Inner)


def test_an_index_sets_one_field_of_a_list_item_the_yaml_gives():
    cfg = load(RLConfig, DEMO, ["reward.judges[0].judge.votes=4", "reward.functions[0].weight=0.25"])
    (judge,) = cfg.reward.judges
    assert judge.judge.votes == 4 and judge.judge.name == "genrm" and judge.weight == 0.5  # the rest as in the YAML
    assert cfg.reward.functions[0].name == "exact_match" and cfg.reward.functions[0].weight == 0.25


def test_an_index_into_a_blend_the_overrides_made():
    blend = "data.blend=[{name: a, shards: [A]}, {name: b, shards: [B]}]"
    cfg = load(RLConfig, DEMO, ["data.shards=[]", blend, "data.blend[1].weight=0.3", "data.blend[0].shards[0]=C"])
    assert [(s.name, s.shards, s.weight) for s in cfg.data.blend] == [("a", ["C"], 1.0), ("b", ["B"], 0.3)]


def test_a_list_the_yaml_does_not_set_is_indexed_as_its_default(tmp_path):
    (tmp_path / "c.yaml").write_text("inner: {n: 2}\n")
    cfg = load(Listed, tmp_path / "c.yaml", ["sources[1].weight=0.5"])
    assert [(s.name, s.weight) for s in cfg.sources] == [("a", 1.0), ("b", 0.5)]


@pytest.mark.parametrize("override, message", [
    ("reward.judges[1].judge.votes=4",
     "override 'reward.judges[1].judge.votes=4': reward.judges has 1 item, so reward.judges[1] does not exist "
     "(indices 0 to 0)"),
    ("data.blend[0].weight=0.3",
     "override 'data.blend[0].weight=0.3': data.blend has 0 items, so data.blend[0] does not exist (give the whole "
     "list instead: data.blend=[...])"),
    ("run.steps[0]=4", "override 'run.steps[0]=4': run.steps is not a list (it is 20), so run.steps[0] does not exist"),
    ("reward.judges[0].weight[2]=1",
     "override 'reward.judges[0].weight[2]=1': reward.judges[0].weight is not a list (it is 0.5), so "
     "reward.judges[0].weight[2] does not exist"),
    ("reward.judges[-1].weight=1", "override 'reward.judges[-1].weight=1': 'judges[-1]' must look like name[N], N a "
                                   "whole number from 0 (for example reward.judges[0].weight=0.5)"),
    ("reward.judgez[0].weight=1", "unknown setting 'reward.judgez'; did you mean 'judges'?"),
    ("reward.judges[0].judge.votez=4", "unknown setting 'reward.judges[0].judge.votez'; did you mean 'votes'?"),
    ("reward.judges[0].judge.votes=0", "reward.judges[0].judge.votes must be >= 1, got 0"),
])
def test_a_bad_index_is_one_line_naming_the_setting_and_the_list(override, message):
    with pytest.raises(ConfigError) as e:
        load(RLConfig, DEMO, [override])
    assert str(e.value) == message


def test_the_cli_refuses_a_bad_index_with_exit_2_before_anything_starts(capsys):
    from yatt_mm.cli import main

    assert main(["rl", "--config", str(DEMO), "reward.judges[3].judge.votes=4"]) == 2
    out = capsys.readouterr()
    assert out.out == "" and out.err.splitlines() == [
        "yatt-mm rl: config error: override 'reward.judges[3].judge.votes=4': reward.judges has 1 item, so "
        "reward.judges[3] does not exist (indices 0 to 0)"]


# ---------------------------------------------------------------- --help-config: one line per setting


@dataclass
class Described:
    mode: Literal["a", "b"] = "a"  # how
    level: Literal["x", "y"] | None = None  # optional choice
    n: int = 4  # count
    share: float = 0.5  # a share
    weight: float = 1.0  # any weight
    name: str = ""  # free text
    sources: list[Source] = field(default_factory=list)  # datasets

    RANGES = {"n": ">= 1", "share": "(0, 1]", "weight": "any"}


def test_help_config_lines_show_choices_and_ranges_not_the_word_literal():
    assert describe(Described) == [
        "mode (str, 'a' | 'b', default 'a'): how",
        "level (str | None, 'x' | 'y', default None): optional choice",
        "n (int, >= 1, default 4): count",
        "share (float, in (0, 1], default 0.5): a share",
        "weight (float, a finite number, default 1.0): any weight",
        "name (str, default ''): free text",
        "sources (list of sections): datasets",
        "sources[].name (str, default ''): names it",
        "sources[].weight (float, default 1.0): its share",
    ]
