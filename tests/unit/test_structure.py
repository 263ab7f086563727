"""The structure the next engineer relies on: one job per module (none much over 600 lines), every
class says what it owns, no import cycles, and no module reaching into another's private members
(ruff's SLF001; the tests' one exception is tests/helpers/internals.py)."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = {"transport": ROOT / "transport", "transport.backends": ROOT / "backends"}
MAX_LINES = 600


def modules() -> dict[str, Path]:
    """Every module of the package by dotted name (backends/ is installed as transport.backends)."""
    out = {}
    for pkg, root in PACKAGES.items():
        for path in sorted(root.rglob("*.py")):
            rel = path.relative_to(root).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            out[".".join([pkg, *parts])] = path
    return out


def runtime_imports(path: Path, name: str, known: set[str]) -> set[str]:
    """The package modules ``name`` imports when it is imported: module level, outside ``if
    TYPE_CHECKING:`` (imports inside functions run later and cannot make a cycle at import)."""
    tree = ast.parse(path.read_text())
    found: set[str] = set()
    is_pkg = path.name == "__init__.py"
    here = name if is_pkg else name.rsplit(".", 1)[0]

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, ast.If):
                test = ast.unparse(node.test)
                if "TYPE_CHECKING" not in test:
                    visit(node.body)
                    visit(node.orelse)
            elif isinstance(node, ast.Try):
                visit(node.body)
            elif isinstance(node, ast.Import):
                found.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = here.split(".")
                    anchor = anchor[: len(anchor) - (node.level - 1)]
                    base = ".".join([*anchor, base] if base else anchor)
                found.add(base)
                found.update(f"{base}.{a.name}" for a in node.names)

    visit(tree.body)
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


def test_the_package_has_no_import_cycles():
    mods = modules()
    known = set(mods)
    graph = {n: runtime_imports(p, n, known) for n, p in mods.items()}
    # a package's __init__ importing its own submodules is how packages work, not a cycle
    for n in graph:
        graph[n] = {m for m in graph[n] if not m.startswith(n + ".")}
    cycles: list[list[str]] = []
    state: dict[str, int] = {}
    stack: list[str] = []

    def walk(n: str) -> None:
        state[n] = 1
        stack.append(n)
        for m in sorted(graph[n]):
            if state.get(m) == 1:
                cycles.append([*stack[stack.index(m) :], m])
            elif m not in state:
                walk(m)
        stack.pop()
        state[n] = 2

    for n in sorted(graph):
        if n not in state:
            walk(n)
    assert cycles == []


def test_the_import_check_sees_a_cycle(tmp_path):
    """The cycle check above can fail: two modules importing each other are found."""
    a, b = tmp_path / "a.py", tmp_path / "b.py"
    a.write_text("from pkg import b\n")
    b.write_text(
        "import pkg.a\nfrom typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import pkg.c\n"
    )
    known = {"pkg.a", "pkg.b", "pkg.c"}
    assert runtime_imports(a, "pkg.a", known) == {"pkg.b"}
    assert runtime_imports(b, "pkg.b", known) == {"pkg.a"}


@pytest.mark.skipif(shutil.which("ruff") is None and not (Path(sys.executable).parent / "ruff").exists(),
                    reason="ruff is not installed (pip install -e '.[dev]')")  # fmt: skip
def test_no_private_member_access_across_modules():
    ruff = shutil.which("ruff") or str(Path(sys.executable).parent / "ruff")
    out = subprocess.run(
        [ruff, "check", "--select", "SLF001", "--no-cache", "--output-format", "concise",
         "transport", "backends", "tests"],
        cwd=ROOT, capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:]
