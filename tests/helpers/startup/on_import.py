"""Patches applied to a module as it is first imported, for the sitecustomize modules of the test
processes (this folder's and helpers/as_stored's): nothing is imported before the process
itself imports the module."""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any


class _Finder(importlib.abc.MetaPathFinder):
    """Runs ``patch`` on module ``name`` right after its code ran (once), then leaves the path."""

    def __init__(self, name: str, patch: Callable[[ModuleType], None]) -> None:
        self.name, self.patch = name, patch

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        run, patch = spec.loader.exec_module, self.patch

        def exec_module(module: ModuleType) -> None:
            run(module)
            patch(module)

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def patch_on_import(name: str, patch: Callable[[ModuleType], None]) -> None:
    """``patch(module)`` once module ``name`` is imported: now if it already is."""
    if name in sys.modules:
        patch(sys.modules[name])
    else:
        sys.meta_path.insert(0, _Finder(name, patch))
