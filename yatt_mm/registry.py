"""Plug-ins chosen by name in a config: reward rules, judges, rollout filters, SFT examples.

A registry maps names to objects that `@REGISTRY.register("name")` adds; a config may also name
anyone's own object as `module:attribute`, imported on first use, so a user's reward function
or filter needs no change to yatt-mm.
"""

from __future__ import annotations

import importlib
from typing import Callable, Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    def __init__(self, kind: str):
        self.kind = kind  # what the entries are, for error messages ("reward function", ...)
        self.entries: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        def add(obj: T) -> T:
            self.entries[name] = obj
            return obj

        return add

    def get(self, spec: str) -> T:
        """A registered name, or `module:attribute`."""
        if spec in self.entries:
            return self.entries[spec]
        if ":" in spec:
            module, _, attr = spec.partition(":")
            try:
                return getattr(importlib.import_module(module), attr)
            except (ImportError, AttributeError) as e:
                raise ValueError(f"{self.kind} {spec!r} cannot be loaded: {e}") from e
        raise ValueError(f"unknown {self.kind} {spec!r}; registered: {', '.join(sorted(self.entries))}, "
                         "or give module:function for your own")

    def names(self) -> list[str]:
        return sorted(self.entries)
