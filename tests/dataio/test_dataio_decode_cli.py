"""Decoding to Qwen2-VL sizes (and the tiny model's processor accepting the outputs), and the
`yatt-mm data` commands."""

from __future__ import annotations

import io
import json

import numpy as np
import pytest
from PIL import Image

from dataio.decode import MediaConfig, decode_frame_sequence, decode_image, decode_video_bytes, resize_frames, \
    sample_frame_indices, smart_resize
from dataio.errors import MediaError

from dataio_helpers import good_video_bytes


def enc(img: Image.Image, fmt: str, **kw) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format=fmt, **kw)
    return buf.getvalue()


@pytest.mark.parametrize("h,w", [(512, 512), (100, 3000), (17, 33), (4000, 3000), (28, 28)])
def test_smart_resize_rules(h, w):
    lo, hi = 4 * 784, 1280 * 784
    th, tw = smart_resize(h, w, 28, lo, hi)
    assert th % 28 == 0 and tw % 28 == 0 and lo <= th * tw <= hi
    # aspect ratio roughly kept: measured |log| 0 (square), 0.025 (4000x3000), 0.11 (100x3000),
    # 0.26 (17x33 -> 56x84: the minimum pixels on the 28-grid)
    assert abs(np.log((th / tw) / (h / w))) < 0.35


# odd shapes: tiny, one side under factor / 2 (it rounds to 0), extreme aspect ratios up to 200,
# and sizes that hit min_pixels or max_pixels
ODD_SHAPES = [(1, 1), (3, 300), (300, 3), (4, 300), (1, 200), (200, 1), (13, 13), (14, 14), (15, 500), (17, 33),
              (28, 28), (2, 400), (27, 5400), (100, 3000), (10000, 60), (4000, 3000), (1080, 1920), (7, 1400)]
BOUNDS = [(4 * 784, 1280 * 784), (4 * 784, 16 * 784), (784, 784), (56 * 56, 14 * 14 * 4 * 1280)]


def _transformers_smart_resize():
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize as theirs

    return theirs


@pytest.mark.parametrize("factor", [28, 32])
@pytest.mark.parametrize("lo, hi", BOUNDS)
def test_smart_resize_is_transformers_on_odd_shapes(factor, lo, hi):
    theirs = _transformers_smart_resize()
    for h, w in ODD_SHAPES:
        assert smart_resize(h, w, factor, lo, hi) == theirs(h, w, factor=factor, min_pixels=lo, max_pixels=hi), (h, w)
    assert smart_resize(3, 300, 28, 4 * 784, 1280 * 784) == (28, 560)  # was 28 x 308 here


def test_smart_resize_is_transformers_on_random_shapes():
    theirs = _transformers_smart_resize()
    rng = np.random.default_rng(0)
    for _ in range(2000):
        h = int(rng.integers(1, 5000))
        w = int(np.clip(h * np.exp(rng.uniform(-np.log(200), np.log(200))), 1, 20000))
        if max(h, w) / min(h, w) > 200:
            continue
        lo = int(rng.integers(1, 64)) * 784
        hi = lo + int(rng.integers(0, 2000)) * 784
        assert smart_resize(h, w, 28, lo, hi) == theirs(h, w, factor=28, min_pixels=lo, max_pixels=hi), (h, w, lo, hi)


@pytest.mark.parametrize("h, w", [(1, 201), (2, 500), (500, 2), (3, 5400)])
def test_an_aspect_ratio_over_200_is_a_counted_media_error_not_a_library_crash(h, w):
    with pytest.raises(ValueError, match="aspect ratio"):  # what transformers does with it
        _transformers_smart_resize()(h, w, factor=28, min_pixels=3136, max_pixels=1003520)
    with pytest.raises(MediaError) as e:
        smart_resize(h, w, 28, 3136, 1003520)
    assert e.value.reason == "bad_aspect_ratio" and f"{w}x{h}" in e.value.detail
    with pytest.raises(MediaError, match="aspect ratio"):
        resize_frames(np.zeros((2, h, w, 3), np.uint8), MediaConfig())
    with pytest.raises(MediaError, match="aspect ratio"):
        decode_image(enc(Image.new("RGB", (w, h)), "PNG"), MediaConfig())


def test_exif_orientation_and_draft():
    img = Image.new("RGB", (400, 200), (255, 0, 0))
    img.paste((0, 0, 255), (0, 0, 100, 200))  # blue on the left
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise to display
    data = enc(img, "JPEG", exif=exif, quality=95)
    for draft in (True, False):
        out = decode_image(data, MediaConfig(image_max_pixels=56 * 112, image_draft=draft))
        assert out.mode == "RGB" and out.size == (56, 112)  # portrait now
        top = np.asarray(out)[:20].mean(axis=(0, 1))
        assert top[2] > 150 and top[0] < 100  # the blue left edge is now on top


@pytest.mark.parametrize("mode", ["RGBA", "LA", "P", "L", "1", "CMYK", "I;16", "I", "F"])
def test_any_mode_becomes_rgb(mode):
    base = Image.new("RGB", (60, 60), (200, 100, 50))
    if mode in ("I;16", "I", "F"):
        img = Image.fromarray((np.arange(3600).reshape(60, 60) * 10).astype({"I;16": np.uint16, "I": np.int32,
                                                                               "F": np.float32}[mode]))
        fmt = "PNG" if mode == "I;16" else "TIFF"
    else:
        img = base.convert(mode)
        fmt = "JPEG" if mode == "CMYK" else "PNG"
    if mode == "RGBA":
        img.putalpha(0)  # fully transparent: must come out white
    out = decode_image(enc(img, fmt), MediaConfig())
    assert out.mode == "RGB" and out.size == (56, 56)
    if mode == "RGBA":
        assert np.asarray(out).min() == 255


