"""Tools of multi-turn rollouts without an engine: the built-in `zoom`, reading calls, error
replies, a user's own tool, the reply's tokens in the chat template, and the trainer's samples
of a multi-turn response."""

import random

import pytest
import torch
from PIL import Image

from dataio.synth import colour_image
from yatt_mm.config import ConfigError, load
from yatt_mm.engines.engine import Response
from yatt_mm.engines.tools import ToolBox, ToolError, ToolResult, ToolsConfig, schema, zoom
from yatt_mm.rl.config import RLConfig


def _image(w=64, h=48):
    img = Image.new("RGB", (w, h), "blue")
    img.paste((255, 0, 0), (0, 0, 8, 8))  # a small red square top left
    return img


def test_zoom_enlarges_the_box_and_refuses_what_it_cannot_serve():
    out = zoom([_image()], box=[0, 0, 8, 8])
    assert isinstance(out, ToolResult) and len(out.images) == 1
    crop = out.images[0]
    assert crop.size == (48, 48)  # 8x8 enlarged to the image's shorter side
    assert crop.getpixel((24, 24)) == (255, 0, 0)  # the red square fills it
    assert zoom([_image()]).images[0].getpixel((0, 0)) == (0, 0, 255)  # default: the centre half
    assert "[0, 0, 8, 8]" in out.text
    for bad, why in (({"box": [10, 10, 5, 5]}, "holds no pixels"), ({"box": [1, 2]}, "four numbers"),
                     ({"box": "all"}, "four numbers"), ({"image": 3}, "index from 0 to 0")):
        with pytest.raises(ToolError, match=why):
            zoom([_image()], **bad)
    with pytest.raises(ToolError, match="no image"):
        zoom([])
    # a tiny box is still at least the vision patches' 28 px
    assert min(zoom([_image()], box=[0, 0, 2, 2]).images[0].size) >= 28


def test_the_schema_describes_the_arguments_not_the_images():
    spec = schema("zoom", zoom)
    params = spec["function"]["parameters"]
    assert spec["function"]["name"] == "zoom" and set(params["properties"]) == {"box", "image"}
    assert "images" not in params.get("required", [])


def _box(tiny_policy, **cfg):
    from transformers import AutoTokenizer

    return ToolBox(ToolsConfig(names=cfg.pop("names", ["zoom"]), max_turns=3, **cfg),
                   AutoTokenizer.from_pretrained(str(tiny_policy)))


def test_calls_are_read_and_every_bad_call_gets_an_error_reply(tiny_policy):
    box = _box(tiny_policy)
    assert box.call("red", [_image()]) is None  # no call: the answer
    reply = box.call('look <tool_call>{"name": "zoom", "arguments": {"box": [0, 0, 8, 8]}}</tool_call>', [_image()])
    assert not reply.error and len(reply.images) == 1 and reply.images[0].size == (48, 48)
    # arguments as a JSON string (some templates teach that)
    assert not box.call('<tool_call>{"name": "zoom", "arguments": "{\\"image\\": 0}"}</tool_call>', [_image()]).error
    for text, why in (("<tool_call>{zoom}</tool_call>", "not JSON"),
                      ('<tool_call>{"name": "crop"}</tool_call>', "no tool named 'crop'"),
                      ('<tool_call>{"name": "zoom", "arguments": {"scale": 2}}</tool_call>', "unexpected keyword"),
                      ('<tool_call>{"name": "zoom", "arguments": {"box": [5, 5, 1, 1]}}</tool_call>', "holds no pixels"),
                      ('<tool_call>["zoom"]</tool_call>', '"name"')):
        reply = box.call(text, [_image()])
        assert reply.error and reply.text.startswith("error:") and why in reply.text, (text, reply.text)
        assert reply.images == []


