"""Key-value stores through which peers find each other.

Open one with :func:`store_from_url`:

* ``memory://[NAME]``: in this process only (a named one is shared process-wide).
* ``tcp://HOST:PORT[?timeout=S&host=auto|yes|no]``: ``torch.distributed.TCPStore``,
  hosted by the first process that opens it on this machine; the default.
* ``redis://[USER:PASSWORD@]HOST[:PORT][/DB][?timeout=S]`` and ``rediss://`` (TLS).

A store (or any server) hosted on a port of the caller's choosing keeps that port held until it
binds it: :func:`reserve_port` (transport/store/ports.py).

The TCP and Redis implementations import torch and redis-py on first use.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from transport.store.base import DEFAULT_TIMEOUT, Store, redact_url
from transport.store.memory import MemoryStore
from transport.store.ports import PortReservation, reserve_port

if TYPE_CHECKING:
    from transport.store.redis import RedisStore
    from transport.store.tcp import TcpStore

#: The store used when none is given: the embedded TCPStore on this machine.
DEFAULT_STORE_URL = os.environ.get("TRANSPORT_STORE") or "tcp://127.0.0.1:29517"

KNOWN_SCHEMES = ("memory://", "tcp://", "redis://", "rediss://")


def store_from_url(url: str | Store, *, timeout: float | None = None) -> Store:
    """Open the store that ``url`` names; a :class:`Store` is returned unchanged.

    ``timeout`` bounds connecting (it overrides the URL's ``?timeout=``); it is not
    the default timeout of the store's blocking calls, which is ``DEFAULT_TIMEOUT``.
    """
    if isinstance(url, Store):
        return url
    if not isinstance(url, str):
        raise TypeError(f"store must be a URL str or a Store, not {type(url).__name__}")
    scheme = urlsplit(url).scheme if "://" in url else ""
    if scheme == "memory":
        rest = url[len("memory://") :]
        if "/" in rest or "?" in rest:
            raise ValueError(f"a memory store URL is memory://[NAME]; got {url!r}")
        return MemoryStore(rest or None)
    if scheme == "tcp":
        from transport.store.tcp import TcpStore

        return TcpStore.from_url(url, timeout=timeout)
    if scheme in ("redis", "rediss"):
        from transport.store.redis import RedisStore

        return RedisStore(url, timeout=timeout)
    raise ValueError(
        f"unknown store URL {redact_url(url)!r}; known schemes: {', '.join(KNOWN_SCHEMES)}"
    )


def as_store(obj: str | Store | None, *, timeout: float | None = None) -> Store:
    """A Store for ``obj``: itself, the store its URL names, or (None) ``DEFAULT_STORE_URL``."""
    return store_from_url(DEFAULT_STORE_URL if obj is None else obj, timeout=timeout)


def __getattr__(name: str) -> Any:
    if name == "TcpStore":
        from transport.store.tcp import TcpStore

        return TcpStore
    if name == "RedisStore":
        from transport.store.redis import RedisStore

        return RedisStore
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "DEFAULT_STORE_URL",
    "DEFAULT_TIMEOUT",
    "KNOWN_SCHEMES",
    "MemoryStore",
    "PortReservation",
    "RedisStore",
    "Store",
    "TcpStore",
    "as_store",
    "reserve_port",
    "store_from_url",
]
