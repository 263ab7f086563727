"""The publisher lease of a weight group: one publisher at a time.

A lease is a value in the store, ``transport/<namespace>/groups/<group>/lease``: the holder's
peer name and generation and the ranks that share it (today the holder alone; a later change
lets a declared set of trainer ranks publish one version together). A publisher takes it at
construction, with compare-and-set, and gives it back at close. A second publisher of the group
fails with GroupBusyError naming the holder, unless the holder is gone: its name has no record
any more, or a newer incarnation's, or its heartbeat stopped (a killed process keeps its record
until it restarts): silent past the *gone* bar of transport/liveness.py (10 heartbeat
intervals, at least 10 s), higher than the bar at which a peer is merely suspect, since a
takeover cannot be undone. Garbage in the lease's place is overwritten, with a warning.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import msgpack

from transport.errors import GroupBusyError, PeerNotFoundError, StoreError, WireFormatError
from transport.liveness import GONE_BEATS, GONE_MIN_S, staleness
from transport.wire import unpack

if TYPE_CHECKING:
    from transport import Transport
    from transport.store import Store

log = logging.getLogger("transport.weights")

FREE = b""  # a lease given back


@dataclass(frozen=True)
class Lease:
    """Who publishes a group: the holder's name and generation, and the ranks sharing it."""

    name: str
    generation: int
    ranks: tuple[str, ...]

    def encode(self) -> bytes:
        out: bytes = msgpack.packb(
            {"v": 1, "name": self.name, "gen": self.generation, "ranks": list(self.ranks)}
        )
        return out

    @classmethod
    def decode(cls, raw: bytes) -> Lease:
        m = unpack(raw, "publisher lease", 16384, max_str=256, max_array=1024, max_map=8)
        if (
            not isinstance(m, dict)
            or set(m) != {"v", "name", "gen", "ranks"}
            or m["v"] != 1
            or not isinstance(m["name"], str)
            or not isinstance(m["gen"], int)
            or isinstance(m["gen"], bool)
            or not isinstance(m["ranks"], list)
            or not all(isinstance(r, str) for r in m["ranks"])
        ):
            raise WireFormatError(f"malformed publisher lease {str(m)[:80]}")
        return cls(m["name"], m["gen"], tuple(m["ranks"]))

    def __str__(self) -> str:
        return f"{self.name} (generation {self.generation})"


class PublisherLease:
    """The lease of one group as one Transport holds or wants it (see the module docstring).

    It owns nothing but the key and what it wrote: :meth:`acquire` takes the lease or raises
    GroupBusyError, :meth:`release` gives it back only if it is still ours (a publisher that took
    over from us keeps it). Every call is a few store round trips, on the caller's thread.
    """

    def __init__(self, transport: Transport, group: str) -> None:
        self.transport = transport
        self.group = group
        self.key = lease_key(transport.namespace, group)
        self.mine = Lease(transport.name, transport.generation, (transport.name,))
        self.held = False

    def acquire(self) -> None:
        """Take the lease (construction): GroupBusyError while a live publisher holds it."""
        self._claim(first=True)

    def _claim(self, first: bool) -> None:
        """Write our lease where the store has none, a free one, garbage or (``first`` only) the
        lease of a holder that is gone; GroupBusyError otherwise."""
        store, ours = self.transport.store, self.mine.encode()
        for _ in range(8):  # each turn loses only to another publisher's write
            raw = store.try_get(self.key)
            holder = None
            if raw is not None and raw != FREE:
                try:
                    holder = Lease.decode(raw)
                except WireFormatError as e:
                    log.warning(
                        "group %s: replacing a malformed publisher lease (%s)", self.group, e
                    )
            if holder == self.mine:
                self.held = True
                return
            if holder is not None and not first:
                self.held = False
                raise GroupBusyError(
                    f"group {self.group!r}: this publisher lost its lease to {holder}, which "
                    "took over while this one was silent; close this publisher"
                )
            if holder is not None:
                why = self._alive(holder)
                if why:
                    raise GroupBusyError(
                        f"group {self.group!r} already has a publisher: {holder}, {why}; one "
                        "publisher per group: close it (or let it end) first, or publish to "
                        "another group"
                    )
                log.warning("group %s: taking over the lease of %s, which is gone",
                            self.group, holder)  # fmt: skip
            if store.compare_set(self.key, raw, ours):
                if not first:
                    log.warning("group %s: the store had lost the publisher lease; wrote it back",
                                self.group)  # fmt: skip
                self.held = True
                return
        raise GroupBusyError(f"group {self.group!r}: the publisher lease kept changing; try again")

    def _alive(self, holder: Lease) -> str:
        """Why ``holder`` counts as alive ("" if it is gone)."""
        try:
            info = self.transport.wait_for_peer(holder.name, timeout=0.0)
        except PeerNotFoundError:
            return ""  # no record: it left
        except WireFormatError:
            return ""  # its record is garbage: nobody can reach it
        if info.generation != holder.generation:
            return ""  # restarted (a newer incarnation), or the record is of another
        if info.last_heartbeat is None or staleness(
            info.last_heartbeat,
            self.transport.heartbeat_interval,
            beats=GONE_BEATS,
            floor=GONE_MIN_S,
        ):
            return ""
        return f"alive on {info.host} (pid {info.pid})"

    def ensure(self) -> None:
        """At each publish: write our lease back if the store lost it (a Redis restarted empty;
        subscribers take messages only from the holder); GroupBusyError if another publisher
        holds it now (it took over while this one was silent past the bar)."""
        if self.held:
            self._claim(first=False)

    def release(self) -> None:
        if not self.held:
            return
        self.held = False
        try:
            self.transport.store.compare_set(self.key, self.mine.encode(), FREE)
        except StoreError as e:  # the next publisher finds us gone by our record or heartbeat
            log.warning("group %s: could not give back the publisher lease: %s", self.group, e)


def lease_key(namespace: str, group: str) -> str:
    return f"transport/{namespace}/groups/{group}/lease"


def current_lease(store: Store, namespace: str, group: str) -> Lease | None:
    """The lease of ``group`` as the store has it now (None: free, absent or malformed)."""
    raw = store.try_get(lease_key(namespace, group))
    if raw is None or raw == FREE:
        return None
    try:
        return Lease.decode(raw)
    except WireFormatError:
        return None
