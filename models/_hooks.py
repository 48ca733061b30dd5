"""Import hooks that apply `models.runtime`'s fixes in every Python process of the environment.

Why hooks: some processes that need the fixes never import yatt-mm: vLLM inspects model classes in
a fresh subprocess (which imports torchvision), and Megatron's checkpoint writers are spawned
workers that import megatron directly. `make setup` puts a one-line `.pth` file into the virtual
environment that imports this module at interpreter start, so those processes get the fixes too.

This module imports only the standard library: it runs in every process (pip included), so it
must cost nothing until torchvision or megatron is actually imported.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys

_BEFORE = "torchvision"  # fix before it executes: its import itself is what fails
_AFTER = "megatron.core"  # patch after it executes: the patches replace its functions


class _RuntimeFixFinder(importlib.abc.MetaPathFinder):
    def __init__(self) -> None:
        self._done: set[str] = set()

    def find_spec(self, fullname, path, target=None):
        if fullname not in (_BEFORE, _AFTER) or fullname in self._done:
            return None
        self._done.add(fullname)
        if fullname == _BEFORE:
            from models import runtime

            runtime.fix_torchvision_ops()
            return None  # let the normal finders import it
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return None
        spec.loader = _PatchAfterLoad(spec.loader)
        return spec


class _PatchAfterLoad(importlib.abc.Loader):
    def __init__(self, loader) -> None:
        self._loader = loader

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module) -> None:
        from models import runtime

        runtime.quiet_expected_warnings()  # before: megatron warns while it imports
        self._loader.exec_module(module)
        runtime.patch_megatron_for_missing_kernels()
        if not runtime.has_gpu():
            runtime.patch_megatron_for_cpu()


def install() -> None:
    if not any(isinstance(f, _RuntimeFixFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _RuntimeFixFinder())


install()
