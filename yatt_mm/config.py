"""Typed configs from YAML plus `key=value` overrides, with errors that name the fix.

A config is a tree of dataclasses, each sitting with the code it configures. `load(Root,
"configs/x.yaml", ["rollout.sampling.n=8"])` reads the YAML, applies the overrides (`name[N]`
picks a list's item, as the errors name it: `reward.judges[0].judge.votes=4`), builds the
dataclasses (an unknown or mistyped key fails at once with its dotted path and the nearest valid
name), then calls every node's `validate()`, leaves first, so a bad value is reported with the
setting's full name. A field's documentation is the comment at the end of its line, which
`describe()` prints (`yatt-mm rl --help-config`; `markdown()` for `--help-config --markdown`).

A section's numeric settings have their allowed range in the class attribute `RANGES`, beside
the fields: `RANGES = {"n": ">= 1", "top_p": "(0, 1]", "fallback_score": "any"}` (a bound: >=, >,
<=, < a number; an interval: [a, b], (a, b), [a, b), (a, b]; any: every finite number). It is
plain data, so models/ and dataio/ declare theirs without importing yatt_mm; `validate()` checks
every section's ranges before its own `validate()` (None passes, lists and mappings are checked
item by item) and names the setting in full: "rollout.sampling.n must be >= 1, got 0".
`unranged()` lists the numeric settings without a range (the tests keep it empty).
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import inspect
import io
import json
import math
import os
import re
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


_INDEXED_PART = re.compile(r"(\w+)\[(\d+)\]")


def _split_index(part: str, override: str) -> tuple[str, int | None]:
    """'judges[0]' -> ('judges', 0); 'votes' -> ('votes', None)."""
    if "[" not in part and "]" not in part:
        return part, None
    if m := _INDEXED_PART.fullmatch(part):
        return m.group(1), int(m.group(2))
    raise ConfigError(f"override {override!r}: '{part}' must look like name[N], N a whole number from 0 "
                      "(for example reward.judges[0].weight=0.5)")


def _field_type(section: type | None, name: str, path: str) -> Any:
    """The declared type of `section`'s field `name` (None where the section is not known: a
    mapping, or no root type given); an unknown name fails here as it would in `build`."""
    if section is None:
        return None
    hints = typing.get_type_hints(section)
    fields = [f.name for f in dataclasses.fields(section) if f.init]
    if name not in fields:
        raise ConfigError(f"unknown setting '{path}'{_nearest(name, fields)}")
    return hints[name]


def _section_of(tp: Any) -> type | None:
    """The dataclass a value of type `tp` is built as (also inside Optional), else None."""
    if dataclasses.is_dataclass(tp):
        return tp
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return next((a for a in typing.get_args(tp) if dataclasses.is_dataclass(a)), None)
    return None


def _item_type(tp: Any) -> Any:
    """The item type of list[X] (also inside Optional), else None."""
    for candidate in (tp, *typing.get_args(tp)):
        if typing.get_origin(candidate) is list and typing.get_args(candidate):
            return typing.get_args(candidate)[0]
    return None


def _indexed_list(node: dict[str, Any], name: str, default: Any, path: str, index: int, override: str) -> list:
    """The list `node[name]` that `[index]` picks from. A list the config does not set is the
    root's default, so an index counts the items the run would get (reward.functions[0] is
    exact_match without a reward section)."""
    if name not in node and isinstance(default, list):
        node[name] = json.loads(json.dumps([to_dict(d) for d in default], default=str))  # as YAML reads it
    items = node.get(name)
    if not isinstance(items, list):
        now = f" (it is {items!r})" if name in node else ""
        raise ConfigError(f"override {override!r}: {path} is not a list{now}, so {path}[{index}] does not exist")
    if index >= len(items):
        count = f"{len(items)} item{'' if len(items) == 1 else 's'}"
        fix = f"indices 0 to {len(items) - 1}" if items else f"give the whole list instead: {path}=[...]"
        raise ConfigError(f"override {override!r}: {path} has {count}, so {path}[{index}] does not exist ({fix})")
    return items


def apply_override(data: dict[str, Any], override: str, root: type | None = None) -> None:
    """Set `a.b.c=value` in a nested dict; the value is parsed as YAML (numbers, lists, bools).

    `name[N]` picks item N of a list: `reward.judges[0].judge.votes=4` sets a field of the
    first judge, `data.shards[1]=DIR` replaces the second shard path. With `root` (the config's
    dataclass) unknown names fail here, and a list the YAML does not set is the default one."""
    if "=" not in override:
        raise ConfigError(f"override {override!r} must look like key=value (for example rollout.sampling.n=8)")
    key, raw = override.split("=", 1)
    try:
        value = yaml.safe_load(raw)
    except yaml.YAMLError as e:  # the value is YAML: an unclosed [ or { fails here
        raise ConfigError(f"override {override!r}: the value is not valid: {_yaml_problem(e, one_line=True)} "
                          "(quote a value meant as text)") from None
    parts = key.strip().split(".")
    node, section, defaults, path = data, root, _defaults(root), ""
    for depth, part in enumerate(parts):
        name, index = _split_index(part, override)
        path = f"{path}.{name}" if path else name
        tp = _field_type(section, name, path)
        default = getattr(defaults, name, None)
        holder: dict | list = node
        slot: str | int = name
        if index is not None:
            set_by_config = name in node
            holder, slot = _indexed_list(node, name, default, path, index, override), index
            default = None if set_by_config else default[index]  # the YAML's own item has no defaults here
            path, tp = f"{path}[{index}]", _item_type(tp)
        if depth == len(parts) - 1:
            holder[slot] = value
            return
        if index is None:
            holder.setdefault(name, {})
        node = holder[slot]
        if not isinstance(node, dict):
            raise ConfigError(f"override {override!r}: '{part}' is not a section")
        section, defaults = _section_of(tp), default


def _defaults(root: type | None) -> Any:
    """The root's default tree, or None (no root, or one with required fields)."""
    try:
        return root() if root is not None else None
    except TypeError:
        return None


