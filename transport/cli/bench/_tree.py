"""Import ``transport`` from given directories, ahead of whatever is installed: benchmark
readers run the very code the writer imported. Imports nothing from ``transport``, so it can be
loaded by its path before ``transport`` is importable."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
from collections.abc import Mapping, Sequence


class TreeFinder(importlib.abc.MetaPathFinder):
    """Finds the packages it was given (``transport`` -> a directory, ``transport.backends`` ->
    another) and nothing else; their submodules come from those directories as usual."""

    def __init__(self, dirs: Mapping[str, str]) -> None:
        self.dirs = dict(dirs)

    def find_spec(
        self, fullname: str, path: Sequence[str] | None = None, target: object = None
    ) -> importlib.machinery.ModuleSpec | None:
        d = self.dirs.get(fullname)
        if d is None:
            return None
        return importlib.util.spec_from_file_location(
            fullname, os.path.join(d, "__init__.py"), submodule_search_locations=[d]
        )


def tree_dirs(root: str) -> dict[str, str]:
    """The package directories of a source checkout at ``root``."""
    return {
        "transport": os.path.join(root, "transport"),
        "transport.backends": os.path.join(root, "backends"),
    }


def use_tree(dirs: Mapping[str, str]) -> bool:
    """Import the packages of ``dirs`` from there from now on (False, and no change, when a
    directory is not a package)."""
    if not all(os.path.isfile(os.path.join(d, "__init__.py")) for d in dirs.values()):
        return False
    sys.meta_path.insert(0, TreeFinder(dirs))
    return True
