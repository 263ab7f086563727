"""The structure the next engineer relies on: one job per module (none much over 600 lines), every
class says what it owns, no import cycles (every import counts: type-only and function-level ones
too), no module reaching into another's private members (ruff's SLF001; the tests' one
exception is tests/helpers/internals.py), and the formatter deciding every layout (ruff format,
no markers that turn it off)."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.source import ROOT, modules

pytestmark = pytest.mark.unit

MAX_LINES = 600


def imports(path: Path, name: str, known: set[str]) -> set[str]:
    """Every package module ``name`` imports anywhere in its file: at module level, under ``if
    TYPE_CHECKING:``, inside functions and classes. A type-only or a deferred import is still a
    dependency, and hiding one in a function does not remove it."""
    found: set[str] = set()
    here = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = here.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            found.add(base)
            found.update(f"{base}.{a.name}" for a in node.names)
    return {m for m in found if m in known and m != name}


def test_no_module_of_the_package_is_much_over_600_lines():
    long = {n: len(p.read_text().splitlines()) for n, p in modules().items()}
    assert {n: k for n, k in long.items() if k > MAX_LINES} == {}


def test_every_class_of_the_package_has_a_docstring():
    missing = [
        f"{name}.{node.name}"
        for name, path in modules().items()
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ClassDef) and not ast.get_docstring(node)
    ]
    assert missing == []


def import_graph(files: dict[str, Path]) -> dict[str, set[str]]:
    """Which of ``files`` (dotted name -> path) each one imports; a package's ``__init__``
    importing its own submodules is how packages work, not a dependency that makes a cycle."""
    graph = {n: imports(p, n, set(files)) for n, p in files.items()}
    return {n: {m for m in deps if not m.startswith(n + ".")} for n, deps in graph.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every cycle a depth-first walk of ``graph`` meets, each as its path back to its start."""
    found: list[list[str]] = []
    state: dict[str, int] = {}
    stack: list[str] = []

    def walk(n: str) -> None:
        state[n] = 1
        stack.append(n)
        for m in sorted(graph[n]):
            if state.get(m) == 1:
                found.append([*stack[stack.index(m) :], m])
            elif m not in state:
                walk(m)
        stack.pop()
        state[n] = 2

    for n in sorted(graph):
        if n not in state:
            walk(n)
    return found


def test_the_package_has_no_import_cycles():
    assert cycles(import_graph(modules())) == []


def test_the_import_check_sees_a_cycle(tmp_path):
    """The cycle check above can fail: a cycle closed by a type-only import and a function-level
    one (inside a method) is found, while a package's ``__init__`` importing its submodule, which
    imports the package back, is not a cycle."""
    (tmp_path / "__init__.py").write_text("from pkg import a\n")
    (tmp_path / "a.py").write_text("from pkg import b\n")
    (tmp_path / "b.py").write_text(
        "from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    from pkg.c import C\n"
    )
    (tmp_path / "c.py").write_text("class C:\n    def f(self):\n        from . import a\n")
    files = {"pkg": tmp_path / "__init__.py"}
    files.update({f"pkg.{m}": tmp_path / f"{m}.py" for m in "abc"})
    graph = import_graph(files)
    assert graph == {
        "pkg": set(),
        "pkg.a": {"pkg", "pkg.b"},
        "pkg.b": {"pkg.c"},
        "pkg.c": {"pkg", "pkg.a"},
    }
    assert cycles(graph) == [["pkg.a", "pkg.b", "pkg.c", "pkg.a"]]


RUFF = shutil.which("ruff") or str(Path(sys.executable).parent / "ruff")


@pytest.mark.skipif(
    not Path(RUFF).exists(), reason="ruff is not installed (pip install -e '.[dev]')"
)
def test_no_private_member_access_across_modules():
    out = subprocess.run(
        [
            RUFF,
            "check",
            "--select",
            "SLF001",
            "--no-cache",
            "--output-format",
            "concise",
            "transport",
            "backends",
            "tests",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    assert out.returncode == 0, out.stdout[-3000:]


#: every folder of Python the repository holds
SOURCES = ("transport", "backends", "tests", "examples", "benchmarks")


@pytest.mark.skipif(
    not Path(RUFF).exists(), reason="ruff is not installed (pip install -e '.[dev]')"
)
def test_the_formatter_decides_every_layout():
    out = subprocess.run(
        [RUFF, "format", "--check", "--no-cache", *SOURCES],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    marker = "fmt: " + "skip", "fmt: " + "off"  # spelled apart so that this file has neither
    held = [
        str(path.relative_to(ROOT))
        for folder in SOURCES
        for path in sorted((ROOT / folder).rglob("*.py"))
        if any(m in path.read_text() for m in marker)
    ]
    assert held == []


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
        for path in modules().values()
        for line, call in _logger_names(ast.parse(path.read_text()))
    ]
    assert bad == [], "use logging.getLogger(__name__):\n" + "\n".join(bad)
    made_up = 'import logging\nlog = logging.getLogger("transport.weights")\n'
    assert _logger_names(ast.parse(made_up)) == [(2, "logging.getLogger('transport.weights')")]


def test_test_folders_are_not_packages_and_test_names_are_unique():
    """The folders of tests mirror the packages (tests/cuda, tests/integrations/vllm, ...), and a
    folder that were a package would be importable under that name: pytest puts the folders of
    tests on ``sys.path``, where a package ``cuda`` or ``vllm`` of ours would hide the installed
    one from every child process. Without ``__init__.py`` each test file is a module of its own
    name, so the names must be unique."""
    tests = ROOT / "tests"
    packages = [
        str(p.relative_to(ROOT))
        for p in tests.rglob("__init__.py")
        if "helpers" not in p.relative_to(tests).parts
    ]
    assert packages == []
    names = [p.name for p in tests.rglob("test_*.py")]
    assert len(names) > 100
    assert sorted({n for n in names if names.count(n) > 1}) == []
