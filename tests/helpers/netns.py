"""Enter a host of a cluster (transport/cluster/) for a while: the calling thread's network
namespace becomes the host's, and what it starts meanwhile (processes, sockets) is born there;
the thread comes back on leaving. This is how a test reaches a server that listens in a host
(the machine's own namespace has no link to the cluster) and starts a child inside one."""

from __future__ import annotations

import ctypes
import os
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

#: setns(2)'s flag for a network namespace
CLONE_NEWNET = 0x40000000
_libc = ctypes.CDLL(None, use_errno=True)


def _setns(fd: int, what: str) -> None:
    if _libc.setns(fd, CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"entering the network namespace of {what}: {os.strerror(err)}")


@contextmanager
def entered(namespace: str) -> Iterator[None]:
    """The calling thread in network namespace ``namespace`` (as ``ip netns`` names it)."""
    with open("/proc/thread-self/ns/net") as here, open(f"/run/netns/{namespace}") as there:
        _setns(there.fileno(), namespace)
        try:
            yield
        finally:
            _setns(here.fileno(), "this machine")


class Within:
    """``obj`` whose every method call is made in network namespace ``namespace`` (None: in
    this one): a server's client, say, when the server listens in a host of a cluster."""

    def __init__(self, obj: Any, namespace: str | None) -> None:
        self._obj, self._namespace = obj, namespace

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._obj, name)
        if not callable(attr) or self._namespace is None:
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            with entered(self._namespace):  # type: ignore[arg-type]
                return attr(*args, **kwargs)

        return call


def inside(namespace: str | None) -> Any:
    """:func:`entered` for a namespace, nothing for None."""
    return nullcontext() if namespace is None else entered(namespace)
