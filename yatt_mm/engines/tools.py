"""Multi-turn rollouts with tools: the policy calls a tool, reads its reply, answers.

A response may take several assistant turns (`rollout.engine.tools.max_turns`). A turn that
holds a call, `<tool_call>{"name": "zoom", "arguments": {"box": [0, 0, 32, 32]}}</tool_call>`
(the format Qwen's chat templates teach), gets the tool's reply as the next user turn,
`<tool_response>...</tool_response>` with any image the tool returned, and the model goes on
from there. The last turn's text is the response's answer; the reward sees it alone.

The whole conversation stays token-exact: vLLM gets each next turn as token ids (the earlier
turns' sampled tokens as they were, never re-tokenised text), the reply's image placeholders
unexpanded (vLLM's processor expands them, as the trainer's sample builder does from the same
image grids), and the trainer scores exactly those tokens. The reply's tokens are context, not
actions: `Response.tool_mask` marks them, and they get no loss and no logprob.

A tool is a plain function `(images, **arguments) -> str | ToolResult`: `images` are the
conversation's images so far (the prompt's, then those earlier replies returned), the rest its
arguments, described to the model by the function's type hints and docstring (the schema a chat
template with tools renders). `zoom` is built in; `module:function` names anyone's own. A tool
runs where the rollout engine runs, on every rank of a multi-rank engine, so it must be a
deterministic function of its arguments and images. A call that cannot be read, an unknown tool
or a tool that raises becomes an error reply the model sees (counted in `tool_errors`, never a
crash of the run).
"""

from __future__ import annotations

import inspect
import json
import logging
import re
import typing
from dataclasses import dataclass, field
from typing import Any, Callable

from yatt_mm.registry import Registry

log = logging.getLogger(__name__)

CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)
MAX_REPLY_IMAGES = 1  # images one tool reply may hold (the engine's image limit grows by this per turn)


@dataclass
class ToolsConfig:
    names: list[str] = field(default_factory=list)  # tools the policy may call: zoom, or module:function
    max_turns: int = 1  # assistant turns per response, the final answer included; 1: single-turn
    max_reply_chars: int = 2000  # a reply's text is cut to this many characters (a log dump is no prompt)

    RANGES = {"max_turns": ">= 1", "max_reply_chars": ">= 1"}

    @property
    def active(self) -> bool:
        return bool(self.names) and self.max_turns > 1

    def validate(self) -> None:
        if self.names and self.max_turns < 2:
            raise ValueError(f"tools {self.names} need max_turns >= 2 (a call, then the answer); got {self.max_turns}")
        for name in self.names:  # an unknown, unloadable or undescribed tool fails at the config, not mid-run
            schema(name, TOOLS.get(name))

    @classmethod
    def of(cls, value: "ToolsConfig | dict | None") -> "ToolsConfig":
        """From a config (or its dict, as an engine worker receives it)."""
        if isinstance(value, cls):
            return value
        return cls(**(value or {}))


class ToolError(ValueError):
    """A call the tool cannot serve (bad arguments): its message is the reply the model reads."""


@dataclass
class ToolResult:
    text: str = ""
    images: list = field(default_factory=list)  # PIL images, at most MAX_REPLY_IMAGES


Tool = Callable[..., "str | ToolResult"]
TOOLS: Registry[Tool] = Registry("tool")


@TOOLS.register("zoom")
def zoom(images: list, box: list[float] | None = None, image: int = 0) -> ToolResult:
    """Zoom in on a region of an image: returns the region, enlarged.

    Args:
        images: The conversation's images.
        box: The region as [x0, y0, x1, y1] in the image's pixels; default: the image's centre half.
        image: Which image of the conversation to zoom into, counting from 0.
    """
    if not images:
        raise ToolError("there is no image to zoom into")
    if not isinstance(image, int) or not 0 <= image < len(images):
        raise ToolError(f"image must be an index from 0 to {len(images) - 1}, got {image!r}")
    picture = images[image]
    w, h = picture.size
    if box is None:
        box = [w / 4, h / 4, 3 * w / 4, 3 * h / 4]
    if (not isinstance(box, (list, tuple)) or len(box) != 4
            or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in box)):
        raise ToolError(f"box must be four numbers [x0, y0, x1, y1], got {box!r}")
    x0, y0 = max(0.0, float(box[0])), max(0.0, float(box[1]))
    x1, y1 = min(float(w), float(box[2])), min(float(h), float(box[3]))
    if x1 - x0 < 1 or y1 - y0 < 1:
        raise ToolError(f"box {list(box)} holds no pixels of the {w}x{h} image")
    crop = picture.crop((round(x0), round(y0), round(x1), round(y1)))
    # enlarged to the image's own size at most, and to the vision patches' minimum (28 px) at least
    scale = max(min(w / crop.width, h / crop.height), 28 / min(crop.width, crop.height))
    size = (max(1, round(crop.width * scale)), max(1, round(crop.height * scale)))
    return ToolResult(f"zoomed into [{round(x0)}, {round(y0)}, {round(x1)}, {round(y1)}] of image {image}",
                      [crop.resize(size)])


