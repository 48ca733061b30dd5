"""Typed configs from YAML plus `key=value` overrides, with errors that name the fix.

A config is a tree of dataclasses, each sitting with the code it configures. `load(Root,
"configs/x.yaml", ["rollout.n=8"])` reads the YAML, applies the overrides, builds the
dataclasses (an unknown or mistyped key fails at once with its dotted path and the nearest valid
name), then calls every node's `validate()`, leaves first, so a bad value is reported with the
setting's full name. A field's documentation is the comment at the end of its line, which
`describe()` prints (`yatt-mm rl --help-config`).
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import inspect
import io
import os
import tokenize
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

import yaml

T = TypeVar("T")


class ConfigError(ValueError):
    pass


def _nearest(name: str, options: list[str]) -> str:
    match = difflib.get_close_matches(name, options, n=1, cutoff=0.5)
    return f"; did you mean '{match[0]}'?" if match else f"; valid keys: {', '.join(sorted(options))}"


def _coerce(value: Any, tp: Any, path: str) -> Any:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, path)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if errors else f"{path}: cannot be {value!r}")
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, dict):
            raise ConfigError(f"{path}: expected a mapping of settings, got {value!r}")
        return build(tp, value, path)
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{path}: expected a list, got {value!r}")
        (item_tp, *_) = typing.get_args(tp) or (Any,)
        return [_coerce(v, item_tp, f"{path}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{path}: expected a mapping, got {value!r}")
        _, val_tp = typing.get_args(tp) or (Any, Any)
        return {k: _coerce(v, val_tp, f"{path}.{k}") for k, v in value.items()}
    if origin is typing.Literal:
        choices = typing.get_args(tp)
        if value not in choices:
            raise ConfigError(f"{path}: {value!r} is not one of {', '.join(map(repr, choices))}")
        return value
    if tp is Any:
        return value
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{path}: expected true or false, got {value!r}")
    if tp is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if tp is float and isinstance(value, str):
        try:  # YAML 1.1 reads 2e-4 (no dot) as a string
            return float(value)
        except ValueError:
            pass
    if tp is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    if tp is str and isinstance(value, (str, int, float)) and not isinstance(value, bool):
        return str(value)
    raise ConfigError(f"{path}: expected {getattr(tp, '__name__', tp)}, got {value!r}")


def build(cls: type[T], data: dict[str, Any], path: str = "") -> T:
    """Build dataclass `cls` from a mapping; unknown keys are errors with a suggestion."""
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    kwargs = {}
    for key, value in data.items():
        where = f"{path}.{key}" if path else key
        if key not in fields:
            raise ConfigError(f"unknown setting '{where}'{_nearest(key, list(fields))}")
        kwargs[key] = _coerce(value, hints[key], where)
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{path or cls.__name__}: {e}") from e


def to_dict(obj: Any) -> Any:
    return dataclasses.asdict(obj) if dataclasses.is_dataclass(obj) else obj


def apply_override(data: dict[str, Any], override: str) -> None:
    """Set `a.b.c=value` in a nested dict; the value is parsed as YAML (numbers, lists, bools)."""
    if "=" not in override:
        raise ConfigError(f"override {override!r} must look like key=value (for example rollout.n=8)")
    key, raw = override.split("=", 1)
    node = data
    parts = key.strip().split(".")
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override {override!r}: '{part}' is not a section")
    node[parts[-1]] = yaml.safe_load(raw)


def save(cfg: Any, path: str | Path) -> Path:
    """Write a config tree as YAML that `load` reads back to an equal tree."""
    import json

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    plain = json.loads(json.dumps(to_dict(cfg), default=str))  # tuples -> lists, paths -> str
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(yaml.safe_dump(plain, sort_keys=False))
    tmp.replace(path)  # several launchers of one run dir never leave a half-written file
    return path


def load(cls: type[T], path: str | Path | None = None, overrides: list[str] | None = None) -> T:
    data: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {p} not found")
        data = yaml.safe_load(p.read_text()) or {}
        if not isinstance(data, dict):
            raise ConfigError(f"{p}: the top level must be a mapping of sections")
    for override in overrides or []:
        apply_override(data, override)
    cfg = build(cls, data)
    validate(cfg)
    return cfg


def validate(cfg: Any, path: str = "") -> None:
    """Call `validate()` on every dataclass of the tree, children before parents; a ValueError
    becomes a ConfigError that names the section."""
    if not dataclasses.is_dataclass(cfg):
        return
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        where = f"{path}.{f.name}" if path else f.name
        for i, item in enumerate(value) if isinstance(value, list) else [(None, value)]:
            validate(item, where if i is None else f"{where}[{i}]")
    check = getattr(cfg, "validate", None)
    if check is not None:
        try:
            check()
        except ConfigError:
            raise
        except ValueError as e:
            raise ConfigError(f"{path}: {e}" if path else str(e)) from e


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """Field name -> the comment that ends its line in the class body, or else the comment
    lines right above it."""
    try:
        source = inspect.getsource(cls)
    except (OSError, TypeError):
        return {}
    names = {f.name for f in dataclasses.fields(cls)}
    trailing: dict[str, str] = {}
    above: dict[str, str] = {}
    block: list[str] = []
    field_on_line: dict[int, str] = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            text = tok.string.lstrip("#").strip()
            if tok.start[0] in field_on_line:
                trailing.setdefault(field_on_line[tok.start[0]], text)
            elif tok.line.strip().startswith("#"):
                block.append(text)
        elif tok.type == tokenize.NAME and tok.start[1] == 4 and tok.string in names:
            field_on_line[tok.start[0]] = tok.string
            if block:
                above[tok.string] = " ".join(block)
            block = []
        elif tok.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT) and tok.start[1] == 4:
            block = []
    return {n: trailing.get(n) or above.get(n, "") for n in names if trailing.get(n) or above.get(n)}


def _settings(cls: type, prefix: str = ""):
    """(dotted key, field, its type, its doc, the section's class or None), depth first."""
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        item = typing.get_args(tp)[0] if typing.get_origin(tp) is list and typing.get_args(tp) else None
        section = tp if dataclasses.is_dataclass(tp) else item if dataclasses.is_dataclass(item) else None
        key = f"{prefix}{f.name}"
        yield key, f, tp, docs.get(f.name, ""), section
        if section is not None:
            yield from _settings(section, key + ("[]." if section is item else "."))


def describe(cls: type) -> list[str]:
    """One line per setting of the tree: dotted key, type, default, and its doc."""
    lines = []
    for key, f, tp, doc, section in _settings(cls):
        if section is not None:
            lines.append(f"{key}:{' list of' if section is not tp else ''}  {doc}".rstrip())
            continue
        default = f.default if f.default is not dataclasses.MISSING else (
            f.default_factory() if f.default_factory is not dataclasses.MISSING else None)
        name = getattr(tp, "__name__", None) or str(tp).replace("typing.", "")
        lines.append(f"{key} ({name}, default {default!r}): {doc}")
    return lines


def undocumented(cls: type) -> list[str]:
    """Dotted keys of the tree with no doc comment (the tests keep this empty)."""
    return [key for key, _, _, doc, _ in _settings(cls) if not doc]
