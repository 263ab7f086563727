"""The exception tree of the library: every error class of the package, and only here.

The rule: every error that leaves the library is a :class:`TransportError` (or a plain
``ValueError``/``TypeError`` for bad arguments), its class is defined in this module, whatever
layer raises it (the core, weights/, integrations/, the command), and it is imported from
``transport``, which exports every one. ``tests/test_conventions.py`` fails on a class of
``Exception`` defined anywhere else, except a private one (``_Unmapped``): control flow inside
one module, caught there and never raised out of it. Errors of the parts below (NIXL, the key-value stores,
vLLM's calls) are mapped into this tree in one place each and chained with ``from``, so the
original is always available as ``__cause__``.

The names say who broke the contract: :class:`ClosedError` means *this* Transport was closed;
:class:`PeerLostError` means the *peer* went away; an :class:`UpdateError` means a version of
the weights did not arrive whole, and the destination keeps what it had.
"""

from __future__ import annotations

from collections.abc import Sequence


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

    Raised by a transfer whose deadline expired (the transfer was given up and
    the peer marked suspect; its notification is never sent, but bytes the
    connection already carried may still land, after the link comes back) and
    by ``wait(timeout)`` when the wait ran out first; in the second case the
    transfer itself goes on until its own deadline.
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


class PeerGoneError(PeerLostError):
    """A peer a weight update depends on is suspect (dead, frozen, partitioned) or left the
    store, as its heartbeat or record says: ``why`` says which."""

    peer: str

    def __init__(self, peer: str, why: str) -> None:
        super().__init__(f"peer {peer} is gone: {why}", peer)
        self.why = why


class LayoutError(TransportError, ValueError):
    """A source and a destination layout do not fit; ``problems`` lists every mismatch by name."""

    def __init__(self, problems: Sequence[str]) -> None:
        self.problems = list(problems)
        super().__init__(f"{len(self.problems)} layout problem(s): " + "; ".join(self.problems))


class DeltaError(WireFormatError):
    """A delta that breaks a rule of its format, or does not fit the layout it names: nothing
    of it was applied."""


class UpdateError(TransportError):
    """A version of the weights did not arrive whole where it was sent (the message says which
    version, and why); the destination keeps serving the weights it had."""


class UpdateAbortedError(UpdateError):
    """The update cannot complete: a worker it depends on is gone, or another said so."""


class UpdateSupersededError(UpdateError):
    """The engine began another update while this one still ran: this one stopped."""


class TornModelError(UpdateError):
    """Part of ``version`` reached the model and the rest did not: the model holds no whole
    version (the engine reports ``TORN`` and marks it in the store until a version loads
    whole)."""

    def __init__(self, message: str, version: int) -> None:
        super().__init__(message)
        self.version = version


class SyncError(UpdateError):
    """A sync of TRL's trainer the vLLM server did not take. The message names the server, the
    version and the cause; the server serves the weights it had (a worker whose model a failed
    in-place write left torn says so: vLLM then reports the weight version ``torn:V``). A pause
    the sync began was resumed. The transfer stays usable: the next sync tells the server's
    workers the group again (a restarted server joins) and sends the whole version."""


class RouteError(TransportError):
    """A request the adapter routes refuse: ``status`` (the HTTP status) and a message naming the
    rule."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class ClusterError(TransportError, RuntimeError):
    """A cluster of hosts on one machine could not be made or changed; the message says what it
    needs."""


class CliError(TransportError):
    """A failure of the ``transport`` command to report in one line (exit status 1)."""


__all__ = [
    "BackendError",
    "CliError",
    "ClosedError",
    "ClusterError",
    "DeltaError",
    "GroupBusyError",
    "LayoutError",
    "PeerGoneError",
    "PeerLostError",
    "PeerNotFoundError",
    "PeerWaitTimeout",
    "RegionError",
    "RegistrationBudgetError",
    "RouteError",
    "SignatureError",
    "StoreError",
    "StoreTimeout",
    "SyncError",
    "TornModelError",
    "TransferTimeout",
    "TransportError",
    "UpdateAbortedError",
    "UpdateError",
    "UpdateSupersededError",
    "VersionGoneError",
    "WireFormatError",
]
