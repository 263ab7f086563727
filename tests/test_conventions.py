"""Rules of the source that a reader relies on, checked on its syntax tree: every error class in
the one tree (``transport/errors.py``, under TransportError, exported by ``transport``) and every
logger named after its module."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import transport
import transport.errors as errors

ROOT = Path(__file__).resolve().parents[1]
SOURCES = sorted([*(ROOT / "transport").rglob("*.py"), *(ROOT / "backends").rglob("*.py")])
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
    for path in SOURCES:
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


def _logger_names(tree: ast.AST) -> list[tuple[int, str]]:
    """Each ``logging.getLogger(...)`` call whose argument is not ``__name__``."""
    bad = []
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "getLogger"
            and not (
                len(node.args) == 1
                and isinstance(node.args[0], ast.Name)
                and node.args[0].id == "__name__"
            )
        ):
            bad.append((node.lineno, ast.unparse(node)))
    return bad


def test_loggers_are_named_after_their_modules() -> None:
    bad = [
        f"{path.relative_to(ROOT)}:{line} {call}"
        for path in SOURCES
        for line, call in _logger_names(ast.parse(path.read_text()))
    ]
    assert bad == [], "use logging.getLogger(__name__):\n" + "\n".join(bad)
    made_up = 'import logging\nlog = logging.getLogger("transport.weights")\n'
    assert _logger_names(ast.parse(made_up)) == [(2, "logging.getLogger('transport.weights')")]
