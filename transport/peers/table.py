"""The peer table: our connections to the peers of the namespace, one per name."""

from __future__ import annotations

import logging
import threading
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass

from transport.doorbell import Ringer
from transport.errors import (
    BackendError,
    PeerLostError,
    PeerNotFoundError,
    StoreError,
    WireFormatError,
)
from transport.peers.conn import PeerConn, Traffic
from transport.peers.liveness import suspicion
from transport.shared_state import SharedState
from transport.wire import PeerRecord

log = logging.getLogger(__name__)

#: how long a lost peer's new incarnation is looked up in the store before the loss is reported
RESTART_LOOKUP_S = 2.0


@dataclass(frozen=True)
class PeerInfo:
    """A peer of the namespace that has a record, as its record and heartbeat describe it.

    ``suspect`` says why it may be gone: its last heartbeat is older than a few heartbeat
    intervals of the Transport that asks (transport/peers/liveness.py: 3 intervals, at least 5 s), or a
    newer incarnation beats in its place, and the asking Transport heard nothing from it within
    that time either; None while it beats in time (or has not beaten yet). A suspect peer that
    beats again, or sends the asker a message, is no longer suspect.
    """

    name: str
    generation: int
    host: str
    pid: int
    version: str
    regions: int
    region_bytes: int
    last_heartbeat: float | None  # wall-clock time, None if it never sent one
    suspect: str | None = None
    registrations: int = 0  # the registered memory its regions lie in (buffers, not tensors)
    record_bytes: int = 0  # its record as stored


@dataclass(frozen=True)
class PeerTraffic:
    """Bytes this Transport's completed transfers moved with one peer (every incarnation of
    it, every lane): ``written`` into its memory (puts), ``read`` from it (gets)."""

    written: int
    read: int


def peer_info(
    rec: PeerRecord, hb: tuple[int, float] | None, interval: float, heard: float | None = None
) -> PeerInfo:
    """``rec`` and the heartbeat stored under its name, judged with ``interval`` (the reader's)
    and when the reader last heard from that incarnation (``heard``, liveness.py)."""
    return PeerInfo(
        rec.name,
        rec.generation,
        rec.host,
        rec.pid,
        rec.version,
        len(rec.regions),
        sum(r.nbytes for r in rec.regions),
        hb[1] if hb and hb[0] == rec.generation else None,
        suspicion(hb, rec.generation, interval, heard=heard),
        len(rec.registrations),
        rec.stored_bytes,
    )


