"""eval.sets without a launch: what a config may say and what each set is filled in with. The
run itself (two sets, their metrics and the overall mean): tests/e2e/test_rl.py's rl_run."""

from __future__ import annotations

from pathlib import Path

import pytest

from yatt_mm.config import load
from yatt_mm.rl.config import EvalSet, RLConfig

DEMO = Path(__file__).resolve().parents[2] / "configs" / "tiny_demo.yaml"


def test_each_set_takes_evals_own_settings_where_it_says_nothing():
    cfg = load(RLConfig, DEMO, ["eval.shards=[]", "eval.num_prompts=8", "eval.max_tokens=12", "eval.reward=exact_match",
                                "eval.sets=[{name: charts, shards: [c]}, {name: geo, shards: [g], num_prompts: 3, "
                                "max_tokens: 64, reward: math_verify, samples: 8, temperature: 0.6}]"])
    assert cfg.eval.active() == [EvalSet("charts", ["c"], 8, 12, "exact_match", 1, 0.0),
                                   EvalSet("geo", ["g"], 3, 64, "math_verify", 8, 0.6)]
    one = load(RLConfig, DEMO, ["eval.shards=[held]", "eval.num_prompts=5", "eval.samples=4", "eval.temperature=1"]).eval
    assert one.filled() == [EvalSet("", ["held"], 5, one.max_tokens, one.reward, 4, 1.0)]  # eval.shards: one unnamed set
    assert load(RLConfig, DEMO, ["eval.every=0"]).eval.active() == []


@pytest.mark.parametrize("overrides, message", [
    (["eval.shards=[a]", "eval.sets=[{name: x, shards: [b]}]"], "eval.sets lists the held-out sets; eval.shards must then be empty"),
    (["eval.shards=[]", "eval.sets=[{name: x, shards: [a]}, {name: x, shards: [b]}]"], "set names must differ"),
    (["eval.shards=[]", "eval.sets=[{name: x, shards: [a], reward: exact_mach}]"], "exact_mach"),
    (["eval.shards=[]", "eval.sets=[{name: x}]"], "eval.sets[0]: eval set 'x': give its shards"),
    (["eval.shards=[]", "eval.sets=[{name: 'x/y', shards: [a]}]"], "an eval set needs a name"),
    (["eval.shards=[]", "eval.sets=[{name: x, shards: [a], num_prompts: 0}]"], "eval.sets[0].num_prompts must be >= 1"),
    (["eval.samples=4"], "eval: samples=4 answers per prompt at temperature 0 are all the same greedy answer: set "
                         "eval.temperature > 0"),
    (["eval.shards=[]", "eval.temperature=1", "eval.sets=[{name: x, shards: [a], samples: 2, temperature: 0}]"],
     "eval: samples=2 answers per prompt at temperature 0 are all the same greedy answer: set the temperature of "
     "eval set 'x' > 0"),
])
def test_bad_eval_sets_are_refused_by_name(overrides, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        load(RLConfig, DEMO, overrides)


def test_a_set_is_read_once_at_most_and_a_rank_with_no_share_gets_no_prompts(tmp_path):
    from dataio.reader import DataConfig
    from dataio.synth import write_shards
    from yatt_mm.rl.evaluation import read_held_out

    write_shards(str(tmp_path / "three"), images=3, videos=0, samples_per_shard=2, seed=1, tasks=["colour"])
    spec = EvalSet("small", [str(tmp_path / "three")], 8, 4, "exact_match", 1, 0.0)
    data = DataConfig(shards=["unused"], workers=0, video_isolation="none")
    whole = read_held_out(spec, data)
    assert sorted(p.key for p in whole.prompts) == ["s00000000", "s00000001", "s00000002"]  # not 8 with repeats
    shares = [read_held_out(spec, data, rank, 4).prompts for rank in range(4)]
    assert sorted(len(s) for s in shares) == [0, 1, 1, 1]
