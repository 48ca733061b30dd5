"""Blends of datasets (data.blend, dataio/blend.py) on real shards with real decoding: the shares
drawn, the samples' sources, exact resume, a changed mix on resume, bad input counted by source."""

from __future__ import annotations

import json
import os
from collections import Counter
from dataclasses import dataclass, field

import pytest

from dataio.blend import BlendedReader, next_source, open_reader
from dataio.reader import BlendSource, DataConfig, DataReader
from dataio.synth import write_shards
from dataio_helpers import make_bad_dataset
from yatt_mm.config import ConfigError, load


@pytest.fixture(scope="module")
def datasets(tmp_path_factory):
    root = tmp_path_factory.mktemp("blend")
    sizes = {"charts": 11, "video": 5, "extra": 4}  # their keys collide (s00000000, ...): the source tells them apart
    for seed, (name, n) in enumerate(sizes.items()):
        write_shards(str(root / name), images=n if name != "video" else 0, videos=n if name == "video" else 0,
                     samples_per_shard=4, seed=seed, video_frames=4, tasks=None)
    return root, sizes


def blend_cfg(root, weights: dict[str, float], **kw) -> DataConfig:
    return DataConfig(blend=[BlendSource(name=n, shards=[str(root / n)], weight=w) for n, w in weights.items()],
                      seed=2, slice_size=2, shuffle_buffer=3, video_isolation="none", **kw)


def draw(reader, n):
    it = iter(reader)
    return [(s.source, s.epoch, s.key) for s in (next(it) for _ in range(n))]


def test_shares_hold_at_every_prefix_and_each_source_reads_its_own_epochs(datasets):
    root, sizes = datasets
    reader = BlendedReader(blend_cfg(root, {"charts": 3, "video": 1}, workers=2), dp_rank=1, dp_size=2)
    try:
        drawn = draw(reader, 40)
    finally:
        reader.close()
    counts = Counter()
    for n, (source, _, _) in enumerate(drawn, 1):
        counts[source] += 1
        assert abs(counts["charts"] - 0.75 * n) < 1 and abs(counts["video"] - 0.25 * n) < 1, (n, counts)
    # each source is a reader of its own: this rank's half of it, epoch after epoch
    alone = {name: DataReader(DataConfig(shards=[str(root / name)], seed=2, slice_size=2, shuffle_buffer=3,
                                         video_isolation="none", workers=0), 1, 2) for name in ("charts", "video")}
    for name, r in alone.items():
        want = [(e, k) for e in range(8) for k in r.keys(e)]
        got = [(e, k) for s, e, k in drawn if s == name]
        assert got == want[: len(got)], name
    assert {e for s, e, _ in drawn if s == "video"} == {0, 1, 2, 3}  # 10 draws of a rank's 2 or 3 videos
    for r in alone.values():
        r.close()


@pytest.mark.parametrize("stop", [0, 7, 13])
def test_resume_continues_exactly_with_other_workers(datasets, stop):
    root, _ = datasets
    weights = {"charts": 2, "video": 1, "extra": 1.5}
    whole = BlendedReader(blend_cfg(root, weights, workers=2), 0, 2)
    first = BlendedReader(blend_cfg(root, weights, workers=2), 0, 2)
    try:
        expected = draw(whole, 30)
        head = draw(first, stop)
        state = json.loads(json.dumps(first.state_dict()))  # what a checkpoint keeps
    finally:
        whole.close()
        first.close()
    resumed = open_reader(blend_cfg(root, weights, workers=0, worker_kind="thread"), 0, 2)
    resumed.load_state_dict(state)
    if stop == 7:  # through the RL controller's source too, with its own count of question-less samples
        from yatt_mm.rl.sources import ParallelSource

        source = ParallelSource(BlendedReader(blend_cfg(root, weights, workers=0), 0, 2))
        source.skipped_no_question = 3
        again = ParallelSource(BlendedReader(blend_cfg(root, weights, workers=0), 0, 2))
        again.load_state_dict(json.loads(json.dumps(source.state_dict())))
        assert again.skipped_no_question == 3 and again.data_counts()["skipped_no_question"] == 3.0
        source.reader.close()
        again.reader.close()
    try:
        assert head + draw(resumed, 30 - stop) == expected
        assert resumed.samples_yielded == 30 and not resumed.skips
    finally:
        resumed.close()


