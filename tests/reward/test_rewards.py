import random

import pytest

from dataio.synth import colour_image, moving_ball_video
from yatt_mm.reward.genrm import (
    InProcessJudge,
    JudgeConfig,
    JudgeItem,
    aggregate_votes,
    parse_verdict,
)
from yatt_mm.reward.rules import get_rule


@pytest.mark.parametrize("text, expected", [
    ("The response is right.\nScore: 1", 1.0),
    ("score=0", 0.0),
    ("Score: 1\nScore: 1", 1.0),  # restated, same verdict
    ("Score: 1 ... on reflection Score: 0", None),  # two different scores: undecided
    ("Score: 7", None),  # out of range
    ("Score: -1", None),
    ("", None),
    ("   \n", None),
    ("I think it is correct.", None),  # no score at all
    ("Score: 0.5", 0.5),
])
def test_parse_score_adversarial(text, expected):
    assert parse_verdict(text, "score", (0.0, 1.0)) == expected


@pytest.mark.parametrize("text, expected", [
    ("Reasoning... Is the answer correct (Yes/No)? Yes", 1.0),
    ("No doubt. Is the answer correct (Yes/No)? no, it is not", 0.0),  # 'No' before the phrase ignored
    ("yes", 1.0),
    ("maybe", None),
])
def test_parse_yes_no(text, expected):
    assert parse_verdict(text, "yes_no") == expected


def test_votes_average_parsed_and_fallback_counts_unparseable():
    cfg = JudgeConfig(votes=3, fallback_score=-1.0)
    assert aggregate_votes(cfg, ["Score: 1", "Score: 0", "garbage"]).score == 0.5
    out = aggregate_votes(cfg, ["garbage", ""])
    assert out.score == -1.0 and out.failure == "unparseable" and out.parsed_votes == 0


def test_rules():
    assert get_rule("exact_match")("Answer: Red", "red", {}) == 1.0
    assert get_rule("exact_match")("blue", "red", {}) == 0.0
    assert get_rule("contains_answer")("the square is red.", "red", {}) == 1.0
    assert get_rule("contains_answer")("reddish", "red", {}) == 0.0
    assert get_rule("numeric_match")("there are 3 shapes\nAnswer: 3", "3", {}) == 1.0
    assert get_rule("numeric_match")("Answer: 4", "3", {}) == 0.0
    assert get_rule("format")("thinking\nAnswer: red", "red", {}) == 1.0
    with pytest.raises(ValueError, match="unknown reward function 'exact'"):
        get_rule("exact")


def test_math_verify_scores_equal_values_in_any_form_in_and_out_of_the_main_thread(caplog):
    """geometry3k-style references (LaTeX without delimiters) against answers in other forms:
    what numeric_match scores 0 (a surd, a fraction in LaTeX), math_verify scores by value; the
    final \\boxed{} answer wins over numbers on the way; a long response is read at its end. The
    same from a thread (asynchronous RL's rollout thread, where Math-Verify's signal-based timeout
    cannot run). A reference that is not math warns once, naming it."""
    import threading

    math = get_rule("math_verify")
    cases = [("So the side is \\boxed{\\sqrt{12}}.", "2\\sqrt{3}", 1.0), ("Answer: 8/3", "\\frac{8}{3}", 1.0),
             ("\\boxed{25/2}", "12.5", 1.0), ("x is 3 or 4. Final: \\boxed{4}", "3", 0.0),
             ("answer is 3.4641", "2\\sqrt{3}", 0.0), ("blah " * 2000 + "\\boxed{60}", "60", 1.0),
             ("The angle is 61", "60", 0.0)]
    assert [math(r, a, {}) for r, a, _ in cases] == [want for _, _, want in cases]
    assert get_rule("numeric_match")(*cases[0][:2], {}) == get_rule("numeric_match")(*cases[1][:2], {}) == 0.0
    in_thread = []
    worker = threading.Thread(target=lambda: in_thread.extend(math(r, a, {}) for r, a, _ in cases))
    worker.start()
    worker.join()
    assert in_thread == [want for _, _, want in cases]
    with caplog.at_level("WARNING"):
        assert math("yes", "\\frac{", {}) == math("no", "\\frac{", {}) == 0.0
    assert [r.getMessage() for r in caplog.records if "math_verify" in r.getMessage()] == [
        "math_verify: the reference answer '\\\\frac{' does not parse as math: its responses score 0 (for choices "
        "and words use exact_match)"]


