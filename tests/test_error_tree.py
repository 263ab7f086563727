"""Every exception class the library defines derives from TransportError (errors.py's promise):
a caller catches the library's failures with one except clause. Each is defined in
transport/errors.py and exported by ``transport``, its one import path (a private one, control
flow inside one module, excepted)."""

from __future__ import annotations

import ast
import importlib
import inspect
import os
from pathlib import Path

import pytest

import transport
import transport.errors as errors
from helpers.source import ROOT
from transport import TransportError

pytestmark = pytest.mark.unit

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


PACKAGE_FILES = sorted([*(ROOT / "transport").rglob("*.py"), *(ROOT / "backends").rglob("*.py")])
#: bases that make a class an error, as the source spells them
ERROR_BASES = {"Exception", "BaseException", "RuntimeError", "ValueError", "TimeoutError"}


def _exception_classes(tree: ast.AST, known: set[str]) -> list[ast.ClassDef]:
    """Classes whose bases name an exception class or an error of the tree."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            bases = {
                b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in node.bases
            }
            if bases & (ERROR_BASES | known) or any(b.endswith("Error") for b in bases):
                found.append(node)
    return found


def _error_names() -> set[str]:
    return {
        name
        for name, obj in vars(errors).items()
        if inspect.isclass(obj) and issubclass(obj, BaseException)
    }


def test_every_error_class_is_in_the_tree_and_exported() -> None:
    names = _error_names()
    assert len(names) > 20
    for name in names:
        cls = getattr(errors, name)
        assert issubclass(cls, transport.TransportError), f"{name} is not a TransportError"
        assert name in errors.__all__ and name in transport.__all__, f"{name} is not exported"
        assert getattr(transport, name) is cls


def test_no_error_class_is_defined_outside_the_tree() -> None:
    known = _error_names()
    elsewhere = []
    for path in PACKAGE_FILES:
        if path == ROOT / "transport" / "errors.py":
            continue
        tree = ast.parse(path.read_text())
        for node in _exception_classes(tree, known):
            if node.name.startswith("_"):
                continue  # control flow inside one module, never raised out of it
            elsewhere.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}")
    assert elsewhere == [], "define these in transport/errors.py:\n" + "\n".join(elsewhere)


def test_the_error_check_sees_an_error_defined_elsewhere() -> None:
    made_up = "class Refused(TransportError):\n    pass\nclass Gone(RuntimeError):\n    pass\n"
    found = _exception_classes(ast.parse(made_up), _error_names())
    assert [n.name for n in found] == ["Refused", "Gone"]