class PeerTable:
    """One Transport's connections: for each peer name, the connection to the incarnation
    (generation) we reach, made from its record in the store on first use.

    It owns the map of connections (``lock`` guards it and is held while a record is fetched, so
    two threads never load one peer twice). Rules: :meth:`connect` returns a live connection or
    raises (PeerNotFoundError, PeerLostError, WireFormatError) before anything is posted; a peer
    that restarted under its name is dropped and connected afresh; a dropped or lost connection
    is closed (its plans released) and queued in :meth:`take_dropped` for the plan cache, which
    lets go of its cached plans (the table never calls the cache: the cache calls it, under its
    own lock). :meth:`on_lost` runs on the engine thread and takes only the connection's lock.
    """

    def __init__(self, ep: SharedState) -> None:
        self._ep = ep
        self.lock = threading.RLock()
        self._conns: dict[str, PeerConn] = {}
        #: bytes moved per peer name, over its incarnations (connections count into these)
        self.traffic: dict[str, Traffic] = {}
        self._dropped: deque[PeerConn] = deque()
        self._lookups: ThreadPoolExecutor | None = None  # restarted(): store lookups
        self._lookup_lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._conns)

    def get(self, peer: str) -> PeerConn | None:
        """The connection to ``peer`` as it is now (live or not), without touching the store."""
        return self._conns.get(peer)

    def traffic_of(self) -> dict[str, PeerTraffic]:
        """Bytes moved per peer name so far."""
        return {n: PeerTraffic(t.written, t.read) for n, t in list(self.traffic.items())}

    def live(self) -> list[PeerConn]:
        return [c for c in list(self._conns.values()) if c.alive]

    def connect(self, peer: str, refresh: bool = False) -> PeerConn:
        """A live connection to ``peer``; ``refresh`` reads its record afresh (it may have exposed
        more, or restarted)."""
        conn = self._conns.get(peer)
        if conn is not None and conn.alive and not refresh:
            return conn
        with self.lock:
            self._ep.check_open()
            return self._connect(peer, refresh)

    def _connect(self, peer: str, refresh: bool) -> PeerConn:
        ep = self._ep
        conn = self._conns.get(peer)
        if conn is not None and conn.alive and not refresh:
            return conn
        try:
            rec = ep.directory.fetch(peer)
        except StoreError as e:
            if conn is None:
                raise
            # we reached this peer and lost it: that is what the caller must hear, not that the
            # store (which would show a restart) is gone too, as when the peer hosted it
            raise PeerLostError(
                f"peer {peer!r} (generation {conn.generation}) was lost, and the store that would "
                f"show a restart cannot be reached [{e}]",
                peer,
            ) from e
        if rec is None:
            if conn is not None:
                self.drop(conn)
            raise PeerNotFoundError(self.not_found_message(peer), peer)
        if rec.backend != ep.backend.name:
            raise WireFormatError(
                f"peer {peer!r} uses backend {rec.backend!r}; this Transport uses {ep.backend.name!r}"
            )
        if conn is not None and conn.alive and rec.generation == conn.generation:
            if rec.revision < conn.record.revision:
                # an older record of this incarnation put back in the store (a store writer
                # replaying it): it may list regions withdrawn since, whose memory is freed
                log.warning(
                    "ignoring an older record of %s#%d (revision %d; we know revision %d)",
                    peer,
                    rec.generation,
                    rec.revision,
                    conn.record.revision,
                )
                return conn
            if rec.revision < conn.stale_below:
                # handed to us after the peer withdrew regions it lists (an old descriptor)
                log.info(
                    "ignoring record revision %d of %s#%d: it withdrew regions at revision %d",
                    rec.revision,
                    peer,
                    rec.generation,
                    conn.stale_below,
                )
                return conn
            if rec != conn.record:
                ep.backend.add_peer(rec.metadata)  # same agent, more registered memory
                conn.record, conn.regions = rec, rec.region_map()
            return conn
        if conn is not None:
            self.drop(conn)  # the old incarnation, and every plan made for it
        try:
            loaded = ep.backend.add_peer(rec.metadata)
        except BackendError as e:
            raise PeerLostError(
                f"peer {peer!r} (generation {rec.generation}) is registered but cannot be reached; it may have "
                "died without leaving (its record stays until it restarts) [" + str(e) + "]",
                peer,
            ) from e
        if loaded != rec.agent:
            ep.backend.remove_peer(loaded)
            raise WireFormatError(
                f"peer {peer!r}'s record names agent {rec.agent!r} but its metadata is of {loaded!r}"
            )
        keys = ep.keys
        traffic = self.traffic.setdefault(peer, Traffic())
        conn = PeerConn(
            rec,
            loaded,
            keys.sealer(ep.agent, loaded) if keys else None,
            traffic,
            Ringer(ep.engine.doorbell, rec.bell),
            ep.backend.kernel_copies(loaded),
        )
        self._conns[peer] = conn
        ep.recorder.record("join", peers=peer, info=f"generation {rec.generation}")
        return conn

    def drop(self, conn: PeerConn) -> None:
        """Close ``conn`` (its plans are released) and forget it."""
        self._ep.recorder.record("leave", peers=conn.name, info=f"generation {conn.generation}")
        conn.close(self._ep.backend)
        with self.lock:
            if self._conns.get(conn.name) is conn:
                del self._conns[conn.name]
        self._dropped.append(conn)

    def take_dropped(self) -> list[PeerConn]:
        """The connections dropped since the last call (for the plan cache to purge)."""
        out = []
        while self._dropped:
            out.append(self._dropped.popleft())
        return out

    def on_lost(self, conn: PeerConn, error: BaseException) -> None:
        """Engine thread: a transfer found ``conn``'s peer gone. Only the connection's own lock,
        never the table's (a user thread may hold that while it talks to the store); its stale
        plans go at the next plan made or housekeeping round."""
        if conn.alive:
            log.warning("peer %s#%d lost: %s", conn.name, conn.generation, error)
            self._ep.recorder.record("lost", peers=conn.name, info=str(error)[:300])
            conn.close(self._ep.backend)
            self._dropped.append(conn)

    def drop_restarted(self) -> None:
        """Housekeeping: drop every connection whose peer restarted. A generation counter that
        moved on is only a hint (anyone who can write the store can raise it); the connection is
        dropped only once the peer's record (sealed, with a secret) names a newer incarnation.
        A record that is missing or not valid drops nothing: a live connection outlives a store
        that lost or garbled its records."""
        for conn in self.live():
            newest = self._ep.directory.generation(conn.name)  # None: garbage, ignored
            if newest is None or newest <= conn.generation:
                continue
            rec = self.restarted(conn)
            if rec is None:
                continue
            log.info(
                "peer %s restarted (generation %d); dropping generation %d",
                conn.name,
                rec.generation,
                conn.generation,
            )
            self.drop(conn)

    def restarted(self, old: PeerConn, timeout: float | None = None) -> PeerRecord | None:
        """The record of a newer incarnation of ``old``'s peer, if the store shows one within
        ``timeout`` seconds (default :data:`RESTART_LOOKUP_S`). The lookup runs on a thread of its own: a store that hangs (the
        process hosting it died with the peer) costs the caller ``timeout``, never the store's
        own connect timeouts, and a loss the backend already reported is reported then. A
        peer that served the store itself took the store with it: nothing is asked, and the
        loss is reported at once."""
        if old.record.hosts_store:
            log.info(
                "peer %s#%d was lost with the store it served; reporting the loss",
                old.name,
                old.generation,
            )
            return None
        with self._lookup_lock:
            if self._lookups is None:
                self._lookups = ThreadPoolExecutor(
                    1, thread_name_prefix=f"transport-lookup-{self._ep.name}"
                )
            try:
                future = self._lookups.submit(self._ep.directory.fetch, old.name)
            except RuntimeError:  # closed
                return None
        if timeout is None:
            timeout = RESTART_LOOKUP_S
        try:
            rec = future.result(timeout)
        except FutureTimeout:
            log.warning(
                "peer %s#%d was lost, and the store did not say within %.3g s whether it "
                "restarted; reporting the loss",
                old.name,
                old.generation,
                timeout,
            )
            return None
        except (StoreError, WireFormatError):
            return None
        if rec is None or rec.generation <= old.generation:
            return None
        return rec

    def not_found_message(self, peer: str) -> str:
        ep = self._ep
        try:
            known = [
                n
                for n in ep.directory.names()
                if n != ep.name and ep.store.try_get(ep.directory.key("peers", n))
            ]
        except StoreError:
            known = []
        hint = (
            f"known peers: {', '.join(known[:8])}" + (" ..." if len(known) > 8 else "")
            if known
            else "no other peers are registered"
        )
        return (
            f"no peer named {peer!r} in namespace {ep.namespace!r} ({hint}); "
            "check the name and namespace, or wait_for_peer() before the first put"
        )

    def close(self) -> None:
        """Close every connection (once every engine has stopped)."""
        with self.lock:
            conns, self._conns = list(self._conns.values()), {}
        for conn in conns:
            conn.close(self._ep.backend)
        self._dropped.clear()
        with self._lookup_lock:
            if self._lookups is not None:
                self._lookups.shutdown(wait=False, cancel_futures=True)
