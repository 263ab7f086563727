"""Our state for one incarnation (generation) of a peer: its record, its loaded agent, the
bytes moved with it, and what is prepared against it (the plans that target it). When the peer
is lost, the connection is closed and everything prepared against it released."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Protocol

from transport.backends.base import Backend
from transport.doorbell import Ringer
from transport.wire import PeerRecord, RegionInfo

if TYPE_CHECKING:
    from transport.security.sealing import FrameSealer


class Prepared(Protocol):
    """What is prepared against a connection (a plan): the remote ``regions`` it uses, whether
    it is still ``valid`` (False once one of them is withdrawn), released when the connection
    closes."""

    regions: frozenset[str]
    valid: bool

    def release(self, backend: Backend) -> None: ...


class Traffic:
    """Bytes moved to and from one peer (every incarnation, every lane) by completed transfers:
    ``written`` into its memory, ``read`` from it. Counted under the connection's lock."""

    __slots__ = ("read", "written")

    def __init__(self) -> None:
        self.written = 0
        self.read = 0


class PeerConn:
    """Connection state for one incarnation of a peer. ``lock`` guards posting against teardown;
    every notification to the peer leaves through :meth:`seal` under it (with a secret, the
    ``sealer`` numbers and authenticates it for this incarnation), and every post or notification
    to it is followed by :attr:`ring` (its doorbell, transport/doorbell.py). ``traffic`` counts the bytes
    of its completed transfers (shared with the lanes' connections to the same peer)."""

    def __init__(
        self,
        record: PeerRecord,
        agent: str,
        sealer: FrameSealer | None = None,
        traffic: Traffic | None = None,
        ring: Ringer | None = None,
        kernel_copies: bool = False,
    ) -> None:
        self.traffic = traffic if traffic is not None else Traffic()
        #: rings the peer's doorbell (rate-limited) after each post and notification to it
        self.ring = ring if ring is not None else Ringer(None, None)
        self.sealer = sealer
        self.name = record.name
        self.record = record
        self.generation = record.generation
        self.agent = agent
        #: host-memory transfers with it are one kernel copy each (Backend.kernel_copies)
        self.kernel_copies = kernel_copies
        self.regions: dict[str, RegionInfo] = record.region_map()
        self.lock = threading.Lock()
        self.alive = True
        self.suspect = False
        self.plans: set[Prepared] = set()
        #: records of this incarnation older than this revision list regions it withdrew since
        self.stale_below = 0

    def seal(self, frame: bytes) -> bytes:
        """``frame`` as it goes to this peer: with its sequence number and MAC under a secret."""
        return self.sealer.seal(frame) if self.sealer is not None and frame else frame

    def close(self, backend: Backend) -> None:
        with self.lock:
            if not self.alive:
                return
            self.alive = False
            plans, self.plans = self.plans, set()
            for plan in plans:
                plan.release(backend)
            backend.remove_peer(self.agent)

    def __repr__(self) -> str:
        return f"<PeerConn {self.name}#{self.generation} {'alive' if self.alive else 'closed'}>"
