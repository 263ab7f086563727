"""The exception tree of the library.

Every error that leaves the library is a :class:`TransportError` (or a plain
``ValueError``/``TypeError`` for bad arguments). Errors of the layers below
(NIXL, the key-value stores) are mapped into this tree in one place each and
chained with ``from``, so the original is always available as ``__cause__``.

The names say who broke the contract: :class:`ClosedError` means *this*
Transport was closed; :class:`PeerLostError` means the *peer* went away.
"""

from __future__ import annotations


class TransportError(Exception):
    """Base class of every error raised by the library."""


class PeerLostError(TransportError):
    """The peer went away (killed, closed, or its connection broke) during or before a transfer.

    The peer's connection state is dropped; a peer that comes back under the same
    name is picked up again by the next put or get.
    """

    def __init__(self, message: str, peer: str | None = None) -> None:
        super().__init__(message)
        self.peer = peer


class PeerNotFoundError(TransportError):
    """No peer of that name is registered in the store's namespace."""

    def __init__(self, message: str, peer: str | None = None) -> None:
        super().__init__(message)
        self.peer = peer


class PeerWaitTimeout(PeerNotFoundError, TimeoutError):
    """wait_for_peer() ran out of time before the peer (or the regions asked for) appeared."""


class TransferTimeout(TransportError, TimeoutError):
    """A deadline passed.

    Raised by a transfer whose deadline expired (the transfer was withdrawn and
    the peer marked suspect) and by ``wait(timeout)`` when the wait ran out
    first; in the second case the transfer itself goes on until its own deadline.
    """


class RegionError(TransportError):
    """A transfer does not fit the remote region: unknown name, size, dtype or access."""


class StoreError(TransportError):
    """The key-value store could not be reached or answered with an error."""


class StoreTimeout(StoreError, TimeoutError):
    """A store operation (for example waiting for a key) ran past its deadline."""


class ClosedError(TransportError):
    """The Transport (or store) was closed locally; open a new one."""


class WireFormatError(TransportError):
    """A record or message from a peer or the store is malformed, too large or of an unknown version."""


class SignatureError(WireFormatError):
    """A record's HMAC signature is missing or wrong for the configured shared secret."""


class GroupBusyError(TransportError):
    """A weight group already has a live publisher (the error names it); one publishes at a time."""


class BackendError(TransportError):
    """The transfer backend failed in a way not covered by a more specific error."""


class RegistrationBudgetError(TransportError):
    """Registering more host memory would pass the Transport's budget (``max_registered_bytes``);
    nothing of the call that asked was registered."""


class VersionGoneError(TransportError):
    """A weight version asked for by number is no longer held: a newer one replaced it."""


__all__ = [
    "BackendError",
    "ClosedError",
    "GroupBusyError",
    "PeerLostError",
    "PeerNotFoundError",
    "PeerWaitTimeout",
    "RegionError",
    "RegistrationBudgetError",
    "SignatureError",
    "StoreError",
    "StoreTimeout",
    "TransferTimeout",
    "TransportError",
    "VersionGoneError",
    "WireFormatError",
]
