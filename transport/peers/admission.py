"""Peers met out of band: a record handed over by a layer instead of read from the store.

torch's transport API hands connection URLs and memory descriptors between processes itself
(each carries the owner's sealed record), and a peer that closes says so by a control message.
:class:`Admission` turns both into the state a shared store would give: the record stored where
lookups find it, or the peer marked left.
"""

from __future__ import annotations

from transport.errors import ClosedError
from transport.peers.conn import PeerConn
from transport.peers.table import PeerTable
from transport.shared_state import SharedState


class Admission:
    """One Transport's calls ``record``, ``admit`` and ``forget`` of its internal contract
    (transport/contract.py). It owns nothing: the directory keeps the records, the peer table
    the connections. Thread-safe as they are."""

    def __init__(self, ep: SharedState, peers: PeerTable) -> None:
        self._ep = ep
        self._peers = peers

    def record(self) -> bytes:
        """Our record as the store holds it (sealed with a secret)."""
        raw = self._ep.directory.written(self._ep.name)
        if raw is None:
            raise ClosedError(f"{self._ep.name!r} has no record: it is closed")
        return raw

    def admit(self, record: bytes) -> PeerConn:
        """Connect to the peer of ``record`` (checked, stored unless older than what we hold)."""
        self._ep.check_open()
        rec = self._ep.directory.admit(record)
        return self._peers.connect(rec.name, refresh=True)

    def forget(self, name: str, generation: int) -> None:
        """That incarnation of ``name`` said it leaves: mark it left and drop its connection."""
        self._ep.directory.leave(name, generation)
        conn = self._peers.get(name)
        if conn is not None and conn.generation == generation:
            self._peers.drop(conn)
