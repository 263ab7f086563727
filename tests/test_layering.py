"""The layering of the shared DESIGN.md, enforced on the source: every import of the package read
from its syntax tree (no module is imported), checked against four rules.

1. A lower layer never imports an upper one (core < weights < integrations < cli), anywhere in
   a module: at its top, in a function, or for type checking only. The one exception is the
   public facade (``transport/__init__.py``), which loads the weight-sync names of its
   ``__all__`` on first use, inside ``__getattr__`` (and names them for type checkers).
2. The layers above the core (weights/, integrations/) import from the core only its public API
   (``transport``, ``transport.store``, ``transport.backends``) and the internal contract
   (``transport.contract``).
3. No module imports a private name (``_x``) or a private module (``_x.py``) of another package.
4. integrations/ and cli/ import weights/ only through its packages (``transport.weights``,
   ``transport.weights.<package>``), never a module inside one: a package's ``__init__`` says
   what it offers the layers above.

(No import cycle, counting every import, is tests/test_structure.py's rule.)

Each rule is also run on a made-up module that breaks it, so that a checker that sees nothing
fails here too.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from helpers.source import modules

#: layers from the bottom; a module belongs to the deepest prefix that names it, else the core
LAYERS = {"transport.weights": 1, "transport.integrations": 2, "transport.cli": 3}
LAYER_NAMES = {0: "the core", 1: "weights/", 2: "integrations/", 3: "cli/"}
#: what the layers above the core may import of it
CORE_API = frozenset({"transport", "transport.contract", "transport.store", "transport.backends"})
FACADE = "transport"


@dataclass(frozen=True)
class Import:
    """One import in a module: the module it names, the names it takes, where it stands."""

    importer: str
    target: str
    names: tuple[str, ...]
    line: int
    at_import_time: bool  # runs when the importer is imported (not in a function, not typing-only)
    in_function: str | None


def layer(module: str) -> int:
    """The layer of ``module`` (0 for the core)."""
    for prefix, rank in LAYERS.items():
        if module == prefix or module.startswith(prefix + "."):
            return rank
    return 0


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imports_of(module: str, source: str, is_package: bool = False) -> Iterator[Import]:
    """The imports of ``source`` (the text of ``module``) that name the package."""
    package = module if is_package else module.rpartition(".")[0]

    def walk(node: ast.AST, runtime: bool, function: str | None) -> Iterator[Import]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child.test):
                for stmt in child.body:
                    yield from walk_one(stmt, False, function)
                for stmt in child.orelse:
                    yield from walk_one(stmt, runtime, function)
                continue
            yield from walk_one(child, runtime, function)

    def walk_one(node: ast.AST, runtime: bool, function: str | None) -> Iterator[Import]:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            name = getattr(node, "name", "<lambda>")
            yield from walk(node, False, function or name)
            return
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "transport":
                    yield Import(module, alias.name, (), node.lineno, runtime, function)
            return
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] == "transport":
                names = tuple(a.name for a in node.names)
                yield Import(module, target, names, node.lineno, runtime, function)
            return
        yield from walk(node, runtime, function)

    yield from walk(ast.parse(source), True, None)


def resolve(imp: Import, known: set[str]) -> list[str]:
    """The modules an import loads by name: each imported name that is a module, and the target
    unless every name is one (``from package import module`` needs of the package only that it
    began, as it has when the package is the importer's own)."""
    submodules = [f"{imp.target}.{n}" for n in imp.names if f"{imp.target}.{n}" in known]
    if imp.target not in known or (imp.names and len(submodules) == len(imp.names)):
        return submodules
    return [imp.target, *submodules]


# -- the rules -------------------------------------------------------------------------------


def upward(imp: Import, known: set[str]) -> list[str]:
    """Rule 1: imports of a higher layer than the importer's."""
    bad = []
    for target in resolve(imp, known):
        if layer(target) <= layer(imp.importer):
            continue
        if imp.importer == FACADE and (imp.in_function == "__getattr__" or not imp.at_import_time):
            continue
        bad.append(
            f"{imp.importer}:{imp.line} ({LAYER_NAMES[layer(imp.importer)]}) imports {target} "
            f"({LAYER_NAMES[layer(target)]})"
        )
    return bad


def past_api(imp: Import, known: set[str]) -> list[str]:
    """Rule 2: imports of the core by weights/ or integrations/ past its API and contract."""
    if layer(imp.importer) not in (1, 2):
        return []
    bad = []
    for target in resolve(imp, known):
        if (
            layer(target) == 0
            and target not in CORE_API
            and target.rpartition(".")[0] not in ("transport.backends",)
        ):
            bad.append(
                f"{imp.importer}:{imp.line} imports {target}: the layers above the core import "
                f"only {', '.join(sorted(CORE_API))} (put what they need in transport/contract.py)"
            )
    return bad


def private(imp: Import, known: set[str]) -> list[str]:
    """Rule 3: a private name or module of another package (the package that holds a private
    module or the module of a private name, and its subpackages, may import it)."""
    bad = []
    for target in resolve(imp, known):
        owner, _, last = target.rpartition(".")
        if _private(last) and not _inside(imp.importer, owner):
            bad.append(f"{imp.importer}:{imp.line} imports the private module {target}")
    owner = imp.target.rpartition(".")[0]
    for name in imp.names:
        if (
            _private(name)
            and f"{imp.target}.{name}" not in known
            and not _inside(imp.importer, owner)
        ):
            bad.append(f"{imp.importer}:{imp.line} imports the private name {imp.target}.{name}")
    return bad


def past_packages(imp: Import, known: set[str]) -> list[str]:
    """Rule 4: integrations/ or cli/ importing a module inside a package of weights/."""
    if layer(imp.importer) < 2:
        return []
    bad = []
    for target in resolve(imp, known):
        parts = target.split(".")
        if layer(target) == 1 and len(parts) > 3:
            bad.append(
                f"{imp.importer}:{imp.line} imports {target}: the layers above import weights/ "
                f"through its packages (export it from {'.'.join(parts[:3])})"
            )
    return bad


def _inside(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def _private(name: str) -> bool:
    return name.startswith("_") and not name.endswith("__")


# -- the package -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def package() -> tuple[list[Import], set[str]]:
    found = modules()
    all_imports = []
    for name, path in found.items():
        is_package = path.name == "__init__.py"
        all_imports += imports_of(name, path.read_text(), is_package)
    return all_imports, set(found)


@pytest.mark.parametrize(
    "rule", [upward, past_api, private, past_packages], ids=lambda r: r.__name__
)
def test_package_keeps_rule(package: tuple[list[Import], set[str]], rule) -> None:
    all_imports, known = package
    assert len(all_imports) > 500  # the whole package was read
    broken = [line for imp in all_imports for line in rule(imp, known)]
    assert broken == [], "\n".join(broken)


# -- each rule catches what it is for ---------------------------------------------------------------

KNOWN = {
    "transport",
    "transport.contract",
    "transport.wire",
    "transport._transport",
    "transport.peers",
    "transport.peers.liveness",
    "transport.weights",
    "transport.weights.group",
    "transport.weights.group.lease",
    "transport.integrations.vllm.trainer",
    "transport.backends",
    "transport.backends.nixl",
    "transport.cli.bench._systems",
}


def _made_up(module: str, source: str) -> list[Import]:
    return list(imports_of(module, source))


def test_upward_catches_a_core_module_importing_weights() -> None:
    source = "def f():\n    from transport.weights.group import lease\n"
    imps = _made_up("transport.wire", source)
    assert [line for imp in imps for line in upward(imp, KNOWN)] == [
        "transport.wire:2 (the core) imports transport.weights.group.lease (weights/)",
    ]
    typing_only = (
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import transport.weights\n"
    )
    assert [line for imp in _made_up("transport.wire", typing_only) for line in upward(imp, KNOWN)]
    lazy_facade = "def __getattr__(name):\n    import transport.weights\n"
    assert not [line for imp in _made_up("transport", lazy_facade) for line in upward(imp, KNOWN)]
    eager_facade = "import transport.weights\n"
    assert [line for imp in _made_up("transport", eager_facade) for line in upward(imp, KNOWN)]


def test_past_api_catches_weights_reaching_into_the_core() -> None:
    source = (
        "from transport.peers.liveness import staleness\nfrom transport.contract import unpack\n"
    )
    imps = _made_up("transport.weights.group.lease", source)
    broken = [line for imp in imps for line in past_api(imp, KNOWN)]
    assert len(broken) == 1 and "transport.peers.liveness" in broken[0]
    relative = "from ...peers import liveness\n"
    imps = _made_up("transport.weights.group.lease", relative)
    assert [line for imp in imps for line in past_api(imp, KNOWN)]
    ok = "from transport import Transport\nfrom transport.backends import nixl\n"
    imps = _made_up("transport.integrations.vllm.trainer", ok)
    assert not [line for imp in imps for line in past_api(imp, KNOWN)]


def test_private_catches_private_names_and_modules() -> None:
    source = (
        "from transport.backends.nixl import _load\nfrom transport.cli.bench._systems import run\n"
    )
    imps = _made_up("transport.cli.peers", source)
    broken = [line for imp in imps for line in private(imp, KNOWN)]
    assert len(broken) == 2
    inside = "from transport._transport import Transport\n"
    assert not [line for imp in _made_up("transport.wire", inside) for line in private(imp, KNOWN)]


@pytest.mark.parametrize("importer", ["transport.integrations.vllm.trainer", "transport.cli.main"])
def test_past_packages_catches_an_upper_layer_reaching_into_a_package_of_weights(importer) -> None:
    found = _made_up(
        importer,
        "from transport.weights.group.lease import Lease\nfrom transport.weights.group import x\n",
    )
    broken = [line for imp in found for line in past_packages(imp, KNOWN)]
    assert len(broken) == 1 and "transport.weights.group.lease" in broken[0], broken