def schema(name: str, tool: Tool) -> dict:
    """The tool as a chat template's `tools` entry, by transformers' `get_json_schema`: from its
    type hints and its docstring's Args, leaving out the `images` every tool receives."""
    from transformers.utils import get_json_schema

    signature = inspect.signature(tool)
    if "images" not in signature.parameters:
        raise ValueError(f"tool {name!r}: its first parameter must be `images` (the conversation's images)")

    def described(): ...
    described.__name__ = name.rpartition(":")[2]
    described.__doc__ = tool.__doc__
    described.__signature__ = signature.replace(parameters=[p for p in signature.parameters.values() if p.name != "images"])
    described.__annotations__ = {k: v for k, v in typing.get_type_hints(tool).items() if k != "images"}
    try:
        return get_json_schema(described)
    except Exception as e:
        raise ValueError(f"tool {name!r} cannot be described to the model: give each argument a type hint and an "
                         f"'Args:' line in its docstring ({e})") from e


@dataclass
class Reply:
    text: str
    images: list
    error: bool


class ToolBox:
    """The tools of one engine: reads a turn's call, runs it, and renders the reply as the tokens
    of the next user turn in the model's chat template."""

    def __init__(self, cfg: ToolsConfig, tokenizer):
        self.cfg = cfg
        self.tools = {name: TOOLS.get(name) for name in cfg.names}
        self.schemas = [schema(name, tool) for name, tool in self.tools.items()]
        self.by_call_name = {s["function"]["name"]: self.tools[n] for s, n in zip(self.schemas, self.tools)}
        self.tokenizer = tokenizer
        self._reported: set[str] = set()
        self._turn_boundary(Reply("", [], False))  # a template that cannot append turns fails at the start

    def call(self, turn_text: str, images: list) -> Reply | None:
        """The reply to the turn's tool call; None when the turn makes none (it is the answer)."""
        match = CALL.search(turn_text)
        if match is None:
            return None
        try:
            name, arguments = _read_call(match.group(1))
            tool = self.by_call_name.get(name)
            if tool is None:
                raise ToolError(f"no tool named {name!r}; the tools are {', '.join(self.by_call_name)}")
            try:
                inspect.signature(tool).bind(list(images), **arguments)
            except TypeError as e:
                raise ToolError(f"{name}: {e}") from None
            result = tool(list(images), **arguments)
            if isinstance(result, str):
                result = ToolResult(result)
            if len(result.images) > MAX_REPLY_IMAGES:
                raise RuntimeError(f"tool {name!r} returned {len(result.images)} images; a reply holds at most "
                                   f"{MAX_REPLY_IMAGES}")
            return Reply(result.text[: self.cfg.max_reply_chars], list(result.images), False)
        except ToolError as e:
            return Reply(f"error: {e}"[: self.cfg.max_reply_chars], [], True)
        except Exception as e:  # a bug in a user's tool: the model reads the error, the log says where
            if type(e).__name__ not in self._reported:
                self._reported.add(type(e).__name__)
                log.warning("a tool call raised %s (logged once per kind; the model reads it as an error reply)",
                            type(e).__name__, exc_info=True)
            return Reply(f"error: {type(e).__name__}: {e}"[: self.cfg.max_reply_chars], [], True)

    def reply_tokens(self, reply: Reply, ended_with_eos: bool) -> list[int]:
        """The tokens from the end of the assistant's turn to the start of its next one: the end of
        its turn (unless it sampled that itself), the reply as a user turn, the next turn's header."""
        closing, opening = self._turn_boundary(reply)
        if ended_with_eos and closing.startswith(self.tokenizer.eos_token):
            closing = closing[len(self.tokenizer.eos_token):]
        return self.tokenizer.encode(closing + opening, add_special_tokens=False)

    def _turn_boundary(self, reply: Reply) -> tuple[str, str]:
        """(what closes an assistant turn, the reply's user turn with the next turn's header), cut
        from the chat template's rendering of a conversation around them."""
        marker = "\x00ASSISTANT\x00"
        head = [{"role": "user", "content": "q"}, {"role": "assistant", "content": marker}]
        content = [{"type": "image"} for _ in reply.images] + [
            {"type": "text", "text": f"<tool_response>\n{reply.text}\n</tool_response>"}]
        before = self.tokenizer.apply_chat_template(head, tokenize=False)
        full = self.tokenizer.apply_chat_template(head + [{"role": "user", "content": content}], tokenize=False,
                                                  add_generation_prompt=True)
        if not full.startswith(before) or marker not in before:
            raise RuntimeError("the chat template renders an earlier turn differently once another follows; "
                               "multi-turn rollouts need a template that appends turns (Qwen's do)")
        return before.split(marker, 1)[1], full[len(before):]


def _read_call(body: str) -> tuple[str, dict[str, Any]]:
    try:
        data = json.loads(body)
    except json.JSONDecodeError as e:
        raise ToolError(f"the tool call is not JSON ({e.msg})") from None
    if not isinstance(data, dict) or not isinstance(data.get("name"), str):
        raise ToolError('a tool call is {"name": ..., "arguments": {...}}')
    arguments = data.get("arguments", {})
    if isinstance(arguments, str):  # some templates teach arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            raise ToolError("the tool call's arguments are not JSON") from None
    if not isinstance(arguments, dict):
        raise ToolError("a tool call's arguments are a JSON object")
    return data["name"], arguments