def test_a_changed_mix_on_resume_counts_shares_afresh_and_an_added_source_starts_at_its_beginning(datasets, capfd):
    root, _ = datasets
    before = BlendedReader(blend_cfg(root, {"charts": 3, "video": 1}, workers=0), 0, 1)
    head = draw(before, 9)
    state = before.state_dict()
    rest_of_charts = [(e, k) for s, e, k in draw(before, 60) if s == "charts"]
    before.close()

    after = BlendedReader(blend_cfg(root, {"charts": 1, "extra": 1}, workers=0), 0, 1)
    after.load_state_dict(state)
    assert "charts: 3, video: 1 -> charts: 1, extra: 1" in capfd.readouterr().err
    tail = draw(after, 20)
    after.close()
    assert Counter(s for s, _, _ in tail) == {"charts": 10, "extra": 10}  # the new shares, from here
    assert [(e, k) for s, e, k in tail if s == "charts"] == rest_of_charts[:10]  # charts where it stopped
    extra = DataReader(DataConfig(shards=[str(root / "extra")], seed=2, slice_size=2, shuffle_buffer=3,
                                  video_isolation="none", workers=0), 0, 1)
    assert [k for s, e, k in tail if s == "extra"][:4] == extra.keys(0)  # the added source from its start
    extra.close()
    assert len(head) == 9


def test_skipped_samples_are_counted_and_quarantined_by_source(tmp_path, datasets):
    root, sizes = datasets
    bad = make_bad_dataset(str(tmp_path / "bad"))
    qlog = tmp_path / "quarantine.jsonl"
    cfg = DataConfig(blend=[BlendSource("good", [str(root / "charts")], weight=1),
                            BlendSource("bad", [str(tmp_path / "bad")], weight=1)],
                     workers=0, video_isolation="none", quarantine_log=str(qlog), shuffle=False)
    reader = BlendedReader(cfg)
    try:
        drawn = draw(reader, 2 * len(bad["good"]) + 2)  # the bad source's whole epoch, then its next first sample
    finally:
        reader.close()
    assert Counter(s for s, _, _ in drawn) == {"good": len(bad["good"]) + 1, "bad": len(bad["good"]) + 1}
    assert [k for s, e, k in drawn if s == "bad"] == bad["good"] + bad["good"][:1]
    skips = reader.skips_by_source()
    assert skips["good"] == 0 and skips["bad"] == sum(reader.skips.values()) == len(bad["expected"])
    lines = [json.loads(ln) for ln in qlog.read_text().splitlines()]
    assert {ln["source"] for ln in lines} == {"bad"} and len(lines) == len(bad["expected"])
    assert not os.path.exists(bad["bomb_target"])


def test_next_source_is_the_one_furthest_behind_its_share():
    assert next_source([1, 1], [0, 0]) == 0 and next_source([1, 1], [1, 0]) == 1
    assert next_source([1, 3], [0, 0]) == 1 and next_source([1, 3], [0, 3]) == 0
    drawn = [0, 0, 0]
    for _ in range(600):
        drawn[next_source([0.5, 0.2, 0.3], drawn)] += 1
    assert drawn == [300, 120, 180]


