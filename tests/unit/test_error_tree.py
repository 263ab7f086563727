"""Every exception class the library defines derives from TransportError (errors.py's promise):
a caller catches the library's failures with one except clause."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import transport
from transport.errors import TransportError

# modules that import a framework only a machine with it has (vLLM, verl, Ray)
OPTIONAL = ("transport.integrations.",)


def package_modules() -> list[str]:
    """The package's Python modules (not the compiled helper, a library loaded with ctypes)."""
    out = []
    for m in pkgutil.walk_packages(transport.__path__, "transport."):
        spec = m.module_finder.find_spec(m.name.rpartition(".")[2])  # type: ignore[call-arg]
        python = spec is not None and (spec.origin or "").endswith(".py")
        if python and not m.name.startswith(OPTIONAL) and not m.name.endswith(".__main__"):
            out.append(m.name)
    return out


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
