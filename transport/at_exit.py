"""What is still open when the interpreter exits is closed first.

NIXL's agent runs threads of its own; destroyed at the interpreter's exit while they run, they
abort the process ("terminate called without an active exception", status 134), whatever
status the program meant to exit with. So every Transport registers here when it opens, and
the ones not closed by then are closed by an ``atexit`` handler, newest first: they leave their
namespace and stop their threads, and the process exits with its own status.
"""

from __future__ import annotations

import atexit
import logging
import threading
import weakref
from typing import Protocol

log = logging.getLogger(__name__)


class _Closable(Protocol):
    """What is closed at exit: anything with an idempotent ``close``."""

    def close(self) -> None: ...


_open: weakref.WeakSet[_Closable] = weakref.WeakSet()
_order: list[weakref.ref[_Closable]] = []
_lock = threading.Lock()
_registered = False


def close_at_exit(obj: _Closable) -> None:
    """Close ``obj`` at the interpreter's exit if it is still alive then (closing twice is
    harmless: ``close`` is idempotent)."""
    global _registered
    with _lock:
        _open.add(obj)
        _order.append(weakref.ref(obj))
        if not _registered:
            atexit.register(_close_all)
            _registered = True


def _close_all() -> None:
    with _lock:
        alive = [obj for ref in reversed(_order) if (obj := ref()) is not None and obj in _open]
        _order.clear()
    for obj in alive:
        try:
            obj.close()
        except Exception as e:  # the process is exiting: say what could not be closed
            log.warning("closing %r at exit failed: %s", obj, e)
