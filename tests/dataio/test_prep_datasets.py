"""`yatt-mm prep` on the data people already have: LLaVA-style JSON/JSONL with an image folder,
and Hugging Face `datasets` parquet (struct image columns written as `datasets` writes them),
both built here from scratch: several images per row, a video row, chat-message prompts,
multi-turn conversations and broken rows of every kind."""

from __future__ import annotations

import glob
import io
import json
import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from prep_media import write_video
from yatt_mm.cli import main

IMAGE_STRUCT = pa.struct([("bytes", pa.binary()), ("path", pa.string())])  # datasets' Image() feature


def _png(seed: int, size=(60, 40)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, (seed * 40 % 256, 90, 200 - seed * 30 % 200)).save(buf, "PNG")
    return buf.getvalue()


def _read_back(out: str):
    from dataio.reader import DataConfig, DataReader

    reader = DataReader(DataConfig(shards=[out], shuffle=False, workers=0), 0, 1)
    got = list(reader.iter_epoch())
    assert not reader.skips
    fails = {r["path"].rsplit("#", 1)[-1]: r["reason"]
             for r in pq.read_table(os.path.join(out, "failures.parquet")).to_pylist()}
    import webdataset as wds

    plain = list(wds.WebDataset(sorted(glob.glob(os.path.join(out, "*.tar"))), shardshuffle=False))
    assert len(plain) == len(got)  # the plain webdataset library reads every sample back
    return got, fails


def _prep(kind: str, inputs: list[str], out: str, *extra: str) -> None:
    assert main(["prep", kind, *inputs, "--out", out, "--workers", "0", "--no-progress", *extra]) == 0


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    root = tmp_path_factory.mktemp("llava")
    (root / "images").mkdir()
    for i in range(4):
        (root / "images" / f"{i}.png").write_bytes(_png(i))
    (root / "images" / "broken.jpg").write_bytes(b"\xff\xd8 not an image")
    write_video(str(root / "clip.mp4"), "libx264", 10, 2.0)
    rows = [
        {"id": "one", "image": "images/0.png",
         "conversations": [{"from": "human", "value": "<image>\nWhat colour is it?"}, {"from": "gpt", "value": "red"}]},
        {"id": "two", "image": ["images/1.png", "images/2.png"], "source": "synthetic",
         "conversations": [{"from": "human", "value": "<image>\n<image>\nWhich is brighter?"},
                           {"from": "gpt", "value": "the first"},
                           {"from": "human", "value": "And the second?"}, {"from": "gpt", "value": "darker"}]},
        {"id": "no_placeholder", "image": "images/3.png",
         "conversations": [{"from": "human", "value": "Describe it."}, {"from": "gpt", "value": "a square"}]},
        {"id": "vid", "video": "clip.mp4",
         "conversations": [{"from": "human", "value": "<video>\nWhat happens?"}, {"from": "gpt", "value": "motion"}]},
        {"id": "missing", "image": "images/nope.png",
         "conversations": [{"from": "human", "value": "<image>\nQ?"}, {"from": "gpt", "value": "A"}]},
        {"id": "undecodable", "image": "images/broken.jpg",
         "conversations": [{"from": "human", "value": "<image>\nQ?"}, {"from": "gpt", "value": "A"}]},
        {"id": "no_question", "image": "images/0.png",
         "conversations": [{"from": "human", "value": "<image>"}, {"from": "gpt", "value": "A"}]},
        {"id": "mismatch", "image": "images/0.png",
         "conversations": [{"from": "human", "value": "<image><image>\nQ?"}, {"from": "gpt", "value": "A"}]},
    ]
    (root / "train.json").write_text(json.dumps(rows))
    (root / "train.jsonl").write_text("\n".join(json.dumps(r) for r in rows[:2]) + "\n{not json\n")
    return root


def test_llava_json_images(llava, tmp_path):
    out = str(tmp_path / "out")
    _prep("images", [str(llava / "train.json")], out, "--max-side", "32")
    got, fails = _read_back(out)
    by_answer = {s.answer: s for s in got}
    assert sorted(by_answer) == ["a square", "darker", "red"]
    assert by_answer["red"].prompt == "What colour is it?" and len(by_answer["red"].images) == 1
    two = by_answer["darker"]  # multi-turn: first human turn, last assistant turn, the whole talk kept
    assert two.prompt == "Which is brighter?" and len(two.images) == 2
    assert [t["value"] for t in two.metadata["conversations"]][-1] == "darker"
    assert two.metadata["extra"] == {"id": "two", "source": "synthetic"}
    assert two.metadata["source"]["media"] == ["images/1.png", "images/2.png"]
    assert max(by_answer["red"].metadata["width"], by_answer["red"].metadata["height"]) <= 32  # --max-side
    assert fails == {"000000003": "no_media", "000000004": "unreadable", "000000005": "not_an_image",
                     "000000006": "no_question", "000000007": "placeholder_mismatch"}


