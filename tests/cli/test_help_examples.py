"""Every example in the commands' --help texts is true: each `yatt-mm ...` line of an epilog parses
with its command's own parser, every config a help text names exists, every `key=value` example
loads with the config its command reads, and every option's example is a value the option takes.
Loading only: no run starts."""

from __future__ import annotations

import argparse
import re
import shlex
from pathlib import Path

import pytest

from yatt_mm.cli import build_parser
from yatt_mm.config import load
from yatt_mm.demo import CONFIG as DEMO_CONFIG
from yatt_mm.launch import EXAMPLES, command_parser
from yatt_mm.rl.config import RLConfig
from yatt_mm.sft.config import SFTConfig

ROOT = Path(__file__).resolve().parents[2]

# The config class each command that takes overrides loads them into, and the config it reads
# when its help names none (the demo runs its own).
CONFIG_CLASS = {"yatt-mm rl": RLConfig, "yatt-mm sft": SFTConfig, "yatt-mm plan": RLConfig, "yatt-mm eval": RLConfig,
                "yatt-mm demo": RLConfig}
OWN_CONFIG = {"yatt-mm demo": DEMO_CONFIG}

EXAMPLE = re.compile(r"e\.g\. ((?:\S+)(?: \S+=\S+)*)")  # e.g. X, or e.g. a=1 b=2
COMMAND_LINE = re.compile(r"^\s+(yatt-mm .+)$", re.MULTILINE)
CONFIG_PATH = re.compile(r"configs/[\w./-]*")
OVERRIDE = re.compile(r"[\w.\[\]]+=\S+")


def _parsers() -> dict[str, argparse.ArgumentParser]:
    """Every command and subcommand by its prog; rl and sft by the parsers they really use (the
    main parser lists them for its own --help only)."""
    found: dict[str, argparse.ArgumentParser] = {}

    def walk(parser: argparse.ArgumentParser) -> None:
        found[parser.prog] = command_parser(parser.prog) if parser.prog in EXAMPLES else parser
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub in action.choices.values():
                    walk(sub)

    walk(build_parser())
    return found


PARSERS = _parsers()


def _texts(parser: argparse.ArgumentParser) -> list[str]:
    """The raw help strings (argparse's formatting would wrap long paths at hyphens)."""
    texts = [parser.description or "", parser.epilog or ""]
    for action in parser._actions:
        texts.append(action.help or "")
        if isinstance(action, argparse._SubParsersAction):
            texts += [choice.help or "" for choice in action._choices_actions]
    return texts


def _examples(text: str) -> list[str]:
    return [token.rstrip(",;)") for match in EXAMPLE.findall(text) for token in match.split()]


def _override_examples(parser: argparse.ArgumentParser) -> tuple[str | None, list[str]]:
    """(the config its --config help shows, the key=value settings its help shows)."""
    tokens = [t for text in _texts(parser) for t in _examples(text)]
    configs = [t for t in tokens if CONFIG_PATH.fullmatch(t)]
    return (configs[0] if configs else None), [t for t in tokens if OVERRIDE.fullmatch(t)]


def _command_lines() -> list[str]:
    return [line for parser in PARSERS.values() for line in COMMAND_LINE.findall(parser.epilog or "")]


def test_the_examples_cover_the_commands_that_take_a_config():
    with_overrides = {prog for prog, parser in PARSERS.items() if _override_examples(parser)[1]}
    assert with_overrides == set(CONFIG_CLASS), "a command's help shows overrides: add it to CONFIG_CLASS"
    assert {line.split()[1] for line in _command_lines()} >= {"rl", "sft"}


@pytest.mark.parametrize("path", sorted({p for parser in PARSERS.values() for text in _texts(parser)
                                         for p in CONFIG_PATH.findall(text)}))
def test_every_config_a_help_names_exists(path):
    assert (ROOT / path).exists(), path


@pytest.mark.parametrize("prog", sorted(CONFIG_CLASS))
def test_each_commands_override_examples_load_with_its_config(prog):
    config, overrides = _override_examples(PARSERS[prog])
    config = config or OWN_CONFIG[prog]
    load(CONFIG_CLASS[prog], ROOT / config, overrides)


@pytest.mark.parametrize("line", _command_lines())
def test_each_example_command_parses_and_its_config_loads(line):
    argv = shlex.split(line)[1:]
    prog = f"yatt-mm {argv[0]}"
    if prog in EXAMPLES:  # rl, sft: options and overrides in any order, then the config
        args = command_parser(prog).parse_intermixed_args(argv[1:])
        load(CONFIG_CLASS[prog], ROOT / args.config, args.overrides)
    else:
        build_parser().parse_args(argv)


@pytest.mark.parametrize("prog, option, example", [
    (prog, action.option_strings[-1], example)
    for prog, parser in PARSERS.items() for action in parser._actions
    if action.option_strings and action.type is not None for example in _examples(action.help or "")])
def test_each_option_example_is_a_value_the_option_takes(prog, option, example):
    action = next(a for a in PARSERS[prog]._actions if option in a.option_strings)
    action.type(example)
