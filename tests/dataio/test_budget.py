"""data.max_sample_tokens on real mp4/jpg shards: a video over the budget is read with fewer
frames (uniform over the clip), counted; a sample that cannot fit is skipped with its key in the
quarantine log; 0 leaves every sample as it was."""

import json

import numpy as np
import pytest

from dataio.budget import TokenBudget
from dataio.decode import MediaConfig
from dataio.reader import DataConfig, DataReader
from dataio_helpers import good_image_bytes, good_video_bytes, js, write_tar

# The 56 x 56 synthetic clip stays 56 x 56 (factor 28): 2 x 2 = 4 tokens a temporal group of 2
# frames; 16 frames = 8 groups = 32 tokens. Prompt "q?" = 2 bytes + 32 template + 2 markers.
VIDEO_TOKENS, FIXED = 32, 36


@pytest.fixture(scope="module")
def shard(tmp_path_factory):
    root = tmp_path_factory.mktemp("budget")
    return write_tar(str(root / "shard-000000.tar"), [
        ("clip.mp4", good_video_bytes(3, frames=16)), ("clip.json", js()),
        ("photo.jpg", good_image_bytes(4)), ("photo.json", js()),
    ])


def _read(shard, tmp_path, budget: int):
    cfg = DataConfig(shards=[shard], shuffle=False, workers=0, video_isolation="none", max_sample_tokens=budget,
                     media=MediaConfig(video_frames=16), quarantine_log=str(tmp_path / "quarantine.jsonl"))
    reader = DataReader(cfg)
    samples = {s.key: s for s in reader.iter_epoch()}
    log = tmp_path / "quarantine.jsonl"
    skipped = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    return reader, samples, skipped


def test_off_reads_every_frame(shard, tmp_path):
    reader, samples, skipped = _read(shard, tmp_path, 0)
    assert samples["clip"].videos[0].shape == (16, 56, 56, 3) and samples["clip"].frames_dropped == 0
    assert reader.budget_fitted == 0 and skipped == [] and set(samples) == {"clip", "photo"}
    assert TokenBudget(10**6).tokens("q?", [], samples["clip"].videos) == FIXED + VIDEO_TOKENS


def test_a_video_over_the_budget_gets_fewer_frames_and_is_counted(shard, tmp_path):
    full = _read(shard, tmp_path / "full", 0)[1]["clip"].videos[0]
    reader, samples, skipped = _read(shard, tmp_path, 50)  # room for 14 video tokens: 3 groups, 6 frames
    clip = samples["clip"].videos[0]
    assert clip.shape == (6, 56, 56, 3) and samples["clip"].frames_dropped == 10
    assert np.array_equal(clip, full[[0, 3, 6, 9, 12, 15]])  # the same clip, sampled uniformly more sparsely
    assert (reader.budget_fitted, reader.frames_dropped) == (1, 10)
    assert reader.state_dict()["budget_fitted"] == 1
    # the 112 x 112 photo is 4 x 4 = 16 tokens, 52 in all: an image cannot shrink, so it is skipped
    assert "photo" not in samples and [r["key"] for r in skipped] == ["photo"] and reader.skips == {"over_token_budget": 1}


def test_a_sample_that_cannot_fit_is_skipped_and_named_in_the_quarantine_log(shard, tmp_path):
    # one temporal group needs 36 + 4 = 40 tokens; the photo 36 + 16 = 52
    reader, samples, skipped = _read(shard, tmp_path, 39)
    assert samples == {} and reader.skips == {"over_token_budget": 2}
    assert sorted(r["key"] for r in skipped) == ["clip", "photo"]
    assert all(r["reason"] == "over_token_budget" and "data.max_sample_tokens is 39" in r["detail"] for r in skipped)
    # at 40 the clip fits at its minimum, one temporal group (2 frames); the photo still does not
    reader, samples, _ = _read(shard, tmp_path / "40", 40)
    assert samples["clip"].videos[0].shape[0] == 2 and reader.skips == {"over_token_budget": 1}


def test_the_response_limit_and_the_tokenizer_count():
    video = np.zeros((16, 56, 56, 3), np.uint8)
    budget = TokenBudget(100, response_tokens=50, text_tokens=lambda text: 1)
    videos, dropped = budget.fit("a long prompt of many bytes", [], [video])
    # fixed: 1 + 32 + 2 + 50 = 85; room 15: 3 groups
    assert videos[0].shape[0] == 6 and dropped == 10


def test_a_negative_budget_is_refused_naming_the_setting(shard):
    with pytest.raises(ValueError, match="data.max_sample_tokens must be >= 0"):
        DataReader(DataConfig(shards=[shard], max_sample_tokens=-1))