def _items():
    rng = random.Random(0)
    img, vid = colour_image(rng), moving_ball_video(rng)
    return [JudgeItem(img.question, "red", img.answer, images=[img.image]),
            JudgeItem(vid.question, "up", vid.answer, videos=[vid.video])]


def test_inprocess_judge_scores_image_and_video_items(rollout_engine):
    cfg = JudgeConfig(votes=2, max_tokens=8, fallback_score=0.25)
    judge = InProcessJudge(cfg, engine=rollout_engine)
    scores = judge.score(_items())
    assert len(scores) == 2
    for s in scores:
        assert len(s.texts) == 2  # k votes (the untrained judge may answer with nothing at once)
        # each score is what its own votes parse to: their mean, or the fallback, counted by reason
        parsed = [v for v in (parse_verdict(t, cfg.parse, cfg.score_range) for t in s.texts) if v is not None]
        assert s.parsed_votes == len(parsed) and (s.failure is None) == bool(parsed)
        assert s.score == (sum(parsed) / len(parsed) if parsed else 0.25)
    stats = judge.stats.as_metrics("genrm")
    assert stats["genrm/scored"] == sum(s.failure is None for s in scores)
    assert stats["genrm/fallback"] == sum(s.failure is not None for s in scores)


def test_seeded_votes_on_a_response_repeat_and_another_sample_gets_its_own(rollout_engine):
    """With the run's sampling seed (rollout.sampling.seed), an in-process judge's votes on a
    response follow from the run's seed, the prompt's draw from the data and the sample's index
    alone: scored again, alone or in another batch, it gets the same votes (a resumed run's
    rewards are the uninterrupted run's), and another sample of the prompt gets votes of its own."""
    from yatt_mm.engines.engine import Response
    from yatt_mm.reward.judges import Judges
    from yatt_mm.reward.rewarder import RewardConfig, Rewarder
    from yatt_mm.rl.samples import Prompt

    judge = InProcessJudge(JudgeConfig(votes=2, max_tokens=8, temperature=1.0), engine=rollout_engine)
    rewarder = Rewarder(RewardConfig(), Judges([("genrm", judge, 1.0)]), seed=3)
    img = colour_image(random.Random(0))
    prompt = Prompt("k", img.question, img.answer, images=[img.image], origin="0/shard-000000.tar/k")
    answer = Response([1], "red", [0.0], "stop")
    items = [rewarder.item(prompt, j, answer) for j in (0, 1, 0)]
    assert items[0].seed == items[2].seed != items[1].seed
    votes = [s.texts for s in judge.score(items)]
    assert votes[0] == votes[2] != votes[1]
    assert judge.score([items[1]])[0].texts == votes[1]
    unseeded = Rewarder(RewardConfig(), Judges([("genrm", judge, 1.0)])).item(prompt, 0, answer)
    assert unseeded.seed is None


# A judge server killed mid-step: tests/rl/test_split_live.py (marked slow), on that module's
# server, whose start is most of the cost.


def test_reward_parts_and_judge_rule_agreement_are_summed_per_step():
    from types import SimpleNamespace

    from yatt_mm.reward.genrm import JudgeStats
    from yatt_mm.reward.judges import Judges
    from yatt_mm.reward.rewarder import RewardConfig, RewardFunction, Rewarder, reward_metrics

    judge = SimpleNamespace(stats=JudgeStats())  # only its counters are read here
    rewarder = Rewarder(RewardConfig(functions=[RewardFunction("exact_match", 1.0)]), Judges([("genrm", judge, 0.5)]))
    # two prompts' parts as score() builds them: the judge disagrees with the rule on 2 of 5
    rewarder._count([{"exact_match": [1.0, 0.0, 1.0], "genrm": [1.0, 0.5, 0.0]},
                     {"exact_match": [0.0, 0.0], "genrm": [0.0, 0.0]}])
    counts = rewarder.take_counts()
    assert counts["genrm/agree_exact_match"] == 3 and counts["exact_match/n"] == 5
    m = reward_metrics(counts, ["exact_match"], ["genrm"])
    assert m["reward/exact_match"] == pytest.approx(0.4) and m["reward/genrm"] == pytest.approx(0.3)
    assert m["genrm/genrm/agreement_exact_match"] == pytest.approx(0.6)
    assert rewarder.take_counts()["exact_match/n"] == 0  # per step: taking resets


