"""The quarantine log (data.quarantine_log): one line per bad sample per run, with its key, shard
and its own reason, whatever the number of epochs, DP ranks or resumes; samples a rollout cannot
use (no question, no answer) are in it too. Real shards, real decoding."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from dataio.reader import DataConfig, DataReader
from dataio_helpers import good_image_bytes, js, make_bad_dataset, write_tar


@pytest.fixture(scope="module")
def bad_ds(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("quarantine_bad"))
    return root, make_bad_dataset(root)


def _cfg(root: str, log, **kw) -> DataConfig:
    """Every sample in a slice of its own, so each epoch deals the bad samples out to the ranks anew."""
    return DataConfig(shards=[root], seed=3, slice_size=1, shuffle_buffer=2, workers=0, video_isolation="none",
                      quarantine_log=str(log), **kw)


def _lines(*logs) -> list[dict]:
    return [json.loads(line) for log in logs if log.exists() for line in log.read_text().splitlines()]


def _read_until_epoch(reader: DataReader, epoch: int) -> None:
    while reader.epoch < epoch:
        for _ in reader.iter_epoch():
            pass


def test_one_line_per_bad_sample_across_three_epochs_two_ranks_and_a_resume(bad_ds, tmp_path):
    """Rank 0 stops mid-epoch 0 (its state as a checkpoint keeps it), reads on to the end of the
    epoch as a run that later dies would, and a new reader resumes from the state: it reads again
    what the lost reader read after the checkpoint. Rank 1 reads three epochs. Every epoch skips
    (and counts) every bad sample again, on whichever rank gets it; the two logs together name
    each bad sample once, with its reason."""
    root, info = bad_ds
    logs = [tmp_path / "quarantine_rank0.jsonl", tmp_path / "quarantine_rank1.jsonl"]
    lost = DataReader(_cfg(root, logs[0]), dp_rank=0, dp_size=2)
    stream = iter(lost)
    for _ in range(3):
        next(stream)
    checkpoint = json.loads(json.dumps(lost.state_dict()))
    _read_until_epoch(lost, 1)  # past the checkpoint: these lines stay in the log, the progress is lost
    stream.close()
    lost.close()
    assert 0 < checkpoint["position"] < len(lost.order(0)) and len(_lines(logs[0])) > sum(checkpoint["skips"].values())

    resumed = DataReader(_cfg(root, logs[0]), dp_rank=0, dp_size=2)
    resumed.load_state_dict(checkpoint)
    other = DataReader(_cfg(root, logs[1]), dp_rank=1, dp_size=2)
    for reader in (resumed, other):
        _read_until_epoch(reader, 3)
        reader.close()

    bad = info["expected"]  # key -> reason ("": the entry of a shard's broken tar structure)
    bad_index = {i for i, key in enumerate(resumed.index.sample_key) if key in bad}
    moved = set(other.order(1).tolist()) - set(other.order(0).tolist())
    assert bad_index & moved, "no bad sample changed rank between epochs: the test would not see a second line"
    assert sum((resumed.skips + other.skips).values()) == 3 * len(bad_index)  # each epoch counts each one
    lines = _lines(*logs)
    assert Counter((x["shard"], x["key"]) for x in lines).most_common(1)[0][1] == 1, lines
    assert {x["key"]: x["reason"] for x in lines} == bad
    assert {x["epoch"] for x in lines} == {0} and len(lines) == len(bad_index)


def test_a_line_torn_by_a_kill_is_closed_and_the_next_line_is_whole(tmp_path):
    write_tar(str(tmp_path / "s.tar"), [("a.json", js()), ("b.jpg", good_image_bytes(1)), ("b.json", js())])
    log = tmp_path / "quarantine.jsonl"
    log.write_text('{"reason": "missing_media", "shard": "elsewhere.tar", "key": "x"}\n{"reason": "corrupt_im')
    reader = DataReader(DataConfig(shards=[str(tmp_path / "s.tar")], shuffle=False, workers=0, quarantine_log=str(log)))
    assert [s.key for s in reader.iter_epoch()] == ["b"]
    reader.close()
    lines = log.read_text().splitlines()
    assert lines[1] == '{"reason": "corrupt_im' and json.loads(lines[2])["key"] == "a" and len(lines) == 3


def test_samples_without_a_question_or_an_answer_are_quarantined_with_their_own_reason(tmp_path):
    """The RL controller's source skips them (it has nothing to ask or to score against) and counts
    them in data/skipped_no_question; their lines say which of the two each one lacks."""
    from yatt_mm.rl.sources import ParallelSource

    write_tar(str(tmp_path / "s.tar"), [
        ("a_good.jpg", good_image_bytes(1)), ("a_good.json", js(prompt="What colour?", answer="red")),
        ("b_no_answer.jpg", good_image_bytes(2)), ("b_no_answer.json", json.dumps({"prompt": "What colour?"}).encode()),
        ("c_no_question.jpg", good_image_bytes(3)), ("c_no_question.json", json.dumps({"answer": "red"}).encode())])
    log = tmp_path / "quarantine.jsonl"
    source = ParallelSource(DataReader(DataConfig(shards=[str(tmp_path)], shuffle=False, workers=0,
                                                  quarantine_log=str(log))))
    try:
        assert [p.key for p in source.take(3)] == ["a_good"] * 3  # three epochs
    finally:
        source.reader.close()
    assert source.data_counts()["skipped_no_question"] == 4.0  # both, in the first two epochs
    assert [(x["key"], x["reason"]) for x in _lines(log)] == [("b_no_answer", "no_answer"),
                                                             ("c_no_question", "no_question")]
