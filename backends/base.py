"""The backend contract: what the engine needs from a transfer library.

A backend owns one agent (a connection endpoint with registered memory) and
turns descriptor lists into one-sided transfers. It is deliberately thin: no
planning, no threads, no policy. Every method raises only errors of
:mod:`transport.errors` (the backend maps its library's errors in one place).

Descriptor arrays are ``numpy.ndarray`` of shape ``(N, 3)`` and dtype uint64,
one row ``(address, length, device_id)`` per contiguous piece.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from transport._closing import Closing

#: transfer states returned by post() and poll()
DONE = 0
IN_PROGRESS = 1

READ = "READ"
WRITE = "WRITE"


class Backend(Closing, abc.ABC):
    """One agent of a transfer library. Safe to call from several threads."""

    name: str = ""
    #: how incoming transfers make progress: "poll" (only in the engine's calls, so a receiver's
    #: engine must be awake for them) or "events" (a thread of the backend's own lands them)
    progress: str = "poll"

    @abc.abstractmethod
    def metadata(self, memory: Sequence[tuple[int, int, str]] = ()) -> bytes:
        """Connection metadata that peers pass to add_peer(), describing the registered
        ``memory`` ((address, bytes, device) of whole registrations) peers may access; a
        backend may describe more, never less."""

    @abc.abstractmethod
    def register(self, addr: int, nbytes: int, device: str) -> Any:
        """Register memory for transfers; returns a token for deregister()."""

    @abc.abstractmethod
    def deregister(self, token: Any) -> None: ...

    def deregister_many(self, registrations: Sequence[tuple[Any, int, int, str]]) -> None:
        """Deregister many at once: (token, address, bytes, device) of each. A backend whose
        one-by-one deregistration costs more the more is registered overrides it."""
        for token, _, _, _ in registrations:
            self.deregister(token)

    @abc.abstractmethod
    def add_peer(self, metadata: bytes) -> str:
        """Load a peer's metadata; returns the peer's agent name."""

    @abc.abstractmethod
    def remove_peer(self, agent: str) -> None:
        """Forget a peer and disconnect from it. Never raises for an unknown or dead peer."""

    @abc.abstractmethod
    def prep(self, agent: str | None, descs: np.ndarray, device: str) -> Any:
        """Prepare a descriptor list: local when ``agent`` is None, else of that remote agent."""

    @abc.abstractmethod
    def release_prepped(self, prepped: Any) -> None: ...

    @abc.abstractmethod
    def make_xfer(
        self,
        op: str,
        local: Any,
        local_idx: np.ndarray,
        remote: Any,
        remote_idx: np.ndarray,
        notif: bytes,
        peer: str,
    ) -> Any:
        """A reusable transfer between the selected descriptors (int32 indices) of two prepared lists."""

    def direct(
        self,
        op: str,
        local: Any,
        local_idx: np.ndarray,
        remote: Any,
        remote_idx: np.ndarray,
        peer: str,
    ) -> Callable[[], None] | None:
        """A transfer like :meth:`make_xfer`'s without a notification that completes inside each
        call and may be called from several threads at once (nothing to pool, poll or release),
        raising only errors of :mod:`transport.errors`; None where this backend has none for these
        lists (the default)."""
        return None

    def kernel_copies(self, agent: str) -> bool:
        """Whether host-memory transfers with ``agent`` are each one copy by the kernel, however
        many descriptors they have (CMA with a peer of this machine): a layer may then write
        many small tensors as they are instead of packing them first. False by default."""
        return False

    @abc.abstractmethod
    def post(self, xfer: Any, notif: bytes, peer: str) -> int:
        """Start (or restart, once DONE) a transfer; returns DONE or IN_PROGRESS."""

    @abc.abstractmethod
    def poll(self, xfer: Any, peer: str) -> int:
        """DONE or IN_PROGRESS; raises the mapped error when the transfer failed."""

    @abc.abstractmethod
    def release_xfer(self, xfer: Any) -> bool:
        """Release a transfer; aborts it when still in progress. Returns False if the library refused."""

    @abc.abstractmethod
    def get_notifs(self) -> dict[str, list[bytes]]:
        """New notifications by sender agent name; also makes progress for incoming transfers."""

    @abc.abstractmethod
    def send_notif(self, agent: str, message: bytes, peer: str) -> None: ...

    def refuse_incoming(self, timeout: float) -> bool:
        """From now on no peer's transfer reaches this agent's memory; waits (at most ``timeout``
        s) for those in progress. False: some still were. A Transport calls it first when it
        closes. The default does nothing: a library whose transfers need this agent fails them
        once it is closed."""
        return True

    @abc.abstractmethod
    def close(self) -> None:
        """Release the agent. Idempotent."""


def device_parts(device: str) -> tuple[str, int]:
    """'cpu' -> ('DRAM', 0); 'cuda:3' -> ('VRAM', 3)."""
    if device == "cpu":
        return "DRAM", 0
    if device.startswith("cuda:"):
        return "VRAM", int(device[5:])
    raise ValueError(f"unsupported device {device!r}: use CPU or CUDA tensors")