def test_llava_video_row_and_jsonl_with_a_bad_line(llava, tmp_path):
    out = str(tmp_path / "vid")
    _prep("video", [str(llava / "train.json")], out, "--max-clip-len", "1", "--fps", "2")
    got, fails = _read_back(out)
    assert len(got) == 2 and {s.prompt for s in got} == {"What happens?"} and all(s.videos for s in got)
    assert fails["000000000"] == "no_media" and len(fails) == 7  # every image row, counted, not lost
    out2 = str(tmp_path / "jsonl")
    _prep("images", [str(llava / "train.jsonl")], out2)
    got2, fails2 = _read_back(out2)
    assert len(got2) == 2 and fails2 == {"000000002": "bad_row"}
    # a dataset file kept apart from its media: --media-root names where the paths start
    (llava / "elsewhere").mkdir(exist_ok=True)
    (llava / "elsewhere" / "rows.json").write_text((llava / "train.json").read_text())
    out3 = str(tmp_path / "root")
    _prep("images", [str(llava / "elsewhere" / "rows.json")], out3, "--media-root", str(llava))
    assert len(_read_back(out3)[0]) == 3


def _hf_parquet(path, rows_per_group=3):
    """A verl-style multimodal RL set as `datasets` stores it: `images` a list of {bytes, path},
    the prompt as chat messages, the answer in reward_model.ground_truth, other columns kept."""
    images = [[{"bytes": _png(i), "path": f"{i}.png"}] for i in range(5)]
    images[1] = [{"bytes": _png(1), "path": "1a.png"}, {"bytes": _png(7), "path": "1b.png"}]
    images[3] = [{"bytes": b"garbage bytes", "path": "3.png"}]
    images[4] = []
    prompts = [[{"role": "user", "content": "<image>Find x."}], [{"role": "user", "content": "<image><image>Compare."}],
               [{"role": "system", "content": "be brief"}, {"role": "user", "content": "<image>Area?"}],
               [{"role": "user", "content": "<image>Q?"}], [{"role": "user", "content": "No picture."}]]
    table = pa.table({
        "images": pa.array(images, pa.list_(IMAGE_STRUCT)),
        "prompt": pa.array(prompts),
        "reward_model": pa.array([{"ground_truth": str(i), "style": "rule"} for i in range(5)]),
        "data_source": pa.array(["geo3k"] * 5),
    })
    pq.write_table(table, path, row_group_size=rows_per_group)
    return path


def test_hf_parquet_rl_set(tmp_path):
    src = _hf_parquet(str(tmp_path / "train.parquet"))
    out = str(tmp_path / "out")
    _prep("images", [src], out)
    got, fails = _read_back(out)
    assert sorted((s.prompt, s.answer, len(s.images)) for s in got) == [
        ("Area?", "2", 1), ("Compare.", "1", 2), ("Find x.", "0", 1)]
    s = next(s for s in got if s.answer == "0")
    assert s.metadata["extra"]["data_source"] == "geo3k" and json.loads(s.metadata["extra"]["reward_model"])["style"] == "rule"
    assert json.loads(s.metadata["extra"]["images"]) == ["0.png"] and s.metadata["source"] == {
        "file": "train.parquet", "row": 0, "width": 60, "height": 40, "format": "PNG"}
    assert fails == {"000000003": "not_an_image", "000000004": "no_media"}
    # deterministic and resumable: the same command again changes nothing
    before = {p: open(p, "rb").read() for p in glob.glob(os.path.join(out, "*.tar"))}
    _prep("images", [src], out)
    assert before == {p: open(p, "rb").read() for p in glob.glob(os.path.join(out, "*.tar"))}


def test_hf_parquet_single_image_column_and_plain_prompt(tmp_path):
    table = pa.table({"image": pa.array([{"bytes": _png(i), "path": None} for i in range(3)], IMAGE_STRUCT),
                      "question": ["What is it?", "", "Why?"], "answer": ["a", "b", "c"]})
    pq.write_table(table, tmp_path / "d.parquet")
    out = str(tmp_path / "out")
    _prep("images", [str(tmp_path / "d.parquet"), "--format", "hf-parquet"], out)
    got, fails = _read_back(out)
    assert sorted((s.prompt, s.answer) for s in got) == [("What is it?", "a"), ("Why?", "c")]
    assert fails == {"000000001": "no_question"}


@pytest.mark.parametrize("content, why", [
    ('[{"image": "a.png", "conversations": [{"from": "human"', "not JSON (Expecting ',' delimiter: line 1 column 55"),
    ('{"image": "a.png", "conv', "not JSON (Unterminated string starting at: line 1 column 20"),
    ('{"image": "a.png"}', "a LLaVA-style file holds a list of rows, not a dict"),
    ('[{"path": "a.png"}]', 'no row has "conversations": a .json input is a LLaVA-style dataset; a list of media '
                            "files goes in a .jsonl or .csv file with a 'path' column"),
])
def test_a_broken_json_input_is_refused_saying_what_is_wrong_with_it(tmp_path, capsys, content, why):
    """A .json input is a dataset file, never an image: one that does not read as a LLaVA-style
    dataset is named with its own fault (it was counted as not_an_image when it lacked the word
    "conversations"), before anything is written."""
    broken = tmp_path / "rows.json"
    broken.write_text(content)
    with pytest.raises(SystemExit) as e:
        main(["prep", "images", str(broken), "--out", str(tmp_path / "out"), "--workers", "0", "--no-progress"])
    assert str(e.value).startswith(f"prep images: {broken}: {why}"), e.value
    assert not (tmp_path / "out" / "failures.parquet").exists()
