"""Every exception class the library defines derives from TransportError (errors.py's promise):
a caller catches the library's failures with one except clause."""

from __future__ import annotations

import importlib
import inspect
import os
from pathlib import Path

import transport
from transport import TransportError

# modules that import a framework only a machine with it has (vLLM, verl, Ray)
OPTIONAL = ("transport.integrations.",)


def package_modules() -> list[str]:
    """The package's Python modules, found by their files (walking the packages would import
    the optional ones to list them: vLLM, verl and Ray, a minute of CPU)."""
    root = Path(transport.__file__).parent
    out = []
    for folder, _, files in os.walk(root, followlinks=True):  # transport/backends is a link
        rel = Path(folder).relative_to(root)
        for f in files:
            if not f.endswith(".py") or f == "__main__.py":
                continue
            parts = ["transport", *rel.parts] + ([] if f == "__init__.py" else [f[:-3]])
            name = ".".join(parts)
            if not (name + ".").startswith(OPTIONAL) and "__pycache__" not in rel.parts:
                out.append(name)
    return sorted(out)


def test_every_exception_class_of_the_library_is_a_transport_error():
    outside = []
    for name in package_modules():
        module = importlib.import_module(name)
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if (
                cls.__module__ == name
                and issubclass(cls, BaseException)
                and not issubclass(cls, TransportError)
            ):
                outside.append(f"{name}.{cls.__name__}")
    assert outside == []


def test_the_walk_sees_the_layers_above_the_core():
    names = set(package_modules())
    assert {"transport.weights.layouts", "transport.cluster.links", "transport.cli"} <= names