def save(cfg: Any, path: str | Path) -> Path:
    """Write a config tree as YAML that `load` reads back to an equal tree."""
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
        data = _read_yaml(p) or {}
        if not isinstance(data, dict):
            raise ConfigError(f"{p}: the top level must be a mapping of sections")
    for override in overrides or []:
        apply_override(data, override, cls)
    cfg = build(cls, data)
    validate(cfg)
    return cfg


def _read_yaml(path: Path) -> Any:
    """The YAML of a config file; a file that is not UTF-8 text or not YAML is one line naming
    where (line and column) and what is wrong, not the parser's traceback."""
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[: e.start].count(b"\n") + 1
        column = e.start - (raw.rfind(b"\n", 0, e.start) + 1) + 1
        raise ConfigError(f"config file {path} is not UTF-8 text: byte 0x{raw[e.start]:02x} at line {line}, column "
                          f"{column}; save it as UTF-8") from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {path}: {_yaml_problem(e)}") from None


def _yaml_problem(e: yaml.YAMLError, one_line: bool = False) -> str:
    """'YAML syntax error at line L, column C: what the parser found (while parsing what, which
    starts at line L, column C)', 1-based as editors count; `one_line`: columns only."""

    def at(mark) -> str:
        return f"column {mark.column + 1}" if one_line else f"line {mark.line + 1}, column {mark.column + 1}"

    mark, context_mark = getattr(e, "problem_mark", None), getattr(e, "context_mark", None)
    what = " ".join(str(getattr(e, "problem", None) or e).split())
    if context := getattr(e, "context", None):
        what += f" ({' '.join(context.split())}" + (f", which starts at {at(context_mark)})" if context_mark else ")")
    return f"YAML syntax error{f' at {at(mark)}' if mark is not None else ''}: {what}"


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
    check_ranges(cfg, path)
    check = getattr(cfg, "validate", None)
    if check is not None:
        try:
            check()
        except ConfigError:
            raise
        except ValueError as e:
            raise ConfigError(f"{path}: {e}" if path else str(e)) from e


_BOUND = re.compile(r"(>=|>|<=|<)\s*(\S+)")
_INTERVAL = re.compile(r"([\[(])\s*([^,\s]+)\s*,\s*([^\])\s]+)\s*([\])])")


def in_range(value: float, spec: str) -> bool:
    """Whether `value` is a finite number inside `spec` (see RANGES in the module doc)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return False
    if spec == "any":
        return True
    if m := _BOUND.fullmatch(spec.strip()):
        op, bound = m.group(1), float(m.group(2))
        return {">=": value >= bound, ">": value > bound, "<=": value <= bound, "<": value < bound}[op]
    if m := _INTERVAL.fullmatch(spec.strip()):
        left, lo, hi, right = m.group(1), float(m.group(2)), float(m.group(3)), m.group(4)
        return (value >= lo if left == "[" else value > lo) and (value <= hi if right == "]" else value < hi)
    raise ValueError(f"range {spec!r}: write >= 1, > 0, [0, 1), (0, 1] ... or any")


def range_text(spec: str) -> str:
    """'>= 1', 'in (0, 1]', 'a finite number': what a setting must be."""
    return "a finite number" if spec == "any" else f"in {spec}" if spec.strip()[0] in "[(" else spec


def check_ranges(cfg: Any, path: str = "") -> None:
    """The section's settings against its RANGES; the error names the setting in full."""
    for name, spec in getattr(type(cfg), "RANGES", {}).items():
        value = getattr(cfg, name)
        items = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else [value]
        if any(v is not None and not in_range(v, spec) for v in items):
            raise ConfigError(f"{path + '.' if path else ''}{name} must be {range_text(spec)}, got {value!r}")


def _numeric(tp: Any) -> bool:
    """int or float, optional or as the items of a list, tuple or mapping."""
    origin = typing.get_origin(tp)
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if origin is dict:
        args = args[1:]
    elif origin not in (typing.Union, types.UnionType, list, tuple):
        return tp in (int, float)
    return any(_numeric(a) for a in args)


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