def test_misconfigured_blends_name_the_setting(tmp_path, datasets):
    root, _ = datasets
    @dataclass
    class Root:
        data: DataConfig = field(default_factory=DataConfig)

    src = f"{{name: a, shards: [{root / 'charts'}]}}"
    cases = {
        f"data.blend=[{src}]": None,  # fine
        f"data.blend=[{{name: a, shards: [{root / 'charts'}], weight: 0}}]": "data.blend[0].weight must be > 0",
        f"data.blend=[{src}, {src}]": "source names must differ",
        f"data.blend=[{{name: 'a b', shards: [{root / 'charts'}]}}]": "data.blend[0]: a blend source needs a name",
        "data.blend=[{name: a}]": "data.blend[0]: blend source 'a': give its shards",
        f"data.blend=[{{nmae: a, shards: [{root / 'charts'}]}}]": "did you mean 'name'",
    }
    for override, error in cases.items():
        overrides = [override, "data.shards=[]"]
        if error is None:
            assert load(Root, None, overrides).data.blend[0].name == "a"
            continue
        with pytest.raises((ConfigError, ValueError), match=error.replace("[", r"\[").replace("]", r"\]")):
            load(Root, None, overrides)
    with pytest.raises(ValueError, match="data.shards and data.index must then be empty"):
        load(Root, None, [f"data.blend=[{src}]", f"data.shards=[{root / 'video'}]"])
    # a checkpoint's data state belongs to its kind of reader
    blended = BlendedReader(blend_cfg(root, {"charts": 1}, workers=0))
    single = DataReader(DataConfig(shards=[str(root / "charts")], workers=0))
    with pytest.raises(ValueError, match="saved by a blend of datasets"):
        single.load_state_dict(blended.state_dict())
    with pytest.raises(ValueError, match="not a blend"):
        blended.load_state_dict(single.state_dict())
    with pytest.raises(ValueError, match="open_reader"):
        DataReader(blend_cfg(root, {"charts": 1}))
    blended.close()
    single.close()


def test_resume_with_the_sources_listed_in_another_order_continues_exactly(datasets):
    root, _ = datasets
    whole = BlendedReader(blend_cfg(root, {"charts": 3, "video": 1}, workers=0))
    expected = draw(whole, 20)
    first = BlendedReader(blend_cfg(root, {"charts": 3, "video": 1}, workers=0))
    head = draw(first, 6)
    swapped = BlendedReader(blend_cfg(root, {"video": 1, "charts": 3}, workers=0))
    swapped.load_state_dict(first.state_dict())
    tail = draw(swapped, 14)
    for r in (whole, first, swapped):
        r.close()
    assert Counter(s for s, _, _ in head + tail) == Counter(s for s, _, _ in expected)  # the same shares ...
    for name in ("charts", "video"):  # ... and each source where it stopped
        assert [x for x in head + tail if x[0] == name] == [x for x in expected if x[0] == name]


def test_a_source_too_small_for_the_dp_groups_is_refused_by_name_and_held_out_scans_see_every_source(tmp_path, datasets):
    root, _ = datasets
    write_shards(str(tmp_path / "two"), images=2, videos=0, samples_per_shard=2, seed=9, tasks=["colour"])
    cfg = DataConfig(blend=[BlendSource("charts", [str(root / "charts")]), BlendSource("two", [str(tmp_path / "two")])],
                     workers=0, video_isolation="none")
    with pytest.raises(ValueError, match=r"data.blend\[two\]: its 2 samples leave DP rank 0 of 3 none to read"):
        BlendedReader(cfg, 0, 3)
    reader = BlendedReader(cfg, 0, 1)  # one pass over both, interleaved: a scan stopping early sees both
    first = [s.source for s in reader.iter_epoch()]
    reader.close()
    assert first[:4] == ["charts", "two", "charts", "two"] and Counter(first) == {"charts": 11, "two": 2}
    with pytest.raises(ValueError, match=r"data.blend\[charts\]: data state was saved with dp_size=1"):
        BlendedReader(cfg, 0, 2).load_state_dict(BlendedReader(cfg, 0, 1).state_dict())