def test_video_uniform_fps_window_and_frames():
    cfg = MediaConfig(video_frames=4)
    assert sample_frame_indices(16, 8.0, cfg) == [0, 5, 10, 15]
    assert sample_frame_indices(16, 8.0, MediaConfig(video_fps=2.0)) == [0, 4, 8, 12]
    assert sample_frame_indices(16, 8.0, MediaConfig(video_fps=8.0, video_max_frames=3)) == [0, 8, 15]
    assert sample_frame_indices(16, 8.0, cfg, start_s=1.0, end_s=2.0) == [8, 10, 13, 15]
    v = decode_video_bytes(good_video_bytes(1, frames=16), MediaConfig(video_frames=6, video_min_pixels=112 * 112))
    assert v.dtype == np.uint8 and v.shape == (6, 112, 112, 3)
    frames = [enc(Image.new("RGB", (60, 40), (i * 20, 0, 0)), "JPEG") for i in range(10)]
    seq = decode_frame_sequence(frames, MediaConfig(video_frames=5))
    assert seq.shape == (5, 56, 84, 3)


def test_tiny_qwen2vl_processor_accepts_the_outputs(tiny_policy, tmp_path):
    from transformers import AutoProcessor

    from dataio.reader import DataConfig, DataReader
    from dataio.synth import write_shards

    write_shards(str(tmp_path), images=3, videos=2, frame_sequences=1, samples_per_shard=10, image_size=150,
                 video_frames=8)
    # the tiny processor's own limits: images 3136..50176 pixels, video frames 3136..12544
    media = MediaConfig(image_max_pixels=50176, video_max_pixels=12544, video_frames=4)
    reader = DataReader(DataConfig(shards=[str(tmp_path)], media=media, workers=1))
    samples = list(reader.iter_epoch())
    reader.close()
    proc = AutoProcessor.from_pretrained(tiny_policy)
    assert len(samples) == 6
    for s in samples:
        kind = "image" if s.images else "video"
        msgs = [{"role": "user", "content": [{"type": kind}, {"type": "text", "text": s.prompt}]}]
        text = proc.apply_chat_template(msgs, add_generation_prompt=True)
        if s.images:
            out = proc(text=[text], images=s.images, return_tensors="pt")
            w, h = s.images[0].size
            assert out["image_grid_thw"].tolist() == [[1, h // 14, w // 14]]  # used as given, not resized
        else:
            v = s.videos[0]
            out = proc(text=[text], videos=[v], return_tensors="pt")
            t, h, w, _ = v.shape
            assert out["video_grid_thw"].tolist() == [[t // 2, h // 14, w // 14]]
        assert out["input_ids"].shape[1] > 10


@pytest.mark.parametrize("w, h", [(300, 4), (4, 300), (5000, 40), (150, 150)])
def test_the_processor_sizes_a_raw_image_as_the_reader_does(tiny_policy, w, h):
    from transformers import AutoProcessor

    proc = AutoProcessor.from_pretrained(tiny_policy)
    raw = Image.new("RGB", (w, h), (200, 100, 50))
    ours = decode_image(enc(raw, "PNG"), MediaConfig(image_max_pixels=50176))  # the tiny processor's limits
    theirs = proc.image_processor(images=[raw], return_tensors="pt")["image_grid_thw"].tolist()
    assert theirs == [[1, ours.size[1] // 14, ours.size[0] // 14]]


def _run(argv, capsys):
    from yatt_mm.cli import main

    assert main(argv) == 0
    return capsys.readouterr().out


def test_cli_synth_index_keys_inspect(tmp_path, capsys):
    ds = str(tmp_path / "ds")
    _run(["data", "synth", ds, "--images", "9", "--videos", "2", "--samples-per-shard", "4"], capsys)
    out = _run(["data", "index", f"{ds}/*.tar", "--out", str(tmp_path / "idx.parquet")], capsys)
    assert "11 samples" in out
    keys = {}
    for r in range(2):
        keys[r] = _run(["data", "keys", ds, "--dp-rank", str(r), "--dp-size", "2", "--workers", "3", "--seed", "1"],
                       capsys).split()
        again = _run(["data", "keys", ds, "--dp-rank", str(r), "--dp-size", "2", "--workers", "1", "--seed", "1"],
                     capsys).split()
        assert keys[r] == again  # workers do not change a rank's order
    assert sorted(keys[0] + keys[1]) == sorted(set(keys[0] + keys[1])) and len(keys[0] + keys[1]) == 11
    # a bad sample for inspect to count
    from dataio_helpers import js, write_tar

    write_tar(f"{ds}/zz-bad.tar", [("bad.jpg", b"not a jpeg"), ("bad.json", js())])
    out = _run(["data", "inspect", ds, "--json", "--sheet", str(tmp_path / "sheet.png")], capsys)
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["samples"] == 12 and summary["decoded"] == 11 and summary["skipped_by_reason"] == {"corrupt_image": 1}
    sheet = Image.open(tmp_path / "sheet.png")
    assert sheet.size[0] > 100
    q = [json.loads(x) for x in open(summary["quarantine_log"])]
    assert q[0]["key"] == "bad" and q[0]["shard"].endswith("zz-bad.tar")