def test_a_users_tool_by_module_path_and_its_exceptions(tiny_policy, tmp_path, monkeypatch):
    (tmp_path / "mytools.py").write_text(
        "def count_words(images, text: str) -> str:\n"
        "    '''Counts words.\n\n    Args:\n        images: the images.\n        text: the text.\n    '''\n"
        "    if text == 'boom':\n        raise KeyError('boom')\n"
        "    return str(len(text.split())) * 5000\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    box = _box(tiny_policy, names=["mytools:count_words"], max_reply_chars=10)
    assert [s["function"]["name"] for s in box.schemas] == ["count_words"]
    reply = box.call('<tool_call>{"name": "count_words", "arguments": {"text": "a b c"}}</tool_call>', [])
    assert reply == type(reply)("3" * 10, [], False)  # cut at max_reply_chars
    crashed = box.call('<tool_call>{"name": "count_words", "arguments": {"text": "boom"}}</tool_call>', [])
    assert crashed.error and crashed.text == "error: Key"  # "error: KeyError: ..." cut at 10


def test_the_reply_is_the_next_user_turn_in_the_chat_template(tiny_policy):
    box = _box(tiny_policy)
    tok = box.tokenizer
    reply = box.call('<tool_call>{"name": "zoom"}</tool_call>', [_image()])
    after_eos = tok.decode(box.reply_tokens(reply, ended_with_eos=True))
    assert after_eos.startswith("\n<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|><tool_response>\n")
    assert after_eos.endswith("</tool_response><|im_end|>\n<|im_start|>assistant\n")
    # a turn that stopped without its end-of-turn token gets it from the reply
    assert tok.decode(box.reply_tokens(reply, ended_with_eos=False)) == "<|im_end|>" + after_eos
    text_only = box.call('<tool_call>{"name": "crop"}</tool_call>', [_image()])
    assert "<|image_pad|>" not in tok.decode(box.reply_tokens(text_only, ended_with_eos=True))
    # a template that rewrites earlier turns once another follows (as some reasoning templates drop
    # old thinking) cannot grow a conversation token by token: refused when the engine starts
    tok.chat_template = ("{% for m in messages %}<|im_start|>{{ m.role }}\n"
                         "{% if m.role == 'assistant' and not loop.last %}...{% else %}{{ m.content }}{% endif %}"
                         "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    with pytest.raises(RuntimeError, match="multi-turn rollouts need a template that appends turns"):
        ToolBox(box.cfg, tok)


def test_tools_are_checked_when_the_config_loads():
    with pytest.raises(ConfigError, match="max_turns >= 2"):
        load(RLConfig, "configs/tiny_tools.yaml", ["rollout.engine.tools.max_turns=1"])
    with pytest.raises(ConfigError, match="unknown tool 'crop'"):
        load(RLConfig, "configs/tiny_tools.yaml", ["rollout.engine.tools.names=[crop]"])
    with pytest.raises(ConfigError, match="soft_penalty"):
        load(RLConfig, "configs/tiny_tools.yaml", ["algorithm.overlong.soft_penalty.buffer=4"])
    cfg = load(RLConfig, "configs/tiny_tools.yaml")
    assert cfg.rollout.engine.tools.active and ToolsConfig.of({"names": ["zoom"], "max_turns": 2}).active


def test_a_multi_turn_sample_scores_only_sampled_tokens_with_the_replys_image_expanded(tiny_policy):
    """The trainer's sample of a conversation: the reply's image placeholder becomes the image's
    tokens, the reply is context (no loss, no logprob), its image follows the prompt's, and the
    response with its own image gets media of its own beside its group's shared ones."""
    from transformers import AutoProcessor

    from yatt_mm.rl.samples import Group, Prompt, SampleBuilder, _collate
    from models.family import read_spec

    processor = AutoProcessor.from_pretrained(str(tiny_policy))
    tok = processor.tokenizer
    box = _box(tiny_policy)
    sample = colour_image(random.Random(0))
    prompt = Prompt("k", sample.question, sample.answer, images=[sample.image], origin="0/s/k")
    turn1 = tok.encode('<tool_call>{"name": "zoom"}</tool_call><|im_end|>')
    reply = box.call(tok.decode(turn1), [sample.image])
    reply_ids = box.reply_tokens(reply, ended_with_eos=True)
    turn2 = tok.encode("red<|im_end|>")
    tokens = turn1 + reply_ids + turn2
    multi = Response(tokens, "red", [-0.5] * len(turn1) + [0.0] * len(reply_ids) + [-0.25] * len(turn2), "stop",
                     tool_mask=[False] * len(turn1) + [True] * len(reply_ids) + [False] * len(turn2),
                     images=reply.images, turns=2, tool_calls=1)
    single = Response(turn2, "red", [-0.25] * len(turn2), "stop")
    template = lambda req: tok.apply_chat_template(req.messages, tokenize=False, add_generation_prompt=True)
    builder = SampleBuilder(processor, template)
    a, b = builder.build(Group(prompt, [multi, single], [1.0, 0.0]), [0.5, -0.5], masked=False)
    pad = tok.convert_tokens_to_ids("<|image_pad|>")
    grids = a.image_grid_thw
    assert grids.shape[0] == 2 and b.image_grid_thw.shape[0] == 1  # the prompt's image, then the reply's
    assert int((a.input_ids == pad).sum()) == int(grids.prod(-1).sum()) // 4  # each placeholder expanded (merge 2x2)
    p = b.input_ids.numel() - len(turn2)  # the prompt's tokens
    expanded_reply = len(reply_ids) - 1 + int(grids[1].prod()) // 4
    assert a.input_ids.numel() == p + len(turn1) + expanded_reply + len(turn2)
    assert a.loss_mask.sum() == len(turn1) + len(turn2) and b.loss_mask.sum() == len(turn2)
    reply_span = slice(p - 1 + len(turn1), p - 1 + len(turn1) + expanded_reply)
    assert a.loss_mask[reply_span].sum() == 0 and a.rollout_logprobs[reply_span].abs().sum() == 0
    assert a.rollout_logprobs.sum() == pytest.approx(-0.5 * len(turn1) - 0.25 * len(turn2))
    assert a.media_id and a.media_id != b.media_id == ""
    assert a.pixel_values.shape[0] == b.pixel_values.shape[0] + int(grids[1].prod())
    batch = _collate([a, b], read_spec(str(tiny_policy)), pad_id=0)
    # a's two images are its own (items 0, 1); b's one image is the group's (item 2), not a's first
    assert batch.inputs.image_sources.tolist() == [0, 1, 2]
    assert a.unpack(*a.pack()).media_id == a.media_id