@dataclasses.dataclass
class Setting:
    key: str  # dotted, with [] for the items of a list of sections: reward.judges[].weight
    type: Any
    doc: str
    default: Any  # of the root's default tree (SFT's trainer.lr is 1e-3, not TrainerConfig's)
    range: str | None  # from the section's RANGES
    section: type | None  # the section's class, when this is a section (or a list of them)


def _settings(cls: type, prefix: str = "", defaults: Any = None):
    """Every setting and section of the tree, depth first."""
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    ranges = getattr(cls, "RANGES", {})
    if defaults is None:
        try:
            defaults = cls()
        except TypeError:  # a required field: the fields' own defaults
            pass
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        item = typing.get_args(tp)[0] if typing.get_origin(tp) is list and typing.get_args(tp) else None
        section = tp if dataclasses.is_dataclass(tp) else item if dataclasses.is_dataclass(item) else None
        key = f"{prefix}{f.name}"
        default = getattr(defaults, f.name) if defaults is not None else f.default if (
            f.default is not dataclasses.MISSING) else f.default_factory() if (
            f.default_factory is not dataclasses.MISSING) else None
        yield Setting(key, tp, docs.get(f.name, ""), default, ranges.get(f.name), section)
        if section is not None:
            yield from _settings(section, key + ("[]." if section is item else "."),
                                 default if section is tp else None)


def describe(cls: type) -> list[str]:
    """One line per setting of the tree: dotted key, type, allowed values, default, and its doc:
    `rollout.sampling.top_p (float, in (0, 1], default 1.0): ...`,
    `run.placement (str, 'full' | 'partial', default 'full'): ...`."""
    lines = []
    for s in _settings(cls):
        if s.section is not None:
            kind = "list of sections" if s.section is not s.type else "section"
            lines.append(f"{s.key} ({kind}): {s.doc}".rstrip())
            continue
        allowed = allowed_text(s, " | ", repr)
        what = ", ".join(part for part in (type_name(s.type), allowed, f"default {s.default!r}") if part)
        lines.append(f"{s.key} ({what}): {s.doc}")
    return lines


def choices(tp: Any) -> tuple:
    """The values a Literal type allows (also inside Optional), else ()."""
    for candidate in (tp, *typing.get_args(tp)):
        if typing.get_origin(candidate) is typing.Literal:
            return typing.get_args(candidate)
    return ()


def allowed_text(s: Setting, sep: str = ", ", show=str) -> str:
    """What a setting may be: its choices, or its range as `range_text` writes it; '' if free."""
    if options := choices(s.type):
        return sep.join(show(c) for c in options)
    return range_text(s.range) if s.range else ""


def type_name(tp: Any) -> str:
    """int, str | None, list[str], dict[str, int]; a Literal is the type of its choices."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Literal:
        return " | ".join(dict.fromkeys(type(a).__name__ for a in args))
    if origin in (typing.Union, types.UnionType):
        return " | ".join(type_name(a) for a in args)
    if origin is not None:
        return f"{origin.__name__}[{', '.join('...' if a is Ellipsis else type_name(a) for a in args)}]"
    return "None" if tp is type(None) else getattr(tp, "__name__", str(tp))


def markdown(cls: type, title: str) -> str:
    """A Markdown section: `## title`, then a table of every setting of the tree (dotted name,
    type, default as YAML/JSON, allowed values, doc), from the same sources as `describe()`."""

    def cell(text: str) -> str:
        return " ".join(str(text).split()).replace("|", "\\|")

    rows = ["| Setting | Type | Default | Allowed | Description |", "|---|---|---|---|---|"]
    for s in _settings(cls):
        if s.section is not None:
            kind = "list of sections" if s.section is not s.type else "section"
            rows.append(f"| **`{s.key}`** | {kind} | | | {cell(s.doc)} |")
            continue
        allowed = allowed_text(s, ", ", lambda c: f"`{c}`")
        rows.append(f"| `{s.key}` | {cell(type_name(s.type))} | `{cell(json.dumps(s.default))}` | {cell(allowed)} | "
                    f"{cell(s.doc)} |")
    return f"## {title}\n\n" + "\n".join(rows)


def undocumented(cls: type) -> list[str]:
    """Dotted keys of the tree with no doc comment (the tests keep this empty)."""
    return [s.key for s in _settings(cls) if not s.doc]


def unranged(cls: type) -> list[str]:
    """Dotted keys of the tree's numeric settings without a range, and RANGES entries that name
    no setting or do not parse (the tests keep this empty)."""
    bad = [s.key for s in _settings(cls) if s.section is None and _numeric(s.type) and not s.range]
    sections = [(cls, "")] + [(s.section, s.key + ".") for s in _settings(cls) if s.section is not None]
    for section, prefix in sections:
        names = {f.name for f in dataclasses.fields(section)}
        for name, spec in getattr(section, "RANGES", {}).items():
            try:
                in_range(0, spec)
            except ValueError as e:
                bad.append(f"{prefix}{name}: {e}")
            if name not in names:
                bad.append(f"{prefix}{name} (in RANGES, not a setting)")
    return bad
