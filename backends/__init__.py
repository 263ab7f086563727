"""Transfer backends, found by name.

>>> from transport import backends
>>> backends.available()
['loopback', 'nixl']
>>> b = backends.new_backend("nixl", agent_name="trainer-0#1")

Backends are imported lazily, so importing the package never loads NIXL.
"""

from __future__ import annotations

import importlib
from typing import Any

from transport.backends.base import DONE, IN_PROGRESS, READ, WRITE, Backend

_REGISTRY: dict[str, str] = {
    "loopback": "transport.backends.loopback:LoopbackBackend",  # in-process, for unit tests only
    "nixl": "transport.backends.nixl:NixlBackend",
}


def register_backend(name: str, target: str) -> None:
    """Make ``new_backend(name)`` build ``target`` ('module:Class')."""
    _REGISTRY[name] = target


def available() -> list[str]:
    """Names of the known backends (importable or not)."""
    return sorted(_REGISTRY)


def backend_class(name: str) -> type[Backend]:
    try:
        target = _REGISTRY[name]
    except KeyError:
        raise ValueError(
            f"unknown backend {name!r}; known backends: {', '.join(available())}"
        ) from None
    module, _, cls = target.partition(":")
    found: type[Backend] = getattr(importlib.import_module(module), cls)
    return found


def new_backend(name: str, **options: Any) -> Backend:
    return backend_class(name)(**options)


__all__ = [
    "DONE",
    "IN_PROGRESS",
    "READ",
    "WRITE",
    "Backend",
    "available",
    "backend_class",
    "new_backend",
    "register_backend",
]
