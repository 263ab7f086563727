"""The module-level default Transport, in the style of torch.distributed:

>>> import transport
>>> transport.init("trainer-0")
>>> transport.put(weights, "gen-0", "w").wait()
>>> transport.shutdown()
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from transport._transport import Transport
from transport.errors import ClosedError
from transport.handle import Handle
from transport.store import Store

_default: Transport | None = None
_lock = threading.Lock()


def init(name: str, store: str | Store | None = None, **kwargs: Any) -> Transport:
    """Open the process's default Transport (see Transport for the arguments)."""
    global _default
    with _lock:
        if _default is not None and not _default.closed:
            raise RuntimeError(
                f"transport.init() was already called (as {_default.name!r}); call transport.shutdown() first"
            )
        _default = Transport(name, store, **kwargs)
        return _default


def default() -> Transport:
    """The Transport opened by init(); ClosedError if there is none."""
    t = _default
    if t is None or t.closed:
        raise ClosedError("no default Transport: call transport.init(name, store=...) first")
    return t


def is_initialized() -> bool:
    return _default is not None and not _default.closed


def put(
    src: torch.Tensor | Mapping[str, torch.Tensor],
    peer: str | Iterable[str],
    key: str | None = None,
    **kwargs: Any,
) -> Handle:
    return default().put(src, peer, key, **kwargs)


def get(
    dst: torch.Tensor | Mapping[str, torch.Tensor], peer: str, key: str | None = None, **kwargs: Any
) -> Handle:
    return default().get(dst, peer, key, **kwargs)


def shutdown() -> None:
    """Close the default Transport (no-op if there is none)."""
    global _default
    with _lock:
        t, _default = _default, None
    if t is not None:
        t.close()