def test_grounding_rewards_by_hand_lenient_parsing_and_malformed_counted(caplog):
    """IoU, GIoU and point-in-box against hand computations, boxes read leniently from text in
    either scale (0-1 or 0-1000); an unreadable prediction scores 0 and is counted, an answer
    without a box scores 0 with a warning: neither raises."""
    from yatt_mm.reward.rewarder import RewardConfig, RewardFunction, Rewarder, reward_metrics
    from yatt_mm.reward.judges import Judges
    from yatt_mm.reward.rules import Malformed, get_rule

    iou, giou, point = get_rule("iou"), get_rule("giou"), get_rule("point_in_box")
    truth = "[0, 0, 500, 500]"  # 0-1000
    assert iou("The box is [0, 0, 500, 500].", truth) == pytest.approx(1.0)
    assert iou("box: (0.25, 0.25), (0.75, 0.75)", truth) == pytest.approx(0.0625 / (0.25 + 0.25 - 0.0625))
    assert iou("x1=500 y1=0 x2=1000 y2=500", truth) == 0.0  # touching, no overlap
    # GIoU of two disjoint unit squares, one apart: IoU 0, hull 3 x 1 = 3, union 2: -1/3 -> (1 - 1/3) / 2
    assert giou("[200, 0, 300, 100]", "[0, 0, 100, 100]") == pytest.approx((1 - 1 / 3) / 2)
    assert giou("[0, 0, 100, 100]", "[0, 0, 100, 100]") == pytest.approx(1.0)
    assert giou("[900, 900, 1000, 1000]", truth) < giou("[500, 500, 600, 600]", truth)  # farther scores lower
    assert point("click (250, 250)", truth) == 1.0 and point("(0.9, 0.1)", truth) == 0.0
    for fn, text in ((iou, "no box here"), (giou, "[1, 2, 3]"), (iou, "[5, 5, 5, 9]"), (point, "nowhere")):
        got = fn(text, truth)
        assert got == 0.0 and isinstance(got, Malformed), (fn, text)
    with caplog.at_level("WARNING"):
        assert iou("[0, 0, 500, 500]", "red") == 0.0 and not isinstance(iou("[0, 0, 1, 1]", "red"), Malformed)
    assert "holds no box" in caplog.text

    rewarder = Rewarder(RewardConfig(functions=[RewardFunction("iou", 1.0)]), Judges([]))
    rewarder._count([{"iou": [iou("[0, 0, 500, 500]", truth), iou("?", truth), iou("none", truth)]}])
    m = reward_metrics(rewarder.take_counts(), ["iou"], [])
    assert m["reward/iou"] == pytest.approx(1 / 3) and m["reward/iou_malformed"] == pytest.approx(2 / 3)


def test_the_grounding_task_draws_boxes_its_rewards_score_and_only_when_asked(tmp_path):
    import json
    import random
    import tarfile

    from dataio.synth import grounding_image, write_shards
    from yatt_mm.reward.rules import get_rule

    rng = random.Random(0)
    for _ in range(20):
        s = grounding_image(rng)
        assert get_rule("iou")(s.answer, s.answer) == pytest.approx(1.0)
        x1, y1, x2, y2 = [int(v) for v in s.answer.strip("[]").split(", ")]
        assert x2 > x1 and y2 > y1 and all(v % 500 == 0 for v in (x1, y1, x2, y2))  # a 2 x 2 grid
        # drawn where the answer says: the box's colour at its centre, the background beside it
        cy = (y1 + y2) // 2 * 112 // 1000
        assert s.image.getpixel(((x1 + x2) // 2 * 112 // 1000, cy)) != (128, 128, 128)
        if x1 > 0:
            assert s.image.getpixel((x1 * 112 // 1000 - 2, cy)) == (128, 128, 128)
    write_shards(str(tmp_path), images=12, videos=0, samples_per_shard=12, seed=1)  # the default mix
    with tarfile.open(next(tmp_path.glob("*.tar"))) as tf:
        tasks = {json.loads(tf.extractfile(m).read())["task"] for m in tf.getmembers() if m.name.endswith(".json")}
    assert "image/grounding" not in tasks  # drawn only when asked for by name
